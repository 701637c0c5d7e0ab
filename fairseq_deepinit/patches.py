"""Every change the plugin makes to fairseq when it is imported, in one list (:data:`PATCHES`) with one install.

Each :class:`Patch` names what it replaces in fairseq 0.12.3 (file and lines), why, and what it changes for a
*stock* model (fairseq's own ``transformer`` or ``transformer_lm`` trained with ``--user-dir fairseq_deepinit``).
A patch wraps fairseq's function and calls it (nothing of its body is copied), or checks before it; the code
it calls lives with its subject (``checkpoints/resume.py``, ``intercepts.py``, ``training/``); only this
module assigns into fairseq (torch's and numpy's globals: the first and last rows; the trainer and the optimizers
it builds: :func:`build_optimizer`, the loop over the records' training hooks).
``scripts/fairseq_tests.py`` runs fairseq's own tests without and with the plugin: none fails only with it.
:func:`install` runs once (idempotent), from ``fairseq_deepinit/__init__.py`` after every model and architecture.

Two more hooks attach at run time to instances, for the runs that choose the plugin's diagnostics criteria
(fairseq's ``Trainer.train_step``, trainer.py:797-1060, has no hook where a gradient exists):
:func:`install_task_mixin` puts :class:`DiagnosticsTaskMixin` in front of the task instance's class
(``train_step``: the update number before fairseq's forward/backward, trainer.py:843-851 and its replay at
1000-1007; ``optimizer_step``, 974-976; ``begin_epoch``, 779; ``reduce_metrics``, 1541; ``state_dict``, 424:
a veto on saving a diverged model), and :func:`wrap_optimizer` routes the optimizer instance's
``clip_grad_norm`` (trainer.py:953 -> 1295-1297, the complete gradients of an update) and ``zero_grad``
(802, 993-996: a discarded update). The hooks add calls around fairseq's methods, which run unchanged.
The error hook of :mod:`fairseq_deepinit.errors` (``sys.excepthook``, not fairseq) is installed first of all.
One change cannot live here: ``fairseq-hydra-train`` merges the YAML's nodes with their dataclasses
(``add_defaults``, ``fairseq/dataclass/initialize.py:30``) before it imports ``common.user_dir``, so a key no
option has is made one line by ``hydra_plugins/fairseq_deepinit_config_keys.py``, which Hydra's plugin
discovery imports first; it imports nothing of the plugin and changes nothing else.
"""

from __future__ import annotations

import argparse
import functools
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch
from fairseq import checkpoint_utils, optim, tasks
from fairseq import models as fairseq_models
from fairseq.data import Dictionary, data_utils, iterators
from fairseq.distributed import utils as distributed_utils
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY, MODEL_REGISTRY, distributed_fairseq_model
from fairseq.optim.adam import FairseqAdam
from fairseq.tasks import FairseqTask
from fairseq.trainer import Trainer

from . import input_checks, intercepts
from .checkpoints import batch_order, broadcast, model_load, resume
from .checkpoints.atomic import AtomicCopyPathManager
from .checkpoints.config_check import DEEPINIT_MODELS
from .diagnostics.task_mixin import DiagnosticsTaskMixin
from .methods import enabled
from .methods.record import StepHook
from .training import adam_foreach, launch, loss_terms
from .training.param_groups import check_groups_reached

MARK = "_deepinit_patch"


@dataclass(frozen=True)
class Patch:
    """``target`` replaced by :func:`install` (``apply``); ``replaces``: fairseq 0.12.3's lines; ``why``; ``stock``:
    what it changes for a stock fairseq model."""

    target: str
    replaces: str
    why: str
    stock: str
    apply: Callable[[], None]


def wrap(owner: Any, name: str, wrapper: Callable) -> None:
    """``owner.name = wrapper(fairseq's owner.name, ...)``, once."""
    original = getattr(owner, name)
    if getattr(original, MARK, False):
        return
    patched = functools.wraps(original)(lambda *args, **kwargs: wrapper(original, *args, **kwargs))
    setattr(patched, MARK, True)
    setattr(owner, name, patched)


