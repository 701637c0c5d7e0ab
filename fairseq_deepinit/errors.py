"""The plugin's errors, in one place, and how they end a fairseq command: one line, exit status 1.

Every error the plugin raises on purpose is an ordinary exception under one base class,
:class:`DeepInitError`, so that a Python program using fairseq with the plugin (for example calling
``checkpoint_utils.load_checkpoint_to_cpu`` on a damaged file) can catch it with ``except Exception``
and go on. Each class also keeps the built-in base that says what kind of failure it is:
:class:`DeepInitConfigError` (``ValueError``: an invalid or incompatible combination of options,
found before a model is built), :class:`AdminConfigError` and :class:`AdminNotProfiledError` (Admin),
:class:`ExportError` and :class:`AdminExportError` (``deepinit-export``), :class:`AutocastConfigError`,
:class:`DivergenceError` (the diagnostics guard), :class:`UnsafeCheckpointError` (a checkpoint that
pickles something torch's ``weights_only`` loader refuses; also a ``pickle.UnpicklingError``, what torch
raises for it), :class:`CheckpointFileError` / :class:`ConfigChangeError` (a checkpoint that cannot be
read or must not be resumed) and :class:`CheckpointSaveError` (an ``OSError``: a checkpoint that cannot be
written), :class:`RankLostError` (another data-parallel rank stopped answering) and :class:`SaveDirBusyError`
(a ``--save-dir`` another run holds).

The one-line exit belongs to the command line, not to the library. :func:`install` (called once
when the plugin is imported, i.e. by ``--user-dir``, and by the plugin's own console scripts, which
import the package) does two things:

- it wraps ``sys.excepthook`` so that an uncaught plugin error prints
  ``fairseq-deepinit: error: <message>`` on stderr instead of the traceback (and so does training that
  diverged in fairseq's trainer, :func:`divergence_in`: what to change instead of two chained tracebacks);
  the interpreter then exits with status 1, as for any uncaught exception. An exception that fairseq raised while
  handling a plugin error (``Trainer.load_checkpoint`` wraps every failure in
  ``Exception("Cannot load model parameters ...")``) is reported as the plugin error it hides
  (:func:`plugin_error_in`). Every other exception goes to the previous hook unchanged (fairseq's
  usual traceback). ``FAIRSEQ_DEEPINIT_TRACEBACK=1`` keeps the traceback for plugin errors too
  (debugging);
- it registers :func:`stop_batch_prefetching` with ``atexit``. That is the root cause of the
  "terminate called without an active exception" abort (status 134) that followed errors raised in
  the training step: fairseq's ``BufferedIterator`` collates the next batches in a *daemon* thread
  (``BackgroundConsumer``; with ``--num-workers 0`` the collation runs in that thread itself). When
  the main thread dies, the interpreter finalises while that thread is inside a torch operator with
  the GIL released; when the operator returns, the thread tries to take the GIL back, and CPython
  (< 3.14) ends such a thread with ``pthread_exit``, whose forced unwinding through torch's C++
  ``noexcept`` frames calls ``std::terminate``. ``atexit`` callbacks run before that point (after
  non-daemon threads are joined, before daemon threads are cut off), so stopping the prefetching
  threads there removes the race for every way out: plugin errors, other exceptions, ``sys.exit``
  (``--admin-profile-only`` stops with status 0 this way) and the normal end of training.

fairseq's own ``except Exception`` handlers that see a plugin error re-raise it unchanged (the
training step's crash handler after writing ``crash.pt``), except ``Trainer.load_checkpoint``'s,
which :mod:`.checkpoints.resume` teaches to let it through. This module imports nothing from the
plugin, so every other module can import it.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import queue
import sys
import threading
import time
from types import TracebackType

logger = logging.getLogger(__name__)

PACKAGE = __name__.rpartition(".")[0]  # "fairseq_deepinit" (whatever --user-dir's folder is called)
PREFIX = "fairseq-deepinit: error: "
TRACEBACK_ENV = "FAIRSEQ_DEEPINIT_TRACEBACK"
# the longest the interpreter's exit waits for the prefetching threads to finish their current batch
STOP_TIMEOUT_S = 30.0

_installed = False


# --- the error classes --------------------------------------------------------------------------


class DeepInitError(Exception):
    """Base class of every error the plugin raises on purpose: a message that says what to change."""


class DeepInitConfigError(DeepInitError, ValueError):
    """An invalid or incompatible combination of deepinit options."""


class AdminConfigError(DeepInitConfigError):
    """Invalid Admin options, or a profile that does not fit the model."""


class AdminNotProfiledError(DeepInitError, RuntimeError):
    """An Admin model is being trained with omega never profiled."""


class ExportError(DeepInitError, ValueError):
    """A checkpoint that ``deepinit-export`` cannot write as asked (a family or option the target cannot
    represent exactly, a missing dictionary, an output it must not overwrite), or an export that failed its check."""


class AdminExportError(ExportError):
    """The checkpoint cannot be folded into a plain Post-LN transformer."""


class DataConfigError(DeepInitError, ValueError):
    """A data folder that cannot be used as given (an empty split, token ids beyond the dictionary)."""


class AutocastConfigError(DeepInitError, ValueError):
    """``--autocast-bf16`` combined with something it cannot work with."""


class DivergenceError(DeepInitError, RuntimeError):
    """Training diverged (non-finite loss, gradients or weights) beyond what loss scaling absorbs."""


class UnsafeCheckpointError(DeepInitError, pickle.UnpicklingError, RuntimeError):
    """A checkpoint pickles a class or function that fairseq does not write and torch's loader refuses.

    Also a ``pickle.UnpicklingError``, the class of torch's own refusal, so that code catching that
    keeps working with the plugin loaded.
    """


class CheckpointFileError(DeepInitError, RuntimeError):
    """A checkpoint file that cannot be read, or a resume that must not go on."""

    @property
    def message(self) -> str:
        """The message (the attribute of the former ``SystemExit`` class, kept for its callers)."""
        return str(self)


class ConfigChangeError(CheckpointFileError):
    """A resumed ``deepinit`` run whose model options differ from its checkpoint's."""


