#!/usr/bin/env python
"""Kernels per optimizer step and per update, and host reads, of adam, adam_foreach and muon, side by side (CPU
counters of what a GPU would launch).

The command line only; the code is :mod:`deepinit_tools.bench.optimizer_kernels`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python benchmarks/optimizer_kernels.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.bench.optimizer_kernels import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
