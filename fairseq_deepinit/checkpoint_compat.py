"""Loading fairseq checkpoints under torch >= 2.6 without turning ``weights_only`` off.

torch >= 2.6 unpickles ``torch.load`` files with ``weights_only=True`` by default, which refuses
the one non-tensor object fairseq stores in a checkpoint: the ``argparse.Namespace`` of the
training arguments. Instead of
loading with ``weights_only=False`` (arbitrary code execution from a checkpoint file), the plugin
allow-lists exactly those types with :func:`torch.serialization.add_safe_globals` when it is
imported (``--user-dir``). Anything else in a checkpoint is still refused.
"""

from __future__ import annotations

import argparse

import torch

# Exactly what fairseq 0.12's ``save_checkpoint`` pickles besides tensors and plain containers
# (``torch.serialization.get_unsafe_globals_in_checkpoint`` on a checkpoint written by
# fairseq-train lists only this; tests/test_cli.py re-checks it on every run).
FAIRSEQ_CHECKPOINT_GLOBALS = (argparse.Namespace,)


def install() -> None:
    """Allow-list fairseq's checkpoint types for ``torch.load(weights_only=True)``."""
    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals(list(FAIRSEQ_CHECKPOINT_GLOBALS))
