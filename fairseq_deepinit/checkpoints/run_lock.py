"""One run per save folder, and a finished run that stays finished.

fairseq 0.12.3 lets any number of ``fairseq-train`` processes share a ``--save-dir``: two runs started
a second apart (seeds 1 and 2) each wrote every ``checkpoint_*.pt`` in turn, and the folder ended up
with the second run's files, without a word. And a run whose newest checkpoint already holds
``--max-update`` updates, run again with the same command (a re-queued job, a script that resumes
whatever is there), trained one more update (fairseq's ``train`` checks the limit only after an
update: "4 >= max_update 3") and overwrote ``checkpoint_last.pt``.

- :func:`acquire` (called by the resume wrapper, :func:`.resume.load_checkpoint`, on the global rank
  0, before anything in the save dir is read, removed or written) takes an exclusive ``flock`` on
  ``<save-dir>/.fairseq-deepinit.lock`` and writes the owner (pid, host, start time, command) into
  it. The kernel releases the lock when the process ends, however it ends (a SIGKILL included), so a
  lock file left by a dead run is recognised as stale and taken over (logged). A second run finds
  the lock held and stops with one line naming the owner (:class:`~fairseq_deepinit.errors.SaveDirBusyError`).
  The file is removed when the owner exits normally or with an error. Where the file system has no
  ``flock`` (some network file systems), the owner written in the file decides: a live process of
  the same host holds the folder; a lock of another host is held until its file is deleted.
  ``--no-save`` runs write nothing and take no lock.
- :func:`check_not_finished`: when the checkpoint a run would resume from already holds
  ``--max-update`` updates (and ``--reset-optimizer``, which restarts the count, is not given), the
  run logs that training is finished and exits with status 0, before anything is changed; a larger
  ``--max-update`` continues.

Both apply to every model trained with the plugin loaded, fairseq's own included (they are about the
save folder, not the model); nothing else of a run changes.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import json
import logging
import os
import socket
import stat
import sys
from typing import Any, Dict

from ..errors import CheckpointSaveError, SaveDirBusyError

logger = logging.getLogger(__name__)

LOCK_NAME = ".fairseq-deepinit.lock"
_held: Dict[str, int] = {}  # absolute save dir -> the open, locked file descriptor

try:
    import fcntl
except ImportError:  # not on Linux/macOS: the owner in the file decides
    fcntl = None  # type: ignore[assignment]


def lock_path(save_dir: str) -> str:
    return os.path.join(save_dir, LOCK_NAME)


def _owner() -> Dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv)[:1000],
    }


def read_owner(path: str) -> Dict[str, Any]:
    """The owner recorded in a lock file (empty when unreadable: a file being written, or damaged)."""
    try:
        with open(path, encoding="utf-8") as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _who(owner: Dict[str, Any]) -> str:
    command = str(owner.get("command") or "")
    command = f": {command[:150]}{' ...' if len(command) > 150 else ''}" if command else ""
    return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, started {owner.get('started', '?')}{command}"


def _describe(owner: Dict[str, Any]) -> str:
    return f"another run ({_who(owner)})" if owner else "another run (its lock file is being written)"


def _busy(save_dir: str, owner: Dict[str, Any], stale_hint: str = "") -> SaveDirBusyError:
    return SaveDirBusyError(
        f"--save-dir {save_dir} is in use by {_describe(owner)}: two runs in one save folder overwrite each other's "
        f"checkpoints. Wait for it to end, stop it, or pass another --save-dir{stale_hint}"
    )


def _release(save_dir: str) -> None:
    fd = _held.pop(save_dir, None)
    if fd is None:
        return
    with contextlib.suppress(OSError):
        if read_owner(lock_path(save_dir)).get("pid") == os.getpid():
            os.unlink(lock_path(save_dir))
    with contextlib.suppress(OSError):
        os.close(fd)


def _open_lock(save_dir: str, path: str) -> int:
    """The lock file, opened (created) for writing; never through a symbolic link (``O_NOFOLLOW``: the owner's
    line would overwrite the link's target), and only a regular file (a folder or a FIFO there is refused)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
    else:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
    if os.path.islink(path):
        what = f"is a symbolic link (to {os.readlink(path)}), and the lock is never written through a link"
    else:
        what = "is a folder" if os.path.isdir(path) else "is not a regular file"
    raise CheckpointSaveError(
        f"--save-dir {save_dir}: {path}, the file where a run records that it holds the folder, {what}. Move it out "
        "of the save folder and run again, or pass another --save-dir"
    )


def acquire(save_dir: str) -> bool:
    """Hold ``save_dir`` for this process until it exits; False if it already does (idempotent).

    Raises :class:`SaveDirBusyError` when another live run holds it. A stale lock (its process ended
    without removing the file) is taken over, with a log line naming the run that left it.
    """
    key = os.path.abspath(save_dir)
    if key in _held:
        return False
    path = lock_path(save_dir)
    fd = _open_lock(save_dir, path)
    try:
        previous = read_owner(path)
        locked = False
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                raise _busy(save_dir, previous) from None
            except OSError as e:  # no flock on this file system: the recorded owner decides
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
        if not locked and previous and previous.get("pid") != os.getpid():
            if previous.get("host") != socket.gethostname():
                raise _busy(save_dir, previous, f" (if that run has ended, delete {path})")
            if _alive(previous.get("pid")):
                raise _busy(save_dir, previous)
        if previous and previous.get("pid") != os.getpid():
            logger.warning(f"{path}: taking over the lock left by a run that has ended ({_who(previous)})")
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_owner()) + "\n").encode(), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    _held[key] = fd
    atexit.register(_release, key)
    return True


def release_all() -> None:
    """Give up every save dir this process holds (normally done at exit)."""
    for key in list(_held):
        _release(key)


def check_not_finished(path: str, num_updates: int | None, max_update: int, reset_optimizer: bool) -> None:
    """Exit with status 0 and one log line when the checkpoint at ``path`` already reached ``--max-update``."""
    if reset_optimizer or not max_update or max_update <= 0 or num_updates is None or num_updates < max_update:
        return
    logger.warning(
        f"training is already finished: {path} holds {num_updates} updates and --max-update is {max_update}, so "
        "nothing was trained or written. Pass a larger --max-update to train on"
    )
    raise SystemExit(0)
