#!/usr/bin/env python
"""Training throughput and peak memory of the plugin's schemes against stock fairseq ``transformer``.

The command line only; the code is :mod:`deepinit_tools.bench.throughput`.
"""

from deepinit_tools.bench.throughput import main

if __name__ == "__main__":
    main()
