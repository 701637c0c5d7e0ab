#!/usr/bin/env python
"""Raw sentences through a Hugging Face model folder written by deepinit-export --to huggingface, with transformers
alone: its tokenizer, generate with fairseq-generate's search, detokenised (and optionally BLEU, speed and identical
outputs beside fairseq-generate's).

The command line only; the code is :mod:`deepinit_tools.hf_translate`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python scripts/translate_hf.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.hf_translate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
