"""Loading fairseq checkpoints under torch >= 2.6 without turning ``weights_only`` off.

torch >= 2.6 unpickles ``torch.load`` files with ``weights_only=True`` by default, which refuses
the one non-tensor object fairseq stores in a checkpoint: the ``argparse.Namespace`` of the
training arguments. Instead of
loading with ``weights_only=False`` (arbitrary code execution from a checkpoint file), the plugin
allow-lists exactly those types with :func:`torch.serialization.add_safe_globals` when it is
imported (``--user-dir``). Anything else in a checkpoint is still refused, with one exception that is data, not
code: numpy arrays and scalars of numeric dtypes (the BLEU counts that ``--eval-bleu`` keeps in the metrics
state), which the plugin's own loaders (:func:`.numpy_data.loading`: resume, ``--path``, the tools) rebuild
from checked values without running numpy's unpickling code; see :mod:`.numpy_data`.

Without ``--user-dir`` nothing runs this, so fairseq-generate / fairseq-train on any checkpoint
fail at ``torch.load`` ("Unsupported global: GLOBAL argparse.Namespace"); see docs/usage.md.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import os
from typing import List

import torch

from ..errors import UnsafeCheckpointError
from . import numpy_data

# Exactly what fairseq 0.12's ``save_checkpoint`` pickles besides tensors and plain containers
# (``torch.serialization.get_unsafe_globals_in_checkpoint`` on a checkpoint written by
# fairseq-train lists only this; tests/test_cli.py re-checks it for every architecture family).
FAIRSEQ_CHECKPOINT_GLOBALS = (argparse.Namespace,)

PathLike = str | os.PathLike


def allowed_global_names() -> List[str]:
    """``module.qualname`` of every allow-listed type, as torch spells them."""
    return [f"{c.__module__}.{c.__qualname__}" for c in FAIRSEQ_CHECKPOINT_GLOBALS]


def resolved_global_name(raw: str) -> str:
    """A pickled global as Python's own unpickler would resolve it: the code that would have run.

    torch drops the ``builtins.`` of builtins (``exec``), and pickle protocol 2 (torch.save's)
    stores some modules under their Python 2 names (``subprocess.Popen`` as ``commands.Popen``),
    which ``pickle.load`` maps back (``fix_imports``).
    """
    module, _, name = raw.rstrip(".").rpartition(".")
    module = module or "builtins"
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def pickled_globals(path: PathLike) -> List[str]:
    """Every global in ``path`` that torch does not accept by default, allow-listed by us or not.

    :func:`torch.serialization.get_unsafe_globals_in_checkpoint` hides whatever is allow-listed in
    this process, so the process-wide list is emptied while it scans (statically: nothing in the
    file is executed) and restored afterwards.
    """
    with numpy_data.LOCK:  # not while a plugin load has its stand-ins on the list
        saved = torch.serialization.get_safe_globals()
        torch.serialization.clear_safe_globals()
        try:
            return [resolved_global_name(g) for g in torch.serialization.get_unsafe_globals_in_checkpoint(str(path))]
        finally:
            torch.serialization.add_safe_globals(saved)


def accepted_global_name(name: str) -> bool:
    """Whether the plugin's loaders take a pickled global: the allow-list, and numpy's names for numeric
    data (whose dtypes are checked when the file is loaded, :mod:`.numpy_data`)."""
    return name in allowed_global_names() or name in numpy_data.GLOBAL_NAMES


def disallowed_globals(path: PathLike) -> List[str]:
    """The globals of ``path`` that the plugin's loaders refuse whatever they hold (a static scan: numpy's
    names pass it, their dtypes are checked by loading, :func:`check_checkpoint`)."""
    return sorted({g for g in pickled_globals(path) if not accepted_global_name(g)})


USE_ANOTHER = (
    "Use a checkpoint written by fairseq-train instead, for example another checkpoint*.pt of the same save dir"
)


def refused_file_error(path: PathLike, names: List[str], instead: str = "") -> UnsafeCheckpointError:
    """The one line for a file that torch refused: which file, which globals, that nothing of it ran.

    Never advice to load it with the check off: a checkpoint written by fairseq-train holds nothing
    that needs it, so such a file was modified or written by other code.
    """
    what = ", ".join(names) if names else "a class or function outside torch's weights_only allow-list"
    return UnsafeCheckpointError(
        f"checkpoint {os.fspath(path)} was refused (nothing in it was run): it pickles {what}, which a checkpoint "
        "written by fairseq-train never holds (fairseq-deepinit allows tensors, plain containers, "
        f"{', '.join(allowed_global_names())} and {numpy_data.DESCRIPTION} only), so loading stopped at it. The "
        f"file was modified or written by other code; do not load it. {instead or USE_ANOTHER}"
    )


def check_checkpoint(path: PathLike) -> None:
    """Raise :class:`UnsafeCheckpointError`, naming the globals, if ``path`` will not load safely.

    A static scan; a file that pickles numpy data is then loaded under :func:`.numpy_data.loading` (which
    runs nothing of the file) to check its dtypes."""
    found = pickled_globals(path)
    bad = sorted({g for g in found if not accepted_global_name(g)})
    if bad:
        raise refused_file_error(path, bad)
    if any(g in numpy_data.GLOBAL_NAMES for g in found):
        try:
            numpy_data.load(path, map_location="cpu", weights_only=True)
        except numpy_data.NumpyDataRefused as e:
            raise refused_file_error(path, e.names) from None
