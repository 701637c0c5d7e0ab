"""Nothing lost when a run is killed: atomic checkpoint copies, resume fallback, readable errors.

Installed when the plugin is imported (``--user-dir``); it extends fairseq 0.12.3's
``fairseq/checkpoint_utils.py`` at three points and copies none of its function bodies:

1. **Atomic copies.** ``save_checkpoint`` writes the first checkpoint file atomically
   (``torch_persistent_save``, line 578: ``<name>.tmp`` then ``PathManager.rename``) but then
   copies it to ``checkpoint_last.pt``, ``checkpoint_best.pt``, ``checkpointN.pt`` ... with a
   plain ``PathManager.copy`` (``save_checkpoint``, line 139). A SIGKILL during that copy leaves
   a truncated file. :func:`install` replaces the module attribute ``checkpoint_utils.PathManager``
   (and only that one: the rest of fairseq keeps the original class) with
   :class:`AtomicCopyPathManager`, whose ``copy`` is :func:`atomic_copy` (temporary file in the
   same folder, fsync, ``os.replace``) and whose ``rename`` also fsyncs the file it renames, so
   fairseq's own atomic write survives a power cut, not only a kill.
2. **Resume fallback and configuration check.** ``checkpoint_utils.load_checkpoint`` (line 208)
   is wrapped by :func:`load_checkpoint`: when the default ``checkpoint_last.pt`` is missing, empty
   or damaged but the save dir holds other intact checkpoints, training resumes from the newest
   of them (by saved ``num_updates``), with one log line saying which file and why. Before any
   state is loaded, a ``deepinit`` model whose configuration differs from the checkpoint's stops
   with the differences (``--allow-config-change`` continues on purpose).
3. **Readable errors.** ``checkpoint_utils.load_checkpoint_to_cpu`` (line 306), which resume,
   fairseq-generate/-interactive ``--path`` and the plugin's tools read checkpoints through, is
   wrapped by :func:`load_checkpoint_to_cpu`: a damaged file ends the program with one line that
   names the file and what to do (:class:`CheckpointFileError`, exit status 1). Files that torch
   refuses under ``weights_only`` (an unexpected pickled class) keep torch's own error: the
   ``weights_only`` policy of :mod:`.compat` is unchanged.

The pieces: :mod:`.atomic` (1), :mod:`.integrity` and :mod:`.config_check` (2, 3); this module
holds the wrappers and :func:`install`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Dict, Iterator

from fairseq import checkpoint_utils
from fairseq.file_io import PathManager

from ..errors import CheckpointFileError
from .atomic import AtomicCopyPathManager, remove_stale_temporaries
from .config_check import check_config
from .integrity import checkpoint_candidates, damaged_file_error, inspect_checkpoint, newest_intact, raise_if_damaged

logger = logging.getLogger(__name__)

_ORIGINAL: Dict[str, Callable] = {}


def load_checkpoint_to_cpu(path: str, arg_overrides: dict | None = None, load_on_all_ranks: bool = False) -> dict:
    """fairseq's ``checkpoint_utils.load_checkpoint_to_cpu`` (line 306) with a one-line error for damaged files."""
    try:
        return _ORIGINAL["load_checkpoint_to_cpu"](path, arg_overrides, load_on_all_ranks)
    except Exception:
        raise_if_damaged(path)  # else: not damage (weights_only refusal, ...): fairseq's own error
        raise


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


def _fine_tuning(cfg: Any) -> bool:
    return any(bool(getattr(cfg, k, False)) for k in ("reset_optimizer", "reset_lr_scheduler", "reset_dataloader"))


def load_checkpoint(cfg: Any, trainer: Any, **passthrough_args: Any) -> Any:
    """fairseq's ``checkpoint_utils.load_checkpoint`` (line 208) that never loses a run.

    With the default ``--restore-file checkpoint_last.pt``:

    - intact: fairseq loads it (after the configuration check);
    - missing, and no other ``checkpoint*.pt`` in the save dir: fairseq's first launch (fresh
      start, ``--finetune-from-model``, ``--continue-once``);
    - missing, empty or damaged, and the save dir holds other intact checkpoints: resume from the
      one with the most saved updates, logging one line with the file and the reason;
    - otherwise (damaged, nothing intact to fall back to): :class:`CheckpointFileError`.

    An explicit ``--restore-file`` that is damaged is a :class:`CheckpointFileError`. Temporary
    files of a killed save are removed first.
    """
    original = _ORIGINAL["load_checkpoint"]
    suffix = getattr(trainer, "checkpoint_suffix", "") or ""
    save_dir = cfg.save_dir
    if PathManager.path_requires_pathmanager(save_dir):
        return original(cfg, trainer, **passthrough_args)
    if getattr(trainer, "data_parallel_rank", 0) == 0:
        remove_stale_temporaries(save_dir)
    current = getattr(getattr(trainer, "cfg", None), "model", None)
    fine_tuning = _fine_tuning(cfg)

    if cfg.restore_file != "checkpoint_last.pt":
        path = cfg.restore_file.replace(".pt", suffix + ".pt") if suffix else cfg.restore_file
        st = inspect_checkpoint(path)
        if st.damaged:
            raise damaged_file_error(path, st.reason)
        if st.ok:
            check_config(st, current, fine_tuning)
        return original(cfg, trainer, **passthrough_args)

    last = os.path.join(save_dir, f"checkpoint_last{suffix}.pt")
    st = inspect_checkpoint(last)
    if st.ok or st.refused:  # a refused file keeps torch's error, raised by fairseq's load
        if st.ok:
            check_config(st, current, fine_tuning)
        return original(cfg, trainer, **passthrough_args)
    others = checkpoint_candidates(save_dir, suffix, exclude=(last,))
    if not others:
        if st.missing:
            return original(cfg, trainer, **passthrough_args)
        raise CheckpointFileError(
            f"checkpoint {last} {st.reason}, and the save dir holds no other checkpoint to resume from. Delete it "
            "to start training from scratch, or pass --restore-file with an intact checkpoint"
        )
    chosen, rejected = newest_intact(others)
    if chosen is None:
        bad = "; ".join(f"{os.path.basename(s.path)} {s.reason}" for s in rejected)
        raise CheckpointFileError(
            f"checkpoint {last} {st.reason}, and no other checkpoint in {save_dir} is intact ({bad}). Delete the "
            "damaged files to start training from scratch, or pass --restore-file with an intact checkpoint"
        )
    skipped = "".join(f"; skipped {os.path.basename(s.path)}, which {s.reason}" for s in rejected)
    logger.warning(
        f"resuming from {chosen.path} ({chosen.num_updates} updates), the newest intact checkpoint, because {last} "
        f"{st.reason}{skipped}"
    )
    check_config(chosen, current, fine_tuning)
    with _restore_from(cfg, chosen.path, suffix):
        return original(cfg, trainer, **passthrough_args)


def install() -> None:
    """Install the three extensions into ``fairseq.checkpoint_utils`` (idempotent)."""
    if _ORIGINAL:
        return
    _ORIGINAL["load_checkpoint"] = checkpoint_utils.load_checkpoint
    _ORIGINAL["load_checkpoint_to_cpu"] = checkpoint_utils.load_checkpoint_to_cpu
    _ORIGINAL["PathManager"] = checkpoint_utils.PathManager
    checkpoint_utils.PathManager = AtomicCopyPathManager
    checkpoint_utils.load_checkpoint = load_checkpoint
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu
