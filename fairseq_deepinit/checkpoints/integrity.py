"""Is a checkpoint file intact, and which checkpoint of a save dir is the newest intact one.

Cheap checks first (size, the zip's table of contents, the pickled record without its tensors), a
full read of the file that is chosen. A damaged file gives :class:`~fairseq_deepinit.errors.CheckpointFileError`,
a file that torch's ``weights_only`` loader refuses (it pickles a class or function that a fairseq
checkpoint never holds: ``posix.system``, ``subprocess.Popen``, ``builtins.exec``, ...) gives
:class:`~fairseq_deepinit.errors.UnsafeCheckpointError`; each is one line that names the file, what
is wrong and what to do, and neither repeats torch's advice to load the file with the check off.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from typing import Any, List, Tuple

import torch
from fairseq.file_io import PathManager

from ..errors import CheckpointFileError, UnsafeCheckpointError
from .compat import allowed_global_names, refused_file_error, resolved_global_name

PathLike = str | os.PathLike


@dataclass
class CheckpointStatus:
    """What :func:`inspect_checkpoint` found: ``reason`` is None for an intact file."""

    path: str
    reason: str | None = None
    missing: bool = False
    refused: bool = False  # torch's weights_only refusal (unexpected class), not damage
    refused_globals: List[str] = field(default_factory=list)  # what it pickles that torch refuses
    num_updates: int | None = None
    model_args: argparse.Namespace | dict | None = field(default=None, repr=False)  # dict: fairseq-hydra-train's

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def damaged(self) -> bool:
        return not self.ok and not self.missing and not self.refused


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _load_error(e: BaseException) -> str:
    """The informative part of a torch.load error, without torch's hint to turn ``weights_only`` off."""
    m = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(e))
    return f"{type(e).__name__}: {m.group(1)[:200]}" if m else _first_line(e)


# How torch words a weights_only refusal that names what it refused: the same strings in
# torch/_weights_only_unpickler.py of torch 2.10, 2.13 (this stack) and a later main-branch snapshot,
# so also in 2.11 (the GPU image); a wording none of these matches is reported as damage, never run:
#   "Unsupported global: GLOBAL subprocess.Popen was not an allowed global by default. ..."
#   "Trying to load unsupported GLOBAL posix.system whose module posix is blocked."  (sys, os, posix, nt)
#   "Can only build Tensor, Parameter, OrderedDict or types allowlisted via `add_safe_globals`, but got <class 'x.Y'>"
#   "Unsupported class x.Y"  (torch < 2.4)
_REFUSED = (
    re.compile(r"GLOBAL (\S+) was not an allowed global"),
    re.compile(r"unsupported GLOBAL (\S+) whose module \S+ is blocked", re.IGNORECASE),
    re.compile(r"Can only (?:build|create new object)[^\n]* but got <class '([^']+)'>"),
    re.compile(r"Unsupported class (\S+)"),
)
_NAME = re.compile(r"[A-Za-z_][\w.]*")


def refused_globals(path: PathLike, error: BaseException) -> List[str] | None:
    """What torch's ``weights_only`` loader refused in ``path``, or None if ``error`` is no such refusal.

    The global that stopped the load comes from torch's message; for a zip checkpoint every other
    refused global is added from a static scan of its pickle
    (``torch.serialization.get_unsafe_globals_in_checkpoint``: nothing is executed).
    """
    if not isinstance(error, pickle.UnpicklingError):
        return None
    found = [m.group(1) for pattern in _REFUSED for m in pattern.finditer(str(error))]
    names = [resolved_global_name(n) for n in found if _NAME.fullmatch(n.rstrip("."))]
    if not names:
        return None
    if zipfile.is_zipfile(path) and hasattr(torch.serialization, "get_unsafe_globals_in_checkpoint"):
        with contextlib.suppress(Exception):  # the names torch gave are enough
            names += sorted(
                resolved_global_name(n) for n in torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
            )
    allowed = set(allowed_global_names())
    return [n for n in dict.fromkeys(names) if n not in allowed]


def _saved_model_args(state: Any) -> argparse.Namespace | dict | None:
    """fairseq-train's model Namespace, or the dict fairseq-hydra-train stores (its YAML's ``model`` node)."""
    cfg = state.get("cfg") if isinstance(state, dict) else None
    args = cfg.get("model") if isinstance(cfg, dict) else None
    if isinstance(args, dict) and args.get("_name"):
        return args
    if not isinstance(args, argparse.Namespace) and isinstance(state, dict):
        args = state.get("args")
    return args if isinstance(args, argparse.Namespace) else None


