#!/usr/bin/env python
"""What holds the GPU idle in a fairseq training step: phases and torch.profiler.

The command line only; the code is :mod:`deepinit_tools.bench.gpu_profile`.
"""

from deepinit_tools.bench.gpu_profile import main

if __name__ == "__main__":
    main()
