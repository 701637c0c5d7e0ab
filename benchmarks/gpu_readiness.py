#!/usr/bin/env python
"""What a GPU will see, measured without one: a table over every architecture family.

The command line only; the code is :mod:`deepinit_tools.bench.gpu_readiness`.
"""

import sys

from deepinit_tools.bench.gpu_readiness import main

if __name__ == "__main__":
    sys.exit(main())