def inspect_checkpoint(path: PathLike, deep: bool = False) -> CheckpointStatus:
    """Check a checkpoint file cheaply: size, zip central directory, then the pickle (memory-mapped).

    ``torch.load(mmap=True, weights_only=True)`` reads the pickled part (``num_updates``, the
    model arguments) without reading the tensors, so this costs milliseconds even for large
    files. ``deep`` also verifies the CRC of every zip member (reads the whole file once).
    Never raises for a bad file; the result says what is wrong.
    """
    path = os.fspath(path)
    st = CheckpointStatus(path)
    if os.path.isdir(path):
        inside = os.path.join(path, "checkpoint_best.pt")
        st.reason = f"is a folder, not a checkpoint file (give a checkpoint file in it: {inside}, ...)"
        return st
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        st.reason, st.missing = "does not exist", True
        return st
    except OSError as e:
        st.reason = f"cannot be read ({_first_line(e)})"
        return st
    if size == 0:
        st.reason = "is empty (0 bytes)"
        return st
    try:
        with open(path, "rb") as f:
            head = f.read(4)
        is_zip = zipfile.is_zipfile(path)
    except OSError as e:
        st.reason = f"cannot be read ({_first_line(e)})"
        return st
    if not is_zip and head == b"PK\x03\x04":
        st.reason = f"is truncated ({size} bytes, no zip central directory: its write was interrupted)"
        return st
    if is_zip:
        try:
            with zipfile.ZipFile(path) as zf:
                if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in zf.namelist()):
                    st.reason = "is a zip file but not a torch checkpoint (no data.pkl)"
                    return st
                if deep:
                    bad = zf.testzip()
                    if bad is not None:
                        st.reason = f"is damaged (CRC mismatch in {bad})"
                        return st
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            st.reason = f"is damaged ({_first_line(e)})"
            return st
    try:
        # not a zip: torch's legacy format or garbage, which only a full load can tell apart
        state = torch.load(path, map_location="cpu", mmap=is_zip, weights_only=True)
    except Exception as e:  # torch reports damage as UnpicklingError, RuntimeError, EOFError, ValueError, ...
        names = refused_globals(path, e)
        if names is not None:
            st.refused, st.refused_globals = True, names
            st.reason = f"pickles {', '.join(names) or 'a global'}, which torch.load(weights_only=True) refuses"
            return st
        what = "is damaged" if is_zip else "is not a torch checkpoint (neither torch's zip nor its legacy format)"
        st.reason = f"{what}: loading it fails with {_load_error(e)}"
        return st
    if not isinstance(state, dict) or "model" not in state:
        st.reason = "is not a fairseq checkpoint (no 'model' entry)"
        return st
    try:
        st.num_updates = int(state["optimizer_history"][-1]["num_updates"])
    except (KeyError, IndexError, TypeError, ValueError):
        st.num_updates = 0
    st.model_args = _saved_model_args(state)
    return st


def checkpoint_candidates(save_dir: PathLike, suffix: str = "", exclude: Tuple[str, ...] = ()) -> List[str]:
    """Every ``checkpoint*{suffix}.pt`` file in ``save_dir`` (fairseq's names), minus ``exclude``."""
    try:
        names = os.listdir(save_dir)
    except OSError:
        return []
    excluded = {os.path.abspath(p) for p in exclude}
    out = []
    for n in names:
        if not (n.startswith("checkpoint") and n.endswith(f"{suffix}.pt")):
            continue
        if not suffix and re.search(r"(-shard\d+|_part\d+)\.pt$", n):
            continue  # another rank's shard
        p = os.path.join(save_dir, n)
        if os.path.abspath(p) not in excluded and os.path.isfile(p):
            out.append(p)
    return sorted(out)


def newest_intact(
    found: List[CheckpointStatus], prefer: str = ""
) -> Tuple[CheckpointStatus | None, List[CheckpointStatus]]:
    """The intact checkpoint with the most saved updates, and the rejected ones (not ok).

    ``found`` are :func:`inspect_checkpoint` results (the cheap check). Ties go to ``prefer`` (the
    save dir's ``checkpoint_last.pt``: the file fairseq itself would load), then to the newest file.
    The chosen one also gets the CRC check (:func:`inspect_checkpoint` with ``deep``), falling back
    to the next if that fails.
    """
    rejected = [s for s in found if not s.ok]
    preferred = os.path.abspath(prefer) if prefer else None

    def mtime(s: CheckpointStatus) -> float:
        with contextlib.suppress(OSError):
            return os.path.getmtime(s.path)
        return 0.0

    def rank(s: CheckpointStatus) -> Tuple[int, bool, float]:
        return (s.num_updates or 0, os.path.abspath(s.path) == preferred, mtime(s))

    for s in sorted((s for s in found if s.ok), key=rank, reverse=True):
        deep = inspect_checkpoint(s.path, deep=True)
        if deep.ok:
            return deep, rejected
        rejected.append(deep)
    return None, rejected


def damaged_file_error(path: PathLike, reason: str) -> CheckpointFileError:
    return CheckpointFileError(
        f"checkpoint {os.fspath(path)} {reason}. Use an intact checkpoint instead (for example another "
        "checkpoint*.pt of the same save dir), or delete this one"
    )


def status_error(st: CheckpointStatus, instead: str = "") -> CheckpointFileError | UnsafeCheckpointError | None:
    """The error to raise for a damaged or refused file (None for an intact or missing one)."""
    if st.refused:
        return refused_file_error(st.path, st.refused_globals, instead)
    if st.damaged:
        return damaged_file_error(st.path, st.reason)
    return None


def raise_if_unreadable(path: PathLike) -> None:
    """Raise the one-line error for ``path`` if it exists and is damaged or refused; else return.

    :class:`CheckpointFileError` for damage, :class:`UnsafeCheckpointError` for a file that torch's
    ``weights_only`` loader refuses; raised without the error it replaces (torch's message advises
    loading the file with the check off).
    """
    path = os.fspath(path)
    if PathManager.path_requires_pathmanager(path):
        return
    err = status_error(inspect_checkpoint(path))
    if err is not None:
        raise err from None


def torch_load_checked(path: PathLike, **kwargs: Any) -> Any:
    """``torch.load(path, **kwargs)`` whose failure on a damaged or refused file is the plugin's one-line error."""
    try:
        with open(path, "rb") as f:
            return torch.load(f, **kwargs)
    except Exception:
        raise_if_unreadable(path)
        raise
