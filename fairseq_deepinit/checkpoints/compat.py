"""Loading fairseq checkpoints under torch >= 2.6 without turning ``weights_only`` off.

torch >= 2.6 unpickles ``torch.load`` files with ``weights_only=True`` by default, which refuses
the one non-tensor object fairseq stores in a checkpoint: the ``argparse.Namespace`` of the
training arguments. Instead of
loading with ``weights_only=False`` (arbitrary code execution from a checkpoint file), the plugin
allow-lists exactly those types with :func:`torch.serialization.add_safe_globals` when it is
imported (``--user-dir``). Anything else in a checkpoint is still refused.

Without ``--user-dir`` nothing runs this, so fairseq-generate / fairseq-train on any checkpoint
fail at ``torch.load`` ("Unsupported global: GLOBAL argparse.Namespace"); see docs/usage.md.
"""

from __future__ import annotations

import argparse
import os
from typing import List

import torch

from ..errors import UnsafeCheckpointError

# Exactly what fairseq 0.12's ``save_checkpoint`` pickles besides tensors and plain containers
# (``torch.serialization.get_unsafe_globals_in_checkpoint`` on a checkpoint written by
# fairseq-train lists only this; tests/test_cli.py re-checks it for every architecture family).
FAIRSEQ_CHECKPOINT_GLOBALS = (argparse.Namespace,)

PathLike = str | os.PathLike


def install() -> None:
    """Allow-list fairseq's checkpoint types for ``torch.load(weights_only=True)``."""
    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals(list(FAIRSEQ_CHECKPOINT_GLOBALS))


def allowed_global_names() -> List[str]:
    """``module.qualname`` of every allow-listed type, as torch spells them."""
    return [f"{c.__module__}.{c.__qualname__}" for c in FAIRSEQ_CHECKPOINT_GLOBALS]


def pickled_globals(path: PathLike) -> List[str]:
    """Every global in ``path`` that torch does not accept by default, allow-listed by us or not.

    :func:`torch.serialization.get_unsafe_globals_in_checkpoint` hides whatever is allow-listed in
    this process, so the process-wide list is emptied while it scans (statically: nothing in the
    file is executed) and restored afterwards.
    """
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    finally:
        torch.serialization.add_safe_globals(saved)


def disallowed_globals(path: PathLike) -> List[str]:
    """The globals of ``path`` that ``torch.load(weights_only=True)`` will refuse even with the plugin."""
    allowed = set(allowed_global_names())
    return [g for g in pickled_globals(path) if g not in allowed]


def check_checkpoint(path: PathLike) -> None:
    """Raise :class:`UnsafeCheckpointError`, naming the classes, if ``path`` will not load safely."""
    bad = disallowed_globals(path)
    if bad:
        raise UnsafeCheckpointError(
            f"{path} pickles {', '.join(bad)}, which fairseq-train does not write and fairseq-deepinit does not "
            f"allow-list (allowed: {', '.join(allowed_global_names())}), so torch.load(weights_only=True) refuses "
            "it. The file was modified or written by other code; load it with weights_only=False only if you "
            "trust its origin, and re-save the tensors you need."
        )