def build_optimizer(original: Callable, trainer: Trainer, *args: Any, **kwargs: Any) -> Any:
    """fairseq's ``Trainer._build_optimizer`` (trainer.py:289-382) in the one loop over the training hooks of the
    methods that are on (:func:`fairseq_deepinit.methods.enabled`; the hooks: :mod:`.methods.record`). Before it:
    each ``check_training``, a ``loss_term``'s criterion (:func:`.training.loss_terms.check_criterion`), the
    optimizer's ``prepare_model(cfg, model)`` (Muon's roles), each ``param_groups``. After it: the ``adam`` <->
    ``adam_foreach`` history (:func:`.training.adam_foreach.accepted_history`, before fairseq's optimizer-name
    check) and the loss-term criterion switched at resume (:func:`.training.loss_terms.accepted_history`, before
    its criterion-name check), the tagged groups found in the optimizer
    (:func:`.training.param_groups.check_groups_reached`), its ``step`` / ``zero_grad`` routed to the
    ``after_step`` hooks (:func:`hook_steps`)."""
    spec, model = getattr(trainer._model, "spec", None), trainer._model
    on = enabled(spec) if spec is not None else []
    for method, p in on:  # every refusal before anything is changed
        if method.loss_term is not None:
            loss_terms.check_criterion(trainer.criterion, trainer.cfg, method)
        if method.check_training is not None:
            method.check_training(p, spec, trainer.cfg)
    prepare = getattr(optim.OPTIMIZER_REGISTRY.get(getattr(trainer.cfg.optimizer, "_name", None)), "prepare_model",
                      None)  # fmt: skip
    if prepare is not None:  # an optimizer that reads the parameters' roles (training.muon.FairseqMuon)
        prepare(trainer.cfg, model)
    grouped = [(method, p) for method, p in on if method.param_groups is not None]
    for method, p in grouped:
        method.param_groups(p, spec, model)
    out = original(trainer, *args, **kwargs)
    saved = getattr(trainer, "_optim_history", None)
    history = adam_foreach.accepted_history(saved, trainer._optimizer) or saved
    history = loss_terms.accepted_history(history, trainer.get_criterion()) or history
    if history is not saved:
        trainer._optim_history = history
    if grouped:
        check_groups_reached(trainer._optimizer, model)
    steps = [method.after_step(p, spec, model, trainer._optimizer) for method, p in on if method.after_step]
    if steps:
        hook_steps(trainer._optimizer, steps)
    return out


