#!/usr/bin/env python
"""Progress of a running fairseq-generate: sentences translated of the total, while it translates.

The command line only; the code is :mod:`deepinit_tools.generate_progress`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python scripts/generate_progress.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.generate_progress import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
