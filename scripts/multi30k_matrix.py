#!/usr/bin/env python
"""Stability matrix and BLEU table of every scheme on Multi30k de-en (``docs/results.md``).

The command line only; the code is :mod:`deepinit_tools.multi30k_matrix`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python scripts/multi30k_matrix.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.multi30k_matrix import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
