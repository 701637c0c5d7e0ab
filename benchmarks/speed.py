#!/usr/bin/env python
"""fairseq-train tokens/s, loss curve and peak memory for the speed options (docs/speed.md).

The command line only; the code is :mod:`deepinit_tools.bench.speed`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python benchmarks/speed.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.bench.speed import main  # noqa: E402

if __name__ == "__main__":
    main()
