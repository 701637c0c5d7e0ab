#!/usr/bin/env python
"""Stability matrix and BLEU table of every scheme on Multi30k de-en (``docs/results.md``).

The command line only; the code is :mod:`deepinit_tools.multi30k_matrix`.
"""

import sys

from deepinit_tools.multi30k_matrix import main

if __name__ == "__main__":
    sys.exit(main())
