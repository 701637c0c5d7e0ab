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
   ``weights_only`` policy of :mod:`fairseq_deepinit.checkpoint_compat` is unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import pickle
import re
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
from fairseq import checkpoint_utils
from fairseq.file_io import PathManager

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike

# temporary files of atomic_copy: ".<target name>.<random>.deepinit-tmp" next to the target
TMP_SUFFIX = ".deepinit-tmp"
# TEST HOOK, read only by atomic_copy: seconds to sleep after every copied MiB, so that a test can
# SIGKILL fairseq-train deterministically in the middle of the checkpoint_last.pt copy. Never set
# it outside tests/test_resume.py.
TEST_HOOK_SLOW_COPY_ENV = "FAIRSEQ_DEEPINIT_TEST_HOOK_SLOW_COPY_S"
_CHUNK = 1 << 20

ALLOW_FLAG = "--allow-config-change"

# model options whose change on resume gives a different model (checked for the deepinit model)
CHECKED_OPTIONS: Tuple[str, ...] = (
    "arch",
    "init_scheme",
    "norm_type",
    "norm_eps",
    "encoder_normalize_before",
    "decoder_normalize_before",
    "residual_scale",
    "fixnorm",
    "decoder_layer_type",
    "encoder_layers",
    "decoder_layers",
    "encoder_embed_dim",
    "decoder_embed_dim",
    "encoder_ffn_embed_dim",
    "decoder_ffn_embed_dim",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "share_all_embeddings",
    "share_decoder_input_output_embed",
    "lipschitz_bias_free",
    "ds_init_variant",
    "ds_init_alpha",
    "matt_share_v",
    "matt_self_branch",
)


class CheckpointFileError(SystemExit):
    """A checkpoint file that cannot be read, or a resume that must not go on.

    A :class:`SystemExit` whose code is the message: an uncaught one ends fairseq-train,
    fairseq-generate or a plugin tool with that single line on stderr and exit status 1, no
    traceback (and fairseq's ``except Exception`` crash handlers let it through).
    """

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")
        self.message = message


class ConfigChangeError(CheckpointFileError):
    """A resumed ``deepinit`` run whose model options differ from its checkpoint's."""


# --------------------------------------------------------------------------------------------
# 1. atomic copy
# --------------------------------------------------------------------------------------------


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
        return atomic_copy(src_path, dst_path, overwrite=overwrite)

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


# --------------------------------------------------------------------------------------------
# 2. integrity
# --------------------------------------------------------------------------------------------


@dataclass
class CheckpointStatus:
    """What :func:`inspect_checkpoint` found: ``reason`` is None for an intact file."""

    path: str
    reason: str | None = None
    missing: bool = False
    refused: bool = False  # torch's weights_only refusal (unexpected class), not damage
    num_updates: int | None = None
    model_args: argparse.Namespace | None = field(default=None, repr=False)

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


def _saved_model_args(state: Any) -> argparse.Namespace | None:
    cfg = state.get("cfg") if isinstance(state, dict) else None
    args = cfg.get("model") if isinstance(cfg, dict) else None
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
        if isinstance(e, pickle.UnpicklingError) and "Unsupported global" in str(e):
            st.reason, st.refused = "pickles a class that torch.load(weights_only=True) refuses", True
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


def newest_intact(paths: List[str]) -> Tuple[CheckpointStatus | None, List[CheckpointStatus]]:
    """The intact checkpoint with the most saved updates (then the newest file), and the rejected ones.

    Every file gets the cheap check; the chosen one also the CRC check (:func:`inspect_checkpoint`
    with ``deep``), falling back to the next if that fails.
    """
    found = [inspect_checkpoint(p) for p in paths]
    rejected = [s for s in found if not s.ok]

    def mtime(s: CheckpointStatus) -> float:
        with contextlib.suppress(OSError):
            return os.path.getmtime(s.path)
        return 0.0

    for s in sorted((s for s in found if s.ok), key=lambda s: (s.num_updates or 0, mtime(s)), reverse=True):
        deep = inspect_checkpoint(s.path, deep=True)
        if deep.ok:
            return deep, rejected
        rejected.append(deep)
    return None, rejected


# --------------------------------------------------------------------------------------------
# 3. configuration check
# --------------------------------------------------------------------------------------------


