#!/usr/bin/env python
"""Find Multi30k de-en (task 1, raw gzip files) for the Multi30k tools, downloading it if need be.

The command line only; the code is :mod:`deepinit_tools.multi30k`.
"""

import sys

from deepinit_tools.multi30k import main

if __name__ == "__main__":
    sys.exit(main())
