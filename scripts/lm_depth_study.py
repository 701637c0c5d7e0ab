#!/usr/bin/env python
"""Depth study of decoder-only language models on the English Bible (KJV), on the CPU.

The command line only; the code is :mod:`deepinit_tools.lm_depth_study`.
"""

import sys

from deepinit_tools.lm_depth_study import main

if __name__ == "__main__":
    sys.exit(main())
