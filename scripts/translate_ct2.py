#!/usr/bin/env python
"""Raw sentences through a CTranslate2 model written by deepinit-export: tokenise, BPE, beam search as
fairseq-generate, detokenise (and optionally BLEU, speed and identical outputs beside fairseq-generate's).

The command line only; the code is :mod:`deepinit_tools.ct2_translate`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python scripts/translate_ct2.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.ct2_translate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
