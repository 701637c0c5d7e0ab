#!/usr/bin/env python
"""One lent GPU, one device command: the smoke test of every architecture, the 6-layer speed rows and
the 18-layer paper cells trained side by side, under one wall-clock budget (docs/benchmarks.md,
"GPU session"). ``prepare`` and ``paste`` run here, before and after the device call.

The command line only; the code is :mod:`deepinit_tools.session`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python benchmarks/gpu_session.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.session.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
