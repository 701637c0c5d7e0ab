#!/usr/bin/env python
"""z-loss and QK-Clip against the same Pre-LN update without them, side by side: speed, kernels, host reads.

The command line only; the code is :mod:`deepinit_tools.bench.stabiliser_cost`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python benchmarks/stabiliser_cost.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.bench.stabiliser_cost import main  # noqa: E402

if __name__ == "__main__":
    main()
