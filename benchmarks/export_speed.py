#!/usr/bin/env python
"""fairseq-generate against the CTranslate2 export of the same model (float32, int8): tokens/s, ratio, BLEU,
identical outputs, at 1 and 2 threads.

The command line only; the code is :mod:`deepinit_tools.bench.export_speed`.
"""

import sys

from deepinit_tools.bench.export_speed import main

if __name__ == "__main__":
    sys.exit(main())
