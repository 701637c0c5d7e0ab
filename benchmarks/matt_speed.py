#!/usr/bin/env python
"""Decoding and training speed of MAtt against the standard decoder, with the real fairseq CLIs.

The command line only; the code is :mod:`deepinit_tools.bench.matt_speed`.
"""

from deepinit_tools.bench.matt_speed import main

if __name__ == "__main__":
    main()