class CheckpointSaveError(DeepInitError, OSError):
    """A checkpoint could not be written (disk full, no permission, file size limit, ...)."""


class RankLostError(DeepInitError, RuntimeError):
    """Another data-parallel rank stopped answering (timed out) or closed its connection."""


class SaveDirBusyError(DeepInitError, RuntimeError):
    """The ``--save-dir`` belongs to another run that is still going."""


# --- how they end a command ---------------------------------------------------------------------


def is_plugin_error(exc: BaseException) -> bool:
    """True for a :class:`DeepInitError` or an instance of another class defined in this package.

    Plain ``RuntimeError`` / ``ValueError`` raised by the plugin as internal assertions, and every
    exception of fairseq, torch or Python, are not plugin errors: they keep their traceback. The
    module test also recognises the errors of a second copy of the package (an installed one next to
    the ``--user-dir`` checkout), whose classes are not this copy's.
    """
    if isinstance(exc, DeepInitError):
        return True
    return any(
        cls.__module__ == PACKAGE or cls.__module__.startswith(PACKAGE + ".")
        for cls in type(exc).__mro__
        if issubclass(cls, BaseException) and cls not in (BaseException, Exception)
    )


def plugin_error_in(exc: BaseException | None) -> BaseException | None:
    """``exc`` if it is a plugin error, else the first plugin error it was raised from or while handling.

    fairseq wraps some failures in an exception of its own (``Trainer.load_checkpoint``:
    ``raise Exception("Cannot load model parameters ...")`` inside ``except Exception``); the plugin
    error is then its ``__cause__`` or ``__context__``. Returns None when the chain holds none.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        if is_plugin_error(exc):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def one_line(exc: BaseException) -> str:
    """The message on one line: a multi-line message (e.g. the divergence guard's) is joined, not cut."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return text or type(exc).__name__


def format_error(exc: BaseException) -> str:
    return PREFIX + one_line(exc)


#: the messages of fairseq 0.12.3's ``FloatingPointError``: the trainer's non-finite gradient norm
#: (trainer.py:970), its ranks' inconsistent norms (1511) and the fp16 / AMP loss scalers' floor
#: (optim/dynamic_loss_scaler.py:61, optim/amp_optimizer.py:59)
_FAIRSEQ_DIVERGENCE = ("gradients are Nan/Inf", "gradients are inconsistent between workers", "Minimum loss scale")


def divergence_in(exc: BaseException | None) -> str | None:
    """The one line for training that diverged in fairseq's trainer (a ``FloatingPointError`` of its own in
    ``exc``'s chain), or None. fairseq has by then written ``crash.pt`` and logged NanDetector's first non-finite
    module; the traceback (two, chained, from its re-run under NanDetector) says nothing more."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, FloatingPointError) and any(m in str(exc) for m in _FAIRSEQ_DIVERGENCE):
            what = one_line(exc).split(" ---", 1)[0]
            return (
                f"training diverged: {what} (fairseq's trainer; the log above names the first module with a "
                "non-finite output, and --save-dir holds crash.pt, the state before this update). Lower --lr, "
                "lengthen --warmup-updates or add --clip-norm, and resume from checkpoint_last.pt"
            )
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _excepthook(previous):
    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        # KeyboardInterrupt and the like are never reported as the plugin error they interrupted
        plugin = plugin_error_in(exc) if isinstance(exc, Exception) else None
        line = format_error(plugin) if plugin is not None else None
        if line is None and isinstance(exc, Exception) and (diverged := divergence_in(exc)) is not None:
            line = PREFIX + diverged
        if line is not None and os.environ.get(TRACEBACK_ENV, "") in ("", "0"):
            for stream in (sys.stdout, sys.stderr):  # the log (stdout) first, then the error after it
                try:
                    stream.flush()
                except (OSError, ValueError, AttributeError):
                    pass
            print(line, file=sys.stderr, flush=True)
            return  # an uncaught exception: the interpreter exits with status 1
        previous(exc_type, exc, tb)

    hook.deepinit = True  # type: ignore[attr-defined]
    return hook


def install() -> None:
    """Install the excepthook and the exit-time stop of fairseq's prefetching threads (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    if not getattr(sys.excepthook, "deepinit", False):
        sys.excepthook = _excepthook(sys.excepthook)
    atexit.register(stop_batch_prefetching)
    _pass_hydra_errors_on()


def _pass_hydra_errors_on() -> None:
    """Under ``fairseq-hydra-train``, let hydra hand the job's exceptions on to the excepthook above.

    hydra catches every exception of the job and prints a traceback itself (``hydra/_internal/utils.py``,
    ``run_and_report``, lines 218-300 in hydra 1.3), so a plugin error would end in a traceback; with
    ``HYDRA_FULL_ERROR=1`` it re-raises (line 222-223) and the excepthook prints the plugin's one line (other
    exceptions: Python's whole traceback instead of hydra's shortened one). A value the user set is kept.
    """
    hydra_config = sys.modules.get("hydra.core.hydra_config")
    if hydra_config is not None and hydra_config.HydraConfig.initialized():
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")


def stop_batch_prefetching(timeout: float = STOP_TIMEOUT_S) -> int:
    """Let fairseq's batch-prefetching threads finish their current batch and end; returns how many.

    Each live ``BackgroundConsumer`` is told to stop after the batch it is collating (its
    ``_max_len``, checked after every batch it queues, is set to 0) and its queue is drained so that
    a thread blocked on a full queue wakes up, queues its end marker and returns. Nothing is lost:
    the batches drained are ones that would never be trained on (the process is exiting).
    """
    try:
        from fairseq.data.iterators import BackgroundConsumer
    except ImportError:  # fairseq never imported: no such thread
        return 0
    deadline = time.monotonic() + timeout
    stopped = 0
    for thread in [t for t in threading.enumerate() if isinstance(t, BackgroundConsumer) and t.is_alive()]:
        thread._max_len = 0
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                thread._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        thread.join(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        if thread.is_alive():
            logger.warning("a fairseq batch-prefetching thread did not stop in time; the exit may abort")
        else:
            stopped += 1
    return stopped
