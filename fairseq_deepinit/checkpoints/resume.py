"""Nothing lost when a run is killed or a save fails: atomic writes, resume from the newest checkpoint, one-line errors.

The wrappers of fairseq 0.12.3's ``fairseq/checkpoint_utils.py`` (and of ``Trainer.load_checkpoint``) that
:mod:`fairseq_deepinit.patches` installs when the plugin is imported (``--user-dir``); each takes fairseq's
function as its first argument, calls it, and copies none of its body:

1. **Atomic copies.** ``save_checkpoint`` writes the first checkpoint file atomically
   (``torch_persistent_save``, line 578: ``<name>.tmp`` then ``PathManager.rename``) but then
   copies it to ``checkpoint_last.pt``, ``checkpoint_best.pt``, ``checkpointN.pt`` ... with a
   plain ``PathManager.copy`` (``save_checkpoint``, line 139). A SIGKILL during that copy leaves
   a truncated file. The patch replaces the module attribute ``checkpoint_utils.PathManager``
   (and only that one: the rest of fairseq keeps the original class) with
   :class:`~.atomic.AtomicCopyPathManager`, whose ``copy`` is :func:`.atomic.atomic_copy` (temporary file in the
   same folder, fsync, ``os.replace``) and whose ``rename`` also fsyncs the file it renames, so
   fairseq's own atomic write survives a power cut, not only a kill.
2. **Failed saves.** ``checkpoint_utils.torch_persistent_save`` (line 578), ``save_checkpoint``
   (line 35) and ``verify_checkpoint_directory`` (line 870) are wrapped: a checkpoint that cannot be
   written (disk full, no permission, ``ulimit -f``) removes its temporary file, leaves the
   checkpoints already saved as they were, and ends the run with one line
   (:class:`~fairseq_deepinit.errors.CheckpointSaveError`, :func:`.atomic.save_error`) instead of
   fairseq's three ``torch.save`` attempts and five chained tracebacks. ``crash.pt``, which fairseq
   writes while handling another error, keeps fairseq's behaviour (that error is the one to see).
3. **Resume from the newest intact checkpoint.** ``checkpoint_utils.load_checkpoint`` (line 208) is
   wrapped by :func:`load_checkpoint`: with the default ``--restore-file checkpoint_last.pt``, every
   ``checkpoint*.pt`` of the save dir is checked (cheaply: its table of contents and its pickled
   record without the tensors) and the intact one with the most saved updates is loaded, whichever
   file it is; the log says which file and why. ``checkpoint_last.pt`` is the last of a save's
   copies, so a kill or a full disk between ``checkpoint_E_U.pt`` and its copy to
   ``checkpoint_last.pt`` leaves the newer state only in the other files. A ``--restore-file``
   (or ``--continue-once``, ``--finetune-from-model``) that does not exist is an error, not a
   silent fresh start (whether it exists is fairseq's own question, ``PathManager.exists``, which other
   storage back-ends answer). Before any state is loaded, a ``deepinit`` model whose configuration differs
   from the checkpoint's stops with the differences (``--allow-config-change`` continues on purpose).
4. **Readable errors.** ``checkpoint_utils.load_checkpoint_to_cpu`` (line 306), which resume,
   fairseq-generate/-interactive ``--path`` and the plugin's tools read checkpoints through, is
   wrapped by :func:`load_checkpoint_to_cpu`: a damaged file is a
   :class:`~fairseq_deepinit.errors.CheckpointFileError`, a file that torch's ``weights_only``
   loader refuses is an :class:`~fairseq_deepinit.errors.UnsafeCheckpointError`, each one line
   that names the file (and the refused globals). They are ordinary exceptions: a library caller
   catches them; the command line prints them (:mod:`fairseq_deepinit.errors`). The ``weights_only``
   policy of :mod:`.compat` is unchanged (numpy's numeric data: :mod:`.numpy_data`).
   ``Trainer.load_checkpoint`` turns every error in its model loading into
   ``Exception("Cannot load model parameters ...")``; :func:`.model_load.trainer_load_checkpoint` lets a
   plugin error through instead, and says which weights do not fit.

5. **One run per save dir; a finished run stays finished.** Before anything in the save dir is read,
   removed or written, :func:`load_checkpoint` takes the save dir's lock on the global rank 0
   (:mod:`.run_lock`), and a run whose checkpoint already holds ``--max-update`` updates ends with
   status 0 before anything changes, also when the save dir cannot be written (a read-only archive of a
   finished run; :func:`verify_checkpoint_directory` leaves its error to :func:`load_checkpoint`).
   ``load_model_ensemble_and_task`` (line 419, ``--path`` of fairseq-generate/-interactive/-eval-lm) gives
   one line for a missing file, a folder, a checkpoint with neither ``args`` nor ``cfg``, and weights that
   do not fit (:func:`.model_load.load_model_ensemble_and_task`).

The pieces: :mod:`.atomic` (1, 2), :mod:`.integrity` and :mod:`.config_check` (3, 4), :mod:`.model_load`
(4, 5), :mod:`.run_lock` (5); this module holds the other wrappers. That a resumed run trains the batches of the
run it continues, in any epoch, and says what another batching changes, is :mod:`.batch_order`'s (wrappers of
the trainer's iterator).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator

import torch
from fairseq.file_io import PathManager

from ..errors import CheckpointFileError, CheckpointSaveError
from . import numpy_data, run_lock
from .atomic import atomic_torch_save, os_error_in, remove_stale_temporaries, save_error
from .config_check import check_config as check_config_change
from .config_check import check_parameters_fit
from .integrity import (
    CheckpointStatus,
    checkpoint_candidates,
    inspect_checkpoint,
    newest_intact,
    raise_if_unreadable,
    status_error,
)

logger = logging.getLogger(__name__)
# a --save-dir with checkpoints that cannot be written -> its error, raised unless the run is already finished
_unwritable: dict = {}


def load_checkpoint_to_cpu(
    original: Callable, path: str, arg_overrides: dict | None = None, load_on_all_ranks: bool = False
) -> dict:
    """fairseq's ``checkpoint_utils.load_checkpoint_to_cpu`` (line 306) with a one-line error for unreadable files,
    and numpy's numeric data (``--eval-bleu``'s metrics) loaded as data (:func:`.numpy_data.loading`)."""
    try:
        return numpy_data.loading(original, path, arg_overrides, load_on_all_ranks)
    except Exception:
        raise_if_unreadable(path)  # damaged or refused: the plugin's error; else fairseq's own
        raise


def torch_persistent_save(original: Callable, obj: Any, filename: str, async_write: bool = False) -> None:
    """fairseq's ``checkpoint_utils.torch_persistent_save`` (line 578): for a local file, one atomic
    write whose failure removes the temporary file and is one :class:`CheckpointSaveError`."""
    local = not async_write and not PathManager.path_requires_pathmanager(filename)
    if not local or not PathManager.supports_rename(filename):
        return original(obj, filename, async_write)
    try:
        atomic_torch_save(obj, filename)
    except Exception as e:
        err = os_error_in(e)
        if err is None or os.path.basename(filename).startswith("crash"):
            raise  # not a failed write, or crash.pt written while fairseq handles another error
        raise save_error(filename, err) from e


def save_checkpoint(original: Callable, cfg: Any, trainer: Any, epoch_itr: Any, val_loss: Any) -> Any:
    """fairseq's ``checkpoint_utils.save_checkpoint`` (line 35) whose failed file operations are one line.

    The writes and copies raise :class:`CheckpointSaveError` themselves; what is left is its
    ``os.makedirs`` of the save dir and its removal of old checkpoints (``--keep-*``).
    """
    try:
        return original(cfg, trainer, epoch_itr, val_loss)
    except CheckpointSaveError:
        raise
    except Exception as e:
        err = os_error_in(e)
        if err is None or PathManager.path_requires_pathmanager(cfg.save_dir):
            raise
        raise save_error(err.filename or cfg.save_dir, err, cfg.save_dir) from e


def verify_checkpoint_directory(original: Callable, save_dir: str) -> None:
    """fairseq's start-up check that ``--save-dir`` can be written (line 870), as one line when it cannot.

    A folder that holds checkpoints may hold a finished run (a read-only archive of one): its error waits for
    :func:`load_checkpoint`, which exits with status 0 when the run is finished and raises it otherwise.
    """
    try:
        original(save_dir)
    except OSError as e:
        if PathManager.path_requires_pathmanager(save_dir):
            raise
        why = (e.strerror or str(e)) + (f": {e.filename}" if e.filename else "")
        err = CheckpointSaveError(
            f"--save-dir {save_dir} cannot be written ({why}), so no checkpoint could be saved. Pass a --save-dir "
            "that this user can create and write"
        )
        if not checkpoint_candidates(save_dir):
            raise err from e
        _unwritable[os.path.abspath(save_dir)] = err


@contextlib.contextmanager
def _restore_from(cfg: Any, path: str, suffix: str) -> Iterator[None]:
    """Point fairseq's ``load_checkpoint`` at ``path`` (its non-default ``--restore-file`` branch)."""
    saved = {k: cfg[k] for k in ("restore_file", "finetune_from_model", "continue_once") if k in cfg}
    # fairseq inserts the suffix itself: restore_file.replace(".pt", suffix + ".pt")
    restore = path[: -len(f"{suffix}.pt")] + ".pt" if suffix else path
    try:
        cfg.restore_file = restore
        for k in ("finetune_from_model", "continue_once"):  # they refuse a non-default --restore-file
            if k in cfg:
                cfg[k] = None
        yield
    finally:
        for k, v in saved.items():
            cfg[k] = v


