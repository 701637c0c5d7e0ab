#!/usr/bin/env python
"""Progress of a running fairseq-train: updates done of --max-update, and the time left at this pace.

The command line only; the code is :mod:`deepinit_tools.train_progress`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python scripts/train_progress.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.train_progress import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
