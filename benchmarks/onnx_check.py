#!/usr/bin/env python
"""ONNX export of transformers model folders (FSMT, M2M100, XGLM) with torch.onnx: onnxruntime's logits against
the PyTorch model's, max |difference| per model, exit status 1 above --tolerance or when an export fails.

The command line only; the code is :mod:`deepinit_tools.bench.onnx_check`.
"""

import sys
from pathlib import Path

# the checkout first, so that `python benchmarks/onnx_check.py` runs from any folder without PYTHONPATH and
# imports this checkout's tools and plugin, never an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepinit_tools.bench.onnx_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