def _same(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


@dataclass(frozen=True)
class ResumeOptions:
    """fairseq's checkpoint options :func:`load_checkpoint` reads (``CheckpointConfig``,
    ``fairseq/dataclass/configs.py``, the line in each comment), read once before anything changes the config.
    One the config lacks is None or False (fairseq declares them all; ``save_dir``'s own default is
    ``checkpoints``)."""

    save_dir: str | None = None  # configs.py:644
    continue_once: str | None = None  # configs.py:654
    finetune_from_model: str | None = None  # configs.py:660
    reset_dataloader: bool = False  # configs.py:666
    reset_lr_scheduler: bool = False  # configs.py:672
    reset_meters: bool = False  # configs.py:678
    reset_optimizer: bool = False  # configs.py:682
    no_save: bool = False  # configs.py:718

    @classmethod
    def of(cls, cfg: Any) -> ResumeOptions:
        """The options of ``cfg`` (fairseq's ``cfg.checkpoint``)."""
        return cls(**{f.name: getattr(cfg, f.name, f.default) for f in fields(cls)})

    @property
    def fine_tuning(self) -> bool:
        """A reset of the optimizer, the learning-rate schedule or the data loader: the run does not continue one."""
        return bool(self.reset_optimizer) or bool(self.reset_lr_scheduler) or bool(self.reset_dataloader)


def _check_given(path: str, flag: str, instead: str) -> CheckpointStatus:
    """The status of a checkpoint named by ``flag``; a missing, damaged or refused one is an error.

    Whether it exists is asked as fairseq asks it (``PathManager.exists``, checkpoint_utils.py:245-255); a
    file it has that the local file system does not (another storage back-end) is fairseq's to read.
    """
    if not PathManager.exists(path):
        raise CheckpointFileError(f"{flag} {path} does not exist. {instead}")
    st = inspect_checkpoint(path)
    if st.missing:
        return st
    err = status_error(st)
    if err is not None:
        raise err
    return st


def _first_launch(opts: ResumeOptions) -> None:
    """fairseq's first launch (no checkpoint in the save dir) with the checkpoint it is told to start from checked.

    fairseq starts from scratch, with exit status 0, when ``--continue-once`` does not exist, and
    raises a bare ``ValueError`` for a ``--finetune-from-model`` that does not exist.
    """
    for flag, path in (("--continue-once", opts.continue_once), ("--finetune-from-model", opts.finetune_from_model)):
        if path and not PathManager.path_requires_pathmanager(path):
            _check_given(path, flag, f"Give an existing checkpoint, or drop {flag} to start from scratch")
            return  # fairseq uses --continue-once first


def _global_rank() -> int:
    return (
        torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
    )


def load_checkpoint(original: Callable, cfg: Any, trainer: Any, **passthrough_args: Any) -> Any:
    """fairseq's ``checkpoint_utils.load_checkpoint`` (line 208) that resumes from the newest intact checkpoint.

    With the default ``--restore-file checkpoint_last.pt``:

    - no ``checkpoint*.pt`` in the save dir: fairseq's first launch (fresh start,
      ``--finetune-from-model``, ``--continue-once``; one that does not exist is an error);
    - else the intact one with the most saved updates is loaded (a tie goes to
      ``checkpoint_last.pt``), with one log line naming it and, when it is not
      ``checkpoint_last.pt``, why: that file is missing, damaged or holds fewer updates;
    - a file that torch refuses (it pickles a global that a fairseq checkpoint never holds) stops
      the run (:class:`~fairseq_deepinit.errors.UnsafeCheckpointError`), whichever file it is: it
      may be the newest, and it should not stay in the save dir unnoticed;
    - nothing intact: :class:`CheckpointFileError`.

    An explicit ``--restore-file`` is loaded as given (fairseq's behaviour); one that does not
    exist, is damaged or refused is an error. Temporary files of a killed save are removed first.
    """
    opts = ResumeOptions.of(cfg)
    save_dir = opts.save_dir
    unwritable = _unwritable.pop(os.path.abspath(save_dir), None) if isinstance(save_dir, str) else None

    def load() -> Any:
        if unwritable is not None:  # not finished: the save dir's error (verify_checkpoint_directory)
            raise unwritable
        return original(cfg, trainer, **passthrough_args)

    resets = (opts.reset_optimizer, opts.reset_lr_scheduler, opts.reset_meters, opts.reset_dataloader)
    if opts.finetune_from_model and any(resets):
        return load()  # fairseq refuses that combination itself (line 222)
    suffix = getattr(trainer, "checkpoint_suffix", "") or ""
    if PathManager.path_requires_pathmanager(save_dir):
        return original(cfg, trainer, **passthrough_args)
    writes = unwritable is None and not opts.no_save
    if isinstance(save_dir, str) and _global_rank() == 0 and writes:
        run_lock.acquire(save_dir)  # before anything in the save dir is read, removed or written
    if getattr(trainer, "data_parallel_rank", 0) == 0 and unwritable is None:
        remove_stale_temporaries(save_dir)
    current = getattr(getattr(trainer, "cfg", None), "model", None)
    fine_tuning = opts.fine_tuning
    max_update = getattr(getattr(getattr(trainer, "cfg", None), "optimization", None), "max_update", 0)

    # a run that trains; --admin-profile-only stops before the first update, and Admin's own check says why a
    # profile-only run cannot use a save dir whose checkpoint is profiled
    trains = not getattr(current, "admin_profile_only", False)

    def check_finished(st: CheckpointStatus) -> None:
        if trains:
            run_lock.check_not_finished(st.path, st.num_updates, max_update, bool(opts.reset_optimizer))

    def check_config(st: CheckpointStatus, current: Any, fine_tuning: bool) -> None:
        if check_config_change(st, current, fine_tuning) and hasattr(trainer, "get_model"):
            check_parameters_fit(st.path, trainer.get_model())

    if cfg.restore_file != "checkpoint_last.pt":
        path = cfg.restore_file.replace(".pt", suffix + ".pt") if suffix else cfg.restore_file
        if not PathManager.path_requires_pathmanager(path):
            st = _check_given(
                path,
                "--restore-file",
                "Give the path of an existing checkpoint, or drop --restore-file to resume from the newest checkpoint "
                f"in --save-dir {save_dir} (or to start from scratch when it holds none)",
            )
            logger.info(f"loading {path} ({st.num_updates} updates), given by --restore-file")
            check_config(st, current, fine_tuning)
            check_finished(st)
        return load()

    last = os.path.join(save_dir, f"checkpoint_last{suffix}.pt")
    found = [inspect_checkpoint(p) for p in checkpoint_candidates(save_dir, suffix)]
    if not found:
        _first_launch(opts)
        return load()
    for st in found:
        if st.refused:
            raise status_error(
                st, f"Move it out of --save-dir {save_dir} (resuming then uses the newest intact checkpoint there)"
            )
    last_st = next((s for s in found if _same(s.path, last)), None)
    last_st = last_st or CheckpointStatus(last, reason="does not exist", missing=True)
    chosen, rejected = newest_intact(found, prefer=last)
    others = [s for s in rejected if not _same(s.path, last)]
    if chosen is None:
        last_reason = next((s.reason for s in rejected if _same(s.path, last)), last_st.reason)
        if not others:
            raise CheckpointFileError(
                f"checkpoint {last} {last_reason}, and the save dir holds no other checkpoint to resume from. "
                "Delete it to start training from scratch, or pass --restore-file with an intact checkpoint"
            )
        bad = "; ".join(f"{os.path.basename(s.path)} {s.reason}" for s in others)
        raise CheckpointFileError(
            f"checkpoint {last} {last_reason}, and no other checkpoint in {save_dir} is intact ({bad}). Delete "
            "the damaged files to start training from scratch, or pass --restore-file with an intact checkpoint"
        )
    skipped = "".join(f"; skipped {os.path.basename(s.path)}, which {s.reason}" for s in others)
    if _same(chosen.path, last):
        logger.info(f"resuming from {last} ({chosen.num_updates} updates), the newest intact checkpoint{skipped}")
        check_config(chosen, current, fine_tuning)
        check_finished(chosen)
        return load()
    if last_st.ok:
        why = (
            f"{last} holds only {last_st.num_updates} updates (a save stopped before its copy to it was complete: a "
            "kill or a failed write; pass --restore-file to resume from an older checkpoint on purpose)"
        )
    else:
        why = f"{last} {last_st.reason}"
    logger.warning(
        f"resuming from {chosen.path} ({chosen.num_updates} updates), the newest intact checkpoint, because {why}"
        f"{skipped}"
    )
    check_config(chosen, current, fine_tuning)
    check_finished(chosen)
    with _restore_from(cfg, chosen.path, suffix):
        return load()
