#!/usr/bin/env python
"""Merge the files a GPU session brought back into ``docs/benchmarks/gpu.json`` .

The command line only; the code is :mod:`deepinit_tools.bench.gpu_results`.
"""

import sys

from deepinit_tools.bench.gpu_results import main

if __name__ == "__main__":
    sys.exit(main())
