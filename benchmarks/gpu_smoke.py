#!/usr/bin/env python
"""CUDA smoke test of every architecture: train 3 steps in fp16 and in bf16 autocast,
decode a batch with beam 4, count host syncs, name the SDPA backend of every attention kind.

The command line only; the code is :mod:`deepinit_tools.bench.gpu_smoke`.
"""

from deepinit_tools.bench.gpu_smoke import main

if __name__ == "__main__":
    main()
