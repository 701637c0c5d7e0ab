#!/usr/bin/env python
"""Hyper-connections, mHC and Attention Residuals against Pre-LN, side by side: time, saved activations, peak
memory and kernels of one training update.

The command line only; the code is :mod:`deepinit_tools.bench.hc_cost`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python benchmarks/hc_cost.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.bench.hc_cost import main  # noqa: E402

if __name__ == "__main__":
    main()
