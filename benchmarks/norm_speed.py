#!/usr/bin/env python
"""ScaleNorm, RMSNorm, DyT and Derf against LayerNorm, side by side: speed per call and kernels per call.

The command line only; the code is :mod:`deepinit_tools.bench.norm_speed`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python benchmarks/norm_speed.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.bench.norm_speed import main  # noqa: E402

if __name__ == "__main__":
    main()
