#!/usr/bin/env python
"""Training throughput and peak memory of the plugin's schemes against stock fairseq ``transformer``.

The command line only; the code is :mod:`deepinit_tools.bench.throughput`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python benchmarks/throughput.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.bench.throughput import main  # noqa: E402

if __name__ == "__main__":
    main()
