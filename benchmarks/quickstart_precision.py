#!/usr/bin/env python
"""The quickstart's model in fp32 and in bf16 autocast, side by side: updates per CPU second, loss after N updates.

The command line only; the code is :mod:`deepinit_tools.bench.quickstart_precision`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python benchmarks/quickstart_precision.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.bench.quickstart_precision import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
