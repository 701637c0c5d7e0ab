#!/usr/bin/env python
"""fairseq-generate against the CTranslate2 export of the same model (float32, int8): tokens/s, ratio, BLEU,
identical outputs, at 1 and 2 threads.

The command line only; the code is :mod:`deepinit_tools.bench.export_speed`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python benchmarks/export_speed.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.bench.export_speed import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
