#!/usr/bin/env python
"""CUDA smoke test of every architecture: train 3 steps in fp16 and in bf16 autocast,
decode a batch with beam 4, count host syncs, name the SDPA backend of every attention kind.

The command line only; the code is :mod:`deepinit_tools.bench.gpu_smoke`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python benchmarks/gpu_smoke.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.bench.gpu_smoke import main  # noqa: E402

if __name__ == "__main__":
    main()
