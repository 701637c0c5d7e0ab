#!/usr/bin/env python
"""ScaleNorm, RMSNorm, DyT and Derf against LayerNorm, side by side: speed per call and kernels per call.

The command line only; the code is :mod:`deepinit_tools.bench.norm_speed`.
"""

from deepinit_tools.bench.norm_speed import main

if __name__ == "__main__":
    main()
