#!/usr/bin/env python
"""German-English Bible corpus for the quickstart: fetch, align, split, BPE, score.

The command line only; the code is :mod:`deepinit_tools.prepare_bible`.
"""

import sys

from deepinit_tools.prepare_bible import main

if __name__ == "__main__":
    sys.exit(main())
