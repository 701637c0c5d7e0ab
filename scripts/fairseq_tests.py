#!/usr/bin/env python
"""fairseq's own tests without and with the plugin imported: no test may fail only with the plugin.

The command line only; the code is :mod:`deepinit_tools.fairseq_tests`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python scripts/fairseq_tests.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.fairseq_tests import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
