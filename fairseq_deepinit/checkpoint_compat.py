"""Loading fairseq checkpoints under torch >= 2.6 without turning ``weights_only`` off.

torch >= 2.6 unpickles ``torch.load`` files with ``weights_only=True`` by default, which refuses
the few non-tensor objects fairseq stores in a checkpoint (an ``argparse.Namespace`` of the
training arguments and a handful of builtins/numpy scalars in the meters' state). Instead of
loading with ``weights_only=False`` (arbitrary code execution from a checkpoint file), the plugin
allow-lists exactly those types with :func:`torch.serialization.add_safe_globals` when it is
imported (``--user-dir``). Anything else in a checkpoint is still refused.
"""

from __future__ import annotations

import argparse
import collections

import numpy as np
import torch

def _numpy_scalar_globals() -> list:
    out = []
    try:  # numpy >= 2 moved the pickling helper; both names appear in the wild
        from numpy._core.multiarray import scalar

        out.append(scalar)
    except ImportError:  # pragma: no cover - numpy < 2
        pass
    for name in ("float64", "float32", "int64", "int32", "bool_"):
        out.append(type(np.dtype(name)))
    return out


def allowed_globals() -> list:
    items = [argparse.Namespace, collections.OrderedDict, collections.defaultdict, np.dtype]
    items += _numpy_scalar_globals()
    return items


def install() -> None:
    """Allow-list fairseq's checkpoint types for ``torch.load(weights_only=True)``."""
    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals(allowed_globals())
