#!/usr/bin/env python
"""mHC's mapping in fp32 (this project's choice) against the same mapping in bf16, under bf16 autocast, side by
side: time, saved activations, peak memory and kernels of one training update and of the mapping alone, and the
mapping's deviation from float64.

The command line only; the code is :mod:`deepinit_tools.bench.mhc_precision`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python benchmarks/mhc_precision.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.bench.mhc_precision import main  # noqa: E402

if __name__ == "__main__":
    main()
