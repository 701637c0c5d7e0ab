#!/usr/bin/env python
"""What holds the GPU idle in a fairseq training step: phases and torch.profiler.

The command line only; the code is :mod:`deepinit_tools.bench.gpu_profile`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python benchmarks/gpu_profile.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.bench.gpu_profile import main  # noqa: E402

if __name__ == "__main__":
    main()
