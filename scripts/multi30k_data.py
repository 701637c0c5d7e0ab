#!/usr/bin/env python
"""Find Multi30k de-en (task 1, raw gzip files) for the Multi30k tools, downloading it if need be.

The command line only; the code is :mod:`deepinit_tools.multi30k`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python scripts/multi30k_data.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.multi30k import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
