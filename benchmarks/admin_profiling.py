#!/usr/bin/env python
"""What Admin's in-training profiling costs, as a share of one training epoch on Multi30k de-en.

The command line only; the code is :mod:`deepinit_tools.bench.admin_profiling`.
"""

import sys

from deepinit_tools.bench.admin_profiling import main

if __name__ == "__main__":
    sys.exit(main())
