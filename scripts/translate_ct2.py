#!/usr/bin/env python
"""Raw sentences through a CTranslate2 model written by deepinit-export: tokenise, BPE, beam search as
fairseq-generate, detokenise (and optionally BLEU, speed and identical outputs beside fairseq-generate's).

The command line only; the code is :mod:`deepinit_tools.ct2_translate`.
"""

import sys

from deepinit_tools.ct2_translate import main

if __name__ == "__main__":
    sys.exit(main())
