#!/usr/bin/env python
"""One lent GPU, one device command: the smoke test of every architecture, the 6-layer speed rows and
the 18-layer paper cells trained side by side, under one wall-clock budget (docs/benchmarks.md,
"GPU session"). ``prepare`` and ``paste`` run here, before and after the device call.

The command line only; the code is :mod:`deepinit_tools.session`.
"""

import sys

from deepinit_tools.session.cli import main

if __name__ == "__main__":
    sys.exit(main())
