"""Where an export is written: the checks of the output path and the write by rename.

- :func:`check_arguments`: the output name and ``--tolerance`` (finite, >= 0), before anything is read;
- :func:`check_destination`: an output the export must not write. It never replaces:

  - the checkpoint being exported, a folder holding it, or a file named as fairseq-train names its checkpoints
    (``checkpoint*.pt``: ``checkpoint_best.pt``, ``checkpoint_last.pt``, ``checkpoint12.pt``,
    ``checkpoint_3_500.pt``, ``checkpoint.best_loss_4.12.pt``, :data:`RUN_CHECKPOINT`) in the folder of the
    checkpoint being exported (the run's ``--save-dir``): not even with ``--force``, and not where no such file
    exists yet either, as fairseq-train would resume from it;
  - an existing output without ``--force``; with it, an existing file (``--to fairseq``), a CTranslate2 model
    folder (one holding ``model.bin``) or a transformers model folder (``model.safetensors``); a folder holding
    anything else is refused all the same. An empty
    folder is no loss and is written without ``--force``;
- :func:`remove_stale_temporaries`: what an export killed before its rename (``kill -9``, a power cut) left
  beside the output, removed by the next export to that output (a previous export it had moved aside is put
  back first);
- :func:`save_atomically`: the write to a temporary beside the output and the rename into place.

A temporary is named ``.<output name>.<host>.<pid>.tmp`` (and ``.old`` for a folder moved aside): the host
and process that write it, so that a later export on the same host can tell a dead writer's (``os.kill(pid,
0)`` fails) from a live one's, and leaves other hosts' temporaries (a shared file system) alone.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import os
import re
import shutil
import socket
from dataclasses import dataclass
from typing import Callable, Tuple

from .. import errors
from ..errors import ExportError

#: fairseq-train's checkpoint names (fairseq/checkpoint_utils.py, ``save_checkpoint``'s ``checkpoint_conds``)
RUN_CHECKPOINT = "checkpoint*.pt"


@dataclass(frozen=True)
class ModelFolder:
    """A model that is a folder: ``what`` it is (the messages), and the files one of which marks it as such."""

    what: str
    markers: Tuple[str, ...]

    def holds(self, folder: str) -> bool:
        return any(os.path.isfile(os.path.join(folder, m)) for m in self.markers)


CT2_FOLDER = ModelFolder("a CTranslate2 model", ("model.bin",))
HF_FOLDER = ModelFolder("a transformers model", ("model.safetensors", "model.safetensors.index.json"))


def check_arguments(dst: str, tolerance: float) -> None:
    """Refuse an empty output name or a ``--tolerance`` that is not a finite number >= 0 (before any work)."""
    if not str(dst).strip():
        raise ExportError(
            "the output name is empty; give the file (--to fairseq) or folder (--to ctranslate2 / huggingface)"
        )
    if not (isinstance(tolerance, (int, float)) and math.isfinite(tolerance) and tolerance >= 0):
        raise ExportError(f"--tolerance {tolerance}: give a finite number >= 0 (default 1e-4)")


def _host() -> str:
    """This host's name as a temporary's name holds it (no dot or path separator)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def temporary(dst: str, pid: int | None = None) -> str:
    """The temporary path beside ``dst`` that process ``pid`` (this one by default) writes it to."""
    parent = os.path.dirname(os.path.abspath(dst))
    name = os.path.basename(os.path.normpath(dst))
    return os.path.join(parent, f".{name}.{_host()}.{os.getpid() if pid is None else pid}.tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def remove_stale_temporaries(dst: str) -> list:
    """Remove the temporaries of exports to ``dst`` whose process on this host is gone; returns their paths.

    A killed folder export may have moved the previous export aside (``.tmp.old``) without renaming the new one
    into place: that previous export is renamed back to ``dst`` when ``dst`` is missing, not removed.
    """
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        return []
    prefix = re.escape(f".{os.path.basename(os.path.normpath(dst))}.{_host()}.")
    pattern = re.compile(prefix + r"(\d+)\.tmp(\.old)?$")
    removed = []
    for entry in sorted(os.listdir(parent), key=lambda e: e.endswith(".old")):  # a new export's before its old one
        match = pattern.match(entry)
        if match is None or int(match.group(1)) == os.getpid() or _alive(int(match.group(1))):
            continue
        path = os.path.join(parent, entry)
        if match.group(2) and not os.path.lexists(dst):
            with contextlib.suppress(OSError):
                os.replace(path, dst)
                continue
        _remove(path)
        removed.append(path)
    return removed


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def _run_checkpoint(src: str, dst: str) -> bool:
    """``dst`` is (or would be) a checkpoint of the run ``src`` belongs to: ``checkpoint*.pt`` in its folder."""
    folder = os.path.dirname(os.path.abspath(src))
    if not fnmatch.fnmatch(os.path.basename(os.path.normpath(dst)), RUN_CHECKPOINT):
        return False
    return _same_file(os.path.dirname(os.path.abspath(dst)), folder)


def check_destination(src: str, dst: str, folder: ModelFolder | None = None, force: bool = False) -> None:
    """Refuse, before the checkpoint is read, an output the export cannot or must not write (module docstring).

    A missing parent folder is created when the export is written, as fairseq-train creates its ``--save-dir``.
    """
    if _same_file(dst, src):
        raise ExportError(
            f"the output {dst} is the input checkpoint; the export would replace it. Give another file name, e.g. "
            f"{os.path.splitext(dst)[0]}.exported.pt"
        )
    if _run_checkpoint(src, dst):
        raise ExportError(
            f"the output {dst} is a checkpoint name of the run {src} comes from (fairseq-train would resume from or "
            f"replace it; --force does not change that); give a name outside {RUN_CHECKPOINT} or another folder"
        )
    if os.path.isdir(dst) and os.path.commonpath([os.path.realpath(dst), os.path.realpath(src)]) == os.path.realpath(
        dst
    ):
        raise ExportError(f"the output {dst} is a folder that holds the input checkpoint {src}; give a new folder")
    remove_stale_temporaries(dst)
    if folder:
        if os.path.exists(dst) and not os.path.isdir(dst):
            raise ExportError(f"the output {dst} is a file; {folder.what} is a folder: give a folder name")
        if os.path.isdir(dst) and os.listdir(dst):
            if not folder.holds(dst):
                raise ExportError(
                    f"the output folder {dst} is not empty and holds no {folder.what[2:]}; give a new folder"
                )
            if not force:
                raise ExportError(f"the output {dst} exists ({folder.what}); give --force to replace it")
    elif os.path.isdir(dst):
        raise ExportError(
            f"the output {dst} is a folder; give the exported checkpoint's file name, e.g. "
            f"{os.path.join(dst, 'checkpoint.exported.pt')}"
        )
    elif os.path.lexists(dst) and not force:
        raise ExportError(f"the output {dst} exists; give --force to replace it, or another file name")
    existing = os.path.dirname(os.path.abspath(dst))
    while not os.path.exists(existing):  # the deepest folder that exists (the root always does)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ExportError(f"the output {dst} cannot be written: {existing} is a file, not a folder")


def save_atomically(write: Callable[[str], None], dst: str) -> None:
    """``write(tmp)`` to a temporary path beside ``dst`` (:func:`temporary`), then a rename: ``dst`` is either what
    it was or the whole export (a folder replaces the old folder), and a failed write (disk full, no permission)
    is one :class:`~fairseq_deepinit.errors.ExportError`."""
    parent = os.path.dirname(os.path.abspath(dst))
    tmp = temporary(dst)
    old = tmp + ".old"
    moved = False
    try:
        os.makedirs(parent, exist_ok=True)
        write(tmp)
        if os.path.isdir(dst):
            os.replace(dst, old)
            moved = True
        os.replace(tmp, dst)
        moved = False
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        if moved:
            with contextlib.suppress(OSError):
                os.replace(old, dst)  # the previous export back in place
        raise ExportError(f"cannot write {dst}: {errors.one_line(e)}") from e
    finally:
        for path in (tmp, old):
            _remove(path)
