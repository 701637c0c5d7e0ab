#!/usr/bin/env python
"""German-English Bible corpus for the quickstart: fetch, align, split, BPE, score.

The command line only; the code is :mod:`deepinit_tools.prepare_bible`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python scripts/prepare_bible.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.prepare_bible import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
