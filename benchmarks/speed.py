#!/usr/bin/env python
"""fairseq-train tokens/s, loss curve and peak memory for the speed options (docs/speed.md).

The command line only; the code is :mod:`deepinit_tools.bench.speed`.
"""

from deepinit_tools.bench.speed import main

if __name__ == "__main__":
    main()