def hook_steps(optimizer: Any, hooks: List[StepHook]) -> None:
    """Route the optimizer instance's ``step`` (then each hook's ``after_step``) and ``zero_grad`` (each hook's
    ``new_update`` first: an update starts)."""
    step, zero_grad = optimizer.step, optimizer.zero_grad

    def hooked_step(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        for hook in hooks:
            hook.after_step()
        return out

    def new_update() -> Any:
        for hook in hooks:
            hook.new_update()
        return zero_grad()

    optimizer.step, optimizer.zero_grad = hooked_step, new_update


def guard_architectures() -> int:
    """Every registered architecture of the plugin's models first refuses a task of the other kind and
    ``--ddp-backend fully_sharded``, and after its defaults an embedding dimension the heads do not divide
    (fairseq calls it on the parsed arguments, ``options.parse_args_and_arch``, before ``main``); returns how
    many are guarded (idempotent)."""
    models = [MODEL_REGISTRY[m] for m in DEEPINIT_MODELS if m in MODEL_REGISTRY]
    names = [n for n, cls in ARCH_MODEL_REGISTRY.items() if cls in models and n in ARCH_CONFIG_REGISTRY]
    for name in names:
        arch_fn = ARCH_CONFIG_REGISTRY[name]
        if not getattr(arch_fn, MARK, False):
            ARCH_CONFIG_REGISTRY[name] = functools.wraps(arch_fn)(intercepts.guarded(arch_fn))
            setattr(ARCH_CONFIG_REGISTRY[name], MARK, True)
    return len(names)


def _safe_globals() -> None:
    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals([argparse.Namespace])


def _numpy_compat() -> None:
    try:
        np.compat  # noqa: B018  (numpy's module __getattr__ raises AttributeError when it is gone)
    except AttributeError:
        np.compat = types.SimpleNamespace(long=int)


def _checkpoint_utils(name: str) -> Callable[[], None]:
    return lambda: wrap(checkpoint_utils, name, getattr(resume, name))


def _adam_betas() -> None:
    FairseqAdam.optimizer_config = adam_foreach.FairseqAdamForeach.optimizer_config


def _launch() -> None:
    wrap(distributed_utils, "call_main", launch.call_main)
    wrap(distributed_utils, "distributed_init", launch.distributed_init)
    if not isinstance(distributed_utils.dist, launch._TimedDist):
        distributed_utils.dist = launch.timed_dist()
    distributed_fairseq_model.DistributedDataParallel = launch.cpu_distributed_data_parallel


def _batch_order() -> None:
    wrap(Trainer, "get_train_iterator", batch_order.get_train_iterator)
    wrap(iterators.EpochBatchIterator, "state_dict", batch_order.state_dict)
    wrap(iterators.EpochBatchIterator, "load_state_dict", batch_order.load_state_dict)


def _input_checks() -> None:
    wrap(tasks, "setup_task", input_checks.setup_task)
    wrap(Dictionary, "add_from_file", input_checks.add_from_file)
    wrap(FairseqTask, "filter_indices_by_size", input_checks.filter_indices_by_size)
    wrap(FairseqTask, "build_generator", input_checks.build_generator)


GENERATION_CLIS = ("fairseq_cli.generate", "fairseq_cli.interactive")


def _generation_mains() -> None:
    """The ``main`` of the generation command running now: its module, imported by the console script, or
    ``__main__`` under ``python -m fairseq_cli.generate`` (the plugin is imported while its ``cli_main`` parses
    the arguments, before it looks up ``main``). Nothing is imported: another command runs unchanged."""
    running = sys.modules.get("__main__")
    for name in GENERATION_CLIS:
        modules = [sys.modules.get(name)]
        if getattr(getattr(running, "__spec__", None), "name", None) == name:
            modules.append(running)
        for module in modules:
            if module is not None and callable(getattr(module, "main", None)):
                wrap(module, "main", input_checks.generation_main)


PATCHES: Tuple[Patch, ...] = (
    Patch(
        "torch.serialization safe globals",
        "checkpoint_utils.py:340 (torch.load of every checkpoint)",
        "torch >= 2.6 loads with weights_only=True, which refuses the argparse.Namespace fairseq stores; it is "
        "allow-listed, and nothing else (checkpoints/compat.py)",
        "its checkpoints load under torch >= 2.6 (without the plugin: 'Unsupported global')",
        _safe_globals,
    ),
    Patch(
        "checkpoint_utils.PathManager",
        "checkpoint_utils.py:139 (PathManager.copy of each saved file), 578-592 (rename)",
        "a kill during the copy to checkpoint_last.pt left a truncated file: copies through a temporary file, "
        "fsync and os.replace (checkpoints/atomic.py)",
        "the same files, written atomically",
        lambda: setattr(checkpoint_utils, "PathManager", AtomicCopyPathManager),
    ),
    Patch(
        "checkpoint_utils.torch_persistent_save / save_checkpoint / verify_checkpoint_directory",
        "checkpoint_utils.py:578-592, 35-205, 872-886",
        "a write that fails (disk full, permissions, file size limit) removes its temporary file and is one line",
        "the same files; a failed save: one line instead of fairseq's three attempts and chained tracebacks",
        lambda: [
            _checkpoint_utils(n)() for n in ("torch_persistent_save", "save_checkpoint", "verify_checkpoint_directory")
        ],
    ),
    Patch(
        "checkpoint_utils.load_checkpoint",
        "checkpoint_utils.py:208-303",
        "resume from the newest intact checkpoint of the save dir (a kill between a save and its copy leaves "
        "checkpoint_last.pt older or damaged); a given checkpoint that does not exist is an error; a deepinit "
        "model's options are compared with its checkpoint's first (checkpoints/config_check.py)",
        "resumes from checkpoint_last.pt when it is the newest intact file (as fairseq); a missing "
        "--restore-file / --continue-once is an error, not a fresh start",
        _checkpoint_utils("load_checkpoint"),
    ),
    Patch(
        "checkpoint_utils.load_checkpoint_to_cpu",
        "checkpoint_utils.py:306-369",
        "a damaged file, or one torch refuses, is one line naming it",
        "the same for a readable file; an unreadable one: one line instead of a traceback",
        _checkpoint_utils("load_checkpoint_to_cpu"),
    ),
    Patch(
        "checkpoint_utils.load_model_ensemble_and_task",
        "checkpoint_utils.py:419-525 (--path of fairseq-generate/-interactive/-eval-lm)",
        "a --path that is missing or a folder, or a file without args and cfg, is one line (checkpoints/resume.py)",
        "what loads, loads as before; only those errors change",
        lambda: wrap(checkpoint_utils, "load_model_ensemble_and_task", model_load.load_model_ensemble_and_task),
    ),
    Patch(
        "Trainer.load_checkpoint",
        "trainer.py:465-615 (its except at 596-601)",
        "fairseq turns every error of its model loading into 'Cannot load model parameters'; a plugin error "
        "inside is raised as itself",
        "none (fairseq's own errors keep fairseq's exception)",
        lambda: wrap(Trainer, "load_checkpoint", model_load.trainer_load_checkpoint),
    ),
    Patch(
        "Trainer.get_train_iterator, EpochBatchIterator.state_dict / load_state_dict",
        "trainer.py:693-737; data/iterators.py:441-479 (tasks/fairseq_task.py:277-318: batches cut once, in the "
        "epoch the iterator is built, under numpy_seed(seed + epoch))",
        "a run resumed in epoch 2 or later cut its batches under another seed than the run it continues (built "
        "in epoch 1 and kept): other batches from the first update on. The resumed iterator is built as in epoch 1; "
        "a resume with another world size, --update-freq, --max-tokens or --batch-size says so in one line and "
        "continues after the examples trained (checkpoints/batch_order.py)",
        "a resume past epoch 1 continues the uninterrupted run's batch order (fairseq: other batches); the "
        "iterator's saved state gains a 'batching' entry, which fairseq's loader ignores",
        _batch_order,
    ),
    Patch(
        "Trainer._build_optimizer",
        "trainer.py:289-382",
        "the one point between the checkpoint's optimizer history and fairseq's optimizer-name check (adam <-> "
        "adam_foreach resume: Trainer._optim_history replaced) and where the flat parameter list is handed over; "
        "the training hooks of the methods that are on run here, in one loop (check_training, a loss term's "
        "criterion, param_groups: depth-muP's groups), and the optimizer it built gets its step and zero_grad "
        "routed to their after_step hooks (QK-Clip's clip): build_optimizer, hook_steps",
        "none unless the optimizer is adam_foreach resuming adam's state (or the other way round)",
        lambda: wrap(Trainer, "_build_optimizer", build_optimizer),
    ),
    Patch(
        "FairseqAdam.optimizer_config",
        "optim/adam.py:80-95 (eval of --adam-betas)",
        "--adam-betas read as a literal, nothing executed (training/adam_foreach.py parse_adam_betas)",
        "the same betas for every valid value; an invalid one is a one-line error",
        _adam_betas,
    ),
    Patch(
        "data_utils.load_indexed_dataset",
        "data/data_utils.py:74-120",
        "an empty or truncated split, or token ids beyond the dictionary, are refused when the split is loaded "
        "(intercepts.py), not in the first forward",
        "valid data loads as before (one pass over each mmap .bin file for its largest id)",
        lambda: wrap(data_utils, "load_indexed_dataset", intercepts.load_indexed_dataset),
    ),
    Patch(
        "ARCH_CONFIG_REGISTRY (the plugin's architectures)",
        "options.py parse_args_and_arch (the --arch function on the parsed arguments)",
        "a task of the other kind, --ddp-backend fully_sharded and heads that do not divide the embedding are "
        "refused before any data is read",
        "none (the plugin's architectures only)",
        guard_architectures,
    ),
    Patch(
        "models.build_model",
        "models/__init__.py:56-110",
        "a model from a checkpoint or a YAML built for a task of the other kind, or an unknown model._name, is one "
        "line (intercepts.py)",
        "an unknown model._name: one line instead of KeyError; otherwise none",
        lambda: wrap(fairseq_models, "build_model", intercepts.build_model),
    ),
    Patch(
        "tasks.setup_task, Dictionary.add_from_file, FairseqTask.filter_indices_by_size / build_generator",
        "tasks/__init__.py:24, data/dictionary.py:231, tasks/fairseq_task.py:168, 374",
        "no data folder, a word twice in a dictionary, a valid/test sentence longer than the positions, --beam 0, "
        "--max-len-b below --min-len: one line (input_checks.py)",
        "input fairseq accepts: none; that input: one line instead of a traceback",
        _input_checks,
    ),
    Patch(
        "fairseq_cli.generate.main, fairseq_cli.interactive.main (the command running, when it is one of them)",
        "fairseq_cli/generate.py:28-36, fairseq_cli/interactive.py:108-124",
        "--sampling with --nbest other than --beam is fairseq's assertion before any model is loaded; one line "
        "(input_checks.py)",
        "generation options fairseq accepts: none",
        _generation_mains,
    ),
    Patch(
        "distributed_utils._broadcast_object_slow",
        "distributed/utils.py:784-810 (the receiving ranks' torch.load)",
        "on resume, rank 0's checkpoint state (a DictConfig, fairseq's tensor placeholders) reaches the other ranks "
        "under weights_only, without widening what a file may hold (checkpoints/broadcast.py)",
        "a multi-rank resume works (without it every rank but 0 stops at 'Unsupported global')",
        lambda: wrap(distributed_utils, "_broadcast_object_slow", broadcast.broadcast_object_slow),
    ),
    Patch(
        "distributed_utils.call_main / distributed_init / dist, distributed_fairseq_model.DistributedDataParallel",
        "distributed/utils.py:46-91, 273, 368, 412; models/distributed_fairseq_model.py:60",
        "torchrun on the CPU, wrong launches refused in one line, --heartbeat-timeout in collectives, "
        "pytorch_ddp on CPU ranks (training/launch.py)",
        "a GPU launch that worked gets the same values; those launches and --fp16 without CUDA: one line",
        _launch,
    ),
    Patch(
        "numpy.compat.long",
        "data/token_block_dataset.py:125, data/language_pair_dataset.py:292",
        "numpy >= 2 removed numpy.compat, which fairseq asks for (eos blocks of language modeling)",
        "fairseq's eos-break TokenBlockDataset works under numpy >= 2 (it fails without)",
        _numpy_compat,
    ),
)


def install() -> None:
    """Apply :data:`PATCHES`, in order (idempotent)."""
    for patch in PATCHES:
        patch.apply()


# --- run-time hooks of the diagnostics criteria (the module docstring) ---------------------------


_MIXED: Dict[type, type] = {}  # one mixed class per task class


def install_task_mixin(task, criterion) -> None:
    """Give ``task`` (an instance of any fairseq task) the :class:`DiagnosticsTaskMixin` behaviour."""
    cls = task.__class__
    if not issubclass(cls, DiagnosticsTaskMixin):
        if cls not in _MIXED:
            _MIXED[cls] = type(f"Diagnostics{cls.__name__}", (DiagnosticsTaskMixin, cls), {"__module__": __name__})
        task.__class__ = _MIXED[cls]
    task._deepinit_criterion = criterion


def wrap_optimizer(optimizer, on_clip: Callable, before_zero_grad: Callable[[], None]) -> None:
    """Route ``optimizer.clip_grad_norm(max_norm, aggregate_norm_fn)`` through ``on_clip(original, max_norm,
    aggregate_norm_fn)`` and call ``before_zero_grad()`` before ``optimizer.zero_grad()`` (on the instance)."""
    original_clip, original_zero_grad = optimizer.clip_grad_norm, optimizer.zero_grad

    def clip_grad_norm(max_norm, aggregate_norm_fn=None):
        return on_clip(original_clip, max_norm, aggregate_norm_fn)

    def zero_grad():
        before_zero_grad()
        return original_zero_grad()

    optimizer.clip_grad_norm, optimizer.zero_grad = clip_grad_norm, zero_grad
