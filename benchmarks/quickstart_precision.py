#!/usr/bin/env python
"""The quickstart's model in fp32 and in bf16 autocast, side by side: updates per CPU second, loss after N updates.

The command line only; the code is :mod:`deepinit_tools.bench.quickstart_precision`.
"""

import sys

from deepinit_tools.bench.quickstart_precision import main

if __name__ == "__main__":
    sys.exit(main())
