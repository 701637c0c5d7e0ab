#!/usr/bin/env python
"""Depth study of decoder-only language models on the English Bible (KJV), on the CPU.

The command line only; the code is :mod:`deepinit_tools.lm_depth_study`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python scripts/lm_depth_study.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.lm_depth_study import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
