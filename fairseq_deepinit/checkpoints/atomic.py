"""Checkpoint writes that leave either the old file or the whole new one (fairseq 0.12.3 ``checkpoint_utils``).

``save_checkpoint`` (line 139) writes the first checkpoint file atomically (``torch_persistent_save``,
line 578: ``<name>.tmp`` then ``PathManager.rename``) but then copies it to ``checkpoint_last.pt``,
``checkpoint_best.pt``, ``checkpointN.pt`` ... with a plain ``PathManager.copy``; a SIGKILL during
that copy leaves a truncated file. :class:`AtomicCopyPathManager`, installed by
:mod:`fairseq_deepinit.patches` as ``checkpoint_utils.PathManager`` only, copies through a temporary file in
the same folder, fsync and ``os.replace``, and fsyncs what it renames, so fairseq's own atomic write
survives a power cut, not only a kill.

A write that fails (disk full, no permission, file size limit) removes its temporary file, leaves
every existing checkpoint as it was, and becomes one :class:`~fairseq_deepinit.errors.CheckpointSaveError`
(:func:`save_error`) that says which file, why, what to do and which checkpoint a resume will use.
:func:`atomic_torch_save` is fairseq's atomic write without its retries: fairseq calls ``torch.save``
three times on the same file object, 2.5 s apart, but a retry cannot succeed there (the object is
positioned after the part already written, and torch's zip writer fails with "unexpected pos"), so a
full disk gave five chained tracebacks (one logged, four raised) and left ``<name>.pt.tmp`` behind.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Any, List

import torch
from fairseq.file_io import PathManager

from ..errors import CheckpointSaveError
from .integrity import checkpoint_candidates, inspect_checkpoint, newest_intact

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike

# temporary files of atomic_copy: ".<target name>.<random>.deepinit-tmp" next to the target
TMP_SUFFIX = ".deepinit-tmp"
# TEST HOOK, read only by atomic_copy: seconds to sleep after every copied MiB, so that a test can
# SIGKILL fairseq-train deterministically in the middle of the checkpoint_last.pt copy. Never set
# it outside tests/test_resume.py.
TEST_HOOK_SLOW_COPY_ENV = "FAIRSEQ_DEEPINIT_TEST_HOOK_SLOW_COPY_S"
_CHUNK = 1 << 20


def _fsync_dir(folder: str) -> None:
    """Make a rename in ``folder`` durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(folder or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_copy(src: PathLike, dst: PathLike, overwrite: bool = False) -> bool:
    """Copy ``src`` to ``dst`` so that ``dst`` is always either its old content or all of ``src``.

    Writes ``.<dst name>.<random>.deepinit-tmp`` in ``dst``'s folder, fsyncs it, then
    ``os.replace`` s it onto ``dst`` and fsyncs the folder. On any error (or interrupt) the
    temporary file is removed and the error re-raised; only a SIGKILL or a power cut can leave it
    behind, and :func:`remove_stale_temporaries` deletes it at the next resume. Same signature
    and return value as fairseq's ``PathManager.copy`` (``fairseq/file_io.py``, line 71):
    returns False without copying when ``dst`` exists and not ``overwrite``.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    if not overwrite and os.path.exists(dst):
        return False
    folder, name = os.path.split(os.path.abspath(dst))
    delay = float(os.environ.get(TEST_HOOK_SLOW_COPY_ENV, "0") or 0)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=TMP_SUFFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
            if delay > 0:  # TEST HOOK (see TEST_HOOK_SLOW_COPY_ENV)
                while chunk := inp.read(_CHUNK):
                    out.write(chunk)
                    out.flush()
                    time.sleep(delay)
            else:
                shutil.copyfileobj(inp, out, _CHUNK)
            out.flush()
            os.fsync(out.fileno())
        shutil.copymode(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)
    return True


def atomic_torch_save(obj: Any, filename: PathLike) -> None:
    """``torch.save(obj)`` to ``<filename>.tmp``, fsync, rename onto ``filename`` (once; see the module doc).

    The temporary file has fairseq's name (``torch_persistent_save``, line 585), so that
    :func:`stale_temporaries` knows it if a kill leaves it; on any error it is removed here.
    """
    filename = os.fspath(filename)
    tmp = filename + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, filename)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(filename)))


def os_error_in(exc: BaseException | None) -> OSError | None:
    """The ``OSError`` behind a failed write: ``exc`` itself or what it was raised from or while handling.

    torch's zip writer reports a failed write as ``RuntimeError: [enforce fail at inline_container.cc]
    ... unexpected pos``, raised while handling the ``OSError`` of the file object.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointSaveError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _what_to_do(err: OSError, folder: str) -> str:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"The file system of {folder} is full (or over quota): free space there or pass another --save-dir "
            "(--keep-interval-updates N, --keep-last-epochs N and --no-epoch-checkpoints keep fewer checkpoints)"
        )
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{folder} is not writable by this user: fix its permissions or pass another --save-dir"
    if err.errno == errno.EFBIG:
        return "The file is larger than this process may write (ulimit -f): raise that limit"
    return f"Check the file system of {folder}, or pass another --save-dir"


