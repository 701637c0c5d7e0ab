#!/usr/bin/env python
"""What Admin's in-training profiling costs, as a share of one training epoch on Multi30k de-en.

The command line only; the code is :mod:`deepinit_tools.bench.admin_profiling`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python benchmarks/admin_profiling.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.bench.admin_profiling import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
