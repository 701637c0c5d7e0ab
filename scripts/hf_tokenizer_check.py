#!/usr/bin/env python
"""The Hugging Face export's tokenizer against the data pipeline it stands for, line by line.

The command line only; the code is :mod:`deepinit_tools.hf_tokenizer_check`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python scripts/hf_tokenizer_check.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.hf_tokenizer_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
