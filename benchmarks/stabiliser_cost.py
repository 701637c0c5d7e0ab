#!/usr/bin/env python
"""z-loss and QK-Clip against the same Pre-LN update without them, side by side: speed, kernels, host reads.

The command line only; the code is :mod:`deepinit_tools.bench.stabiliser_cost`.
"""

from deepinit_tools.bench.stabiliser_cost import main

if __name__ == "__main__":
    main()