def add_args(parser: argparse.ArgumentParser) -> None:
    """``--allow-config-change``; called from the ``deepinit`` model's ``add_args``."""
    parser.add_argument(
        ALLOW_FLAG,
        action="store_true",
        help="resume a checkpoint whose model options (arch, init scheme, norms, residual scale, layers, dims, "
        "decoder layer type) differ from this command's: log the differences and continue instead of stopping",
    )


def _is_deepinit(args: argparse.Namespace | None) -> bool:
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    return args is not None and ARCH_MODEL_NAME_REGISTRY.get(getattr(args, "arch", None)) == "deepinit"


def _resolved(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the deepinit ``auto`` values resolved as the model build resolves them (a copy)."""
    from . import options

    out = copy.copy(args)
    if _is_deepinit(out):
        with contextlib.suppress(Exception):  # an invalid stored combination: compare as stored
            options.resolve_and_validate(out)
    return out


def _norm(value: Any) -> Any:
    return False if value is None else value


def config_differences(saved: argparse.Namespace, current: argparse.Namespace) -> List[Tuple[str, Any, Any]]:
    """``(option, checkpoint value, current value)`` for every :data:`CHECKED_OPTIONS` entry that differs.

    Options only one side knows (a stock ``transformer`` checkpoint has no ``init_scheme``) are
    skipped, except ``arch``.
    """
    saved, current = _resolved(saved), _resolved(current)
    diffs = []
    for name in CHECKED_OPTIONS:
        if name != "arch" and not (hasattr(saved, name) and hasattr(current, name)):
            continue
        a, b = _norm(getattr(saved, name, None)), _norm(getattr(current, name, None))
        if a != b:
            diffs.append((name, a, b))
    return diffs


def _fmt_diffs(diffs: List[Tuple[str, Any, Any]]) -> str:
    return ", ".join(f"--{n.replace('_', '-')} {a} -> {b}" for n, a, b in diffs)


def check_config(status: CheckpointStatus, current: Any, fine_tuning: bool) -> None:
    """Stop (:class:`ConfigChangeError`) if ``current`` (a deepinit model's args) differs from the checkpoint's.

    With ``--allow-config-change``, or when ``fine_tuning`` (any ``--reset-*`` flag: the run starts
    anew from the weights), the differences are logged as a warning instead.
    """
    if not isinstance(current, argparse.Namespace) or not _is_deepinit(current) or status.model_args is None:
        return
    diffs = config_differences(status.model_args, current)
    if not diffs:
        return
    what = f"{status.path} was trained with different model options (checkpoint -> now): {_fmt_diffs(diffs)}"
    if getattr(current, "allow_config_change", False):
        logger.warning(f"{what}; continuing because of {ALLOW_FLAG}")
    elif fine_tuning:
        logger.warning(f"{what}; continuing because a --reset-* flag starts a new training from these weights")
    else:
        raise ConfigChangeError(
            f"{what}. Resume with the checkpoint's options, use another --save-dir for a new run, or add "
            f"{ALLOW_FLAG} to continue with the new ones on purpose"
        )


# --------------------------------------------------------------------------------------------
# the wrapped fairseq functions
# --------------------------------------------------------------------------------------------

_ORIGINAL: Dict[str, Callable] = {}


def damaged_file_error(path: PathLike, reason: str) -> CheckpointFileError:
    return CheckpointFileError(
        f"checkpoint {os.fspath(path)} {reason}. Use an intact checkpoint instead (for example another "
        "checkpoint*.pt of the same save dir), or delete this one"
    )


def raise_if_damaged(path: PathLike) -> None:
    """Raise :class:`CheckpointFileError` naming ``path`` if it exists and is damaged; else return."""
    path = os.fspath(path)
    if PathManager.path_requires_pathmanager(path):
        return
    st = inspect_checkpoint(path)
    if st.damaged:
        raise damaged_file_error(path, st.reason)


def torch_load_checked(path: PathLike, **kwargs: Any) -> Any:
    """``torch.load(path, **kwargs)`` whose failure on a damaged file is a :class:`CheckpointFileError`."""
    try:
        with open(path, "rb") as f:
            return torch.load(f, **kwargs)
    except Exception:
        raise_if_damaged(path)
        raise


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
