#!/usr/bin/env python
"""Hyper-connections and mHC against Pre-LN, side by side: time, saved activations, peak memory and kernels of
one training update.

The command line only; the code is :mod:`deepinit_tools.bench.hc_cost`.
"""

from deepinit_tools.bench.hc_cost import main

if __name__ == "__main__":
    main()