def save_error(path: PathLike, err: OSError, save_dir: PathLike | None = None) -> CheckpointSaveError:
    """The one-line error of a failed checkpoint write, naming the checkpoint a resume will load."""
    path = os.fspath(path)
    save_dir = os.fspath(save_dir) if save_dir is not None else os.path.dirname(path) or "."
    code = errno.errorcode.get(err.errno, "") if err.errno is not None else ""
    why = (err.strerror or str(err)) + (f" ({code})" if code else "")
    found = [inspect_checkpoint(p) for p in checkpoint_candidates(save_dir)]
    newest, _ = newest_intact(found, prefer=os.path.join(save_dir, "checkpoint_last.pt"))
    if newest is None:
        kept = f"no checkpoint in {save_dir} is intact yet, so running the command again starts from scratch"
    else:
        kept = (
            f"every checkpoint in {save_dir} is complete, and running the same command again resumes from the "
            f"newest, {os.path.basename(newest.path)} ({newest.num_updates} updates)"
        )
    return CheckpointSaveError(
        f"cannot write checkpoint {path}: {why}. {_what_to_do(err, save_dir)}. Nothing was left half-written: {kept}"
    )


def durable_rename(src: str, dst: str) -> None:
    """fairseq's ``PathManager.rename`` (``os.rename``) after an fsync of ``src``, then of the folder."""
    with open(src, "rb") as f:
        os.fsync(f.fileno())
    os.rename(src, dst)
    _fsync_dir(os.path.dirname(os.path.abspath(dst)))


class AtomicCopyPathManager(PathManager):
    """fairseq's ``PathManager`` with an atomic ``copy`` and a durable ``rename`` for local paths.

    Installed only as ``fairseq.checkpoint_utils.PathManager``: ``save_checkpoint`` (line 139)
    copies through it and ``torch_persistent_save`` (line 587) renames through it. Paths that need
    iopath (remote storage) keep fairseq's behaviour.
    """

    @staticmethod
    def copy(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
        if PathManager.path_requires_pathmanager(src_path) or PathManager.path_requires_pathmanager(dst_path):
            return PathManager.copy(src_path, dst_path, overwrite=overwrite)
        try:
            return atomic_copy(src_path, dst_path, overwrite=overwrite)
        except OSError as e:
            raise save_error(dst_path, e) from e

    @staticmethod
    def rename(src: str, dst: str) -> None:
        if PathManager.path_requires_pathmanager(src):
            return PathManager.rename(src, dst)
        durable_rename(src, dst)


def stale_temporaries(save_dir: PathLike) -> List[str]:
    """Temporary files a killed save leaves in ``save_dir``: ours and fairseq's ``<checkpoint>.pt.tmp``."""
    try:
        names = os.listdir(save_dir)
    except OSError:
        return []
    return sorted(
        os.path.join(save_dir, n)
        for n in names
        if (n.startswith(".checkpoint") and n.endswith(TMP_SUFFIX)) or re.fullmatch(r"checkpoint.*\.pt\.tmp", n)
    )


def remove_stale_temporaries(save_dir: PathLike) -> List[str]:
    """Delete :func:`stale_temporaries` (call only while no save is running); returns what was removed."""
    removed = []
    for path in stale_temporaries(save_dir):
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(path)
    if removed:
        logger.info(
            f"removed {len(removed)} temporary file(s) of an interrupted checkpoint save: "
            + ", ".join(os.path.basename(p) for p in removed)
        )
    return removed
