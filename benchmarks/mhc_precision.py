#!/usr/bin/env python
"""mHC's mapping in fp32 (this project's choice) against the same mapping in bf16, under bf16 autocast, side by
side: time, saved activations, peak memory and kernels of one training update and of the mapping alone, and the
mapping's deviation from float64.

The command line only; the code is :mod:`deepinit_tools.bench.mhc_precision`.
"""

from deepinit_tools.bench.mhc_precision import main

if __name__ == "__main__":
    main()
