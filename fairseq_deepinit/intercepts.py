"""One line instead of a traceback where stock fairseq meets bad input that a plugin user runs into.

With the plugin loaded (``--user-dir``), fairseq 0.12.3 itself still ends these with a traceback; the
plugin catches them earlier, where the cause is still known, and raises its own error (one line,
exit status 1, :mod:`fairseq_deepinit.errors`):

- **task and architecture that do not fit.** A decoder-only ``deepinit_lm`` architecture under a
  translation task stops in the first forward pass (``TypeError: ... got multiple values for argument
  'prev_output_tokens'``, after fairseq has written ``crash.pt``), or already when the task cannot
  infer a language pair from language-model data; an encoder-decoder ``deepinit`` architecture under
  ``--task language_modeling`` stops in fairseq's ``build_model`` (``AttributeError: ... no attribute
  'supported_targets'``). :func:`check_task_and_arch` refuses both right after argument parsing,
  before any data is read: every architecture of the plugin's two models runs it first
  (:func:`fairseq_deepinit.patches.guard_architectures`, with the ``--ddp-backend`` check). A model from a
  checkpoint or a YAML meets the task in fairseq's ``models.build_model``, which :func:`build_model` precedes
  with :func:`check_task_and_model`: ``fairseq-generate`` with a language-model checkpoint produced garbage
  and a BLEU without a word, ``fairseq-eval-lm`` with a translation checkpoint stopped at
  ``supported_targets``, an unknown ``model._name`` gave ``KeyError: "'_name'"``.
- **an embedding dimension the heads do not divide.** fairseq's ``MultiheadAttention`` asserts it
  while the model is built; :func:`check_dimensions` runs after every architecture function.
- **an empty split.** fairseq's ``MMapIndexedDataset`` cannot ``mmap`` an empty ``.bin`` file
  (``ValueError: cannot mmap an empty file``, then a second traceback from its ``__del__``).
- **data binarised with another dictionary.** A token id >= the dictionary's size reaches the
  embedding lookup in the first training step (``IndexError: index out of range in self``, after
  ``crash.pt``). The largest id of a binarised split is one pass over its ``.bin`` file (a memory
  map, no copy), so it is checked when the split is loaded, against the dictionary fairseq passes.

The last two are checks run by :func:`load_indexed_dataset`, the wrapper of fairseq's
``data_utils.load_indexed_dataset`` (``fairseq/data/data_utils.py``, line 74) that
:mod:`fairseq_deepinit.patches` installs, through which the
translation and language-modeling tasks load every split with its dictionary; only the ``mmap``
format (``fairseq-preprocess``'s default) is checked. What stays with fairseq: docs/usage.md,
"Bad input and one-line errors".
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import os
from typing import Any, Callable

import numpy as np
from fairseq.data import indexed_dataset
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY, MODEL_REGISTRY, FairseqLanguageModel
from fairseq.tasks import TASK_REGISTRY
from fairseq.tasks.language_modeling import LanguageModelingTask
from fairseq.tasks.translation import TranslationTask

from .architectures import FAMILIES
from .checkpoints.config_check import DEEPINIT_MODELS
from .errors import DataConfigError, DeepInitConfigError
from .training.distributed import check_ddp_backend

PLUGIN_MODELS = DEEPINIT_MODELS
PREPROCESS_FLAG = {"train": "--trainpref", "valid": "--validpref", "test": "--testpref"}

# --- task and architecture ----------------------------------------------------------------------


def _counterpart(arch: str, to_lm: bool) -> str:
    """The registered architecture of the same family for the other kind of task (a suggestion)."""
    family = next((f for f in sorted([*FAMILIES, "deepinit"], key=len, reverse=True) if arch.startswith(f)), "deepinit")
    tiny = ["tiny"] if "tiny" in arch else []
    if to_lm:
        candidates = [f"{family}_lm_{t}" for t in tiny] + [f"{family}_lm", "deepinit_lm"]
    else:
        candidates = [f"{family}_{t}" for t in tiny] + [f"{family}_iwslt_de_en", "deepinit"]
    return next(c for c in candidates if c in ARCH_CONFIG_REGISTRY)


def check_task_and_arch(args: Any) -> None:
    """Refuse a decoder-only architecture of the plugin under a translation task and an encoder-decoder
    one under a language-modeling task (:class:`DeepInitConfigError`, naming the architecture to use
    instead). Tasks of neither kind, and fairseq's own architectures, are left to fairseq."""
    task, arch = getattr(args, "task", None), getattr(args, "arch", None)
    task_cls, model_cls = TASK_REGISTRY.get(task), ARCH_MODEL_REGISTRY.get(arch)
    if task_cls is None or model_cls not in [MODEL_REGISTRY.get(m) for m in PLUGIN_MODELS]:
        return  # fairseq's own architectures: fairseq's behaviour
    decoder_only = issubclass(model_cls, FairseqLanguageModel)
    if decoder_only and issubclass(task_cls, TranslationTask):
        raise DeepInitConfigError(
            f"--arch {arch} is a decoder-only language model, which --task {task} (source and target sentences) "
            f"cannot train; use --task language_modeling on data from fairseq-preprocess --only-source, or an "
            f"encoder-decoder architecture such as --arch {_counterpart(arch, to_lm=False)}"
        )
    if not decoder_only and issubclass(task_cls, LanguageModelingTask):
        raise DeepInitConfigError(
            f"--arch {arch} is an encoder-decoder (translation) model, which --task {task} (one token stream) "
            f"cannot train; use --task translation on a parallel corpus, or a decoder-only architecture such as "
            f"--arch {_counterpart(arch, to_lm=True)}"
        )


def check_dimensions(args: Any) -> None:
    """Refuse an embedding dimension that the attention heads do not divide, or a non-positive one
    (fairseq's ``MultiheadAttention`` asserts it while the model is built)."""
    for side in ("encoder", "decoder"):
        dim, heads = getattr(args, f"{side}_embed_dim", None), getattr(args, f"{side}_attention_heads", None)
        if not (isinstance(dim, int) and isinstance(heads, int)):
            continue
        if dim < 1 or heads < 1:
            raise DeepInitConfigError(
                f"--{side}-embed-dim {dim} with --{side}-attention-heads {heads}: both must be positive"
            )
        if dim % heads:
            near = max(heads, round(dim / heads) * heads)
            raise DeepInitConfigError(
                f"--{side}-embed-dim {dim} is not divisible by --{side}-attention-heads {heads} (each head gets "
                f"embed-dim / heads dimensions); use a multiple of {heads}, e.g. {near}, or another number of heads"
            )


def _task_name(task: Any) -> str:
    return next((n for n, cls in TASK_REGISTRY.items() if cls is type(task)), type(task).__name__)


def check_task_and_model(model_type: str, task: Any, from_checkpoint: bool) -> None:
    """Refuse a model type that no registry knows (hydra's ``model._name``), and a plugin model built for a
    task of the other kind: a model from a checkpoint (fairseq-generate, -interactive, -eval-lm, whose
    ``--task`` is the user's while the checkpoint's arguments name the task it was trained with) or from a
    YAML. fairseq-train's command line is checked earlier, by :func:`check_task_and_arch`."""
    if model_type not in ARCH_MODEL_REGISTRY and model_type not in MODEL_REGISTRY:
        close = difflib.get_close_matches(model_type, [*ARCH_MODEL_REGISTRY, *MODEL_REGISTRY], n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise DeepInitConfigError(
            f"model._name {model_type}: no model or architecture of that name is registered (every fairseq-train "
            f"--arch is a valid name; the plugin's need common.user_dir){hint}"
        )
    model_cls = ARCH_MODEL_REGISTRY.get(model_type) or MODEL_REGISTRY.get(model_type)
    if task is None or model_cls not in [MODEL_REGISTRY.get(m) for m in PLUGIN_MODELS]:
        return
    decoder_only = issubclass(model_cls, FairseqLanguageModel)
    wrong = isinstance(task, TranslationTask) if decoder_only else isinstance(task, LanguageModelingTask)
    if not wrong:
        return
    if not from_checkpoint:
        check_task_and_arch(argparse.Namespace(task=_task_name(task), arch=model_type))
        return
    if decoder_only:
        raise DeepInitConfigError(
            f"the checkpoint holds a decoder-only language model (--arch {model_type}), which --task "
            f"{_task_name(task)} cannot run on source and target sentences; evaluate it with fairseq-eval-lm on "
            "language-model data, or give a translation checkpoint"
        )
    raise DeepInitConfigError(
        f"the checkpoint holds an encoder-decoder (translation) model (--arch {model_type}), which --task "
        f"{_task_name(task)} cannot run on one token stream; translate with fairseq-generate on translation data, "
        "or give a language-model checkpoint"
    )


def build_model(original: Callable, cfg: Any, task: Any, from_checkpoint: bool = False) -> Any:
    """fairseq's ``models.build_model`` (``fairseq/models/__init__.py``, line 56) after :func:`check_task_and_model`.

    fairseq raised ``KeyError: "'_name'"`` (while formatting its own message) for an unknown ``model._name``,
    and built a language model for ``fairseq-generate`` on translation data (garbage output, a BLEU, no
    warning) or failed deep in ``fairseq-eval-lm`` (``supported_targets``). For a stock model nothing changes.
    """
    model_type = getattr(cfg, "_name", None) or getattr(cfg, "arch", None)
    if isinstance(model_type, str):
        check_task_and_model(model_type, task, from_checkpoint)
    return original(cfg, task, from_checkpoint)


# --- binarised splits ---------------------------------------------------------------------------


def _dictionary_file(prefix: str) -> str:
    """The dictionary fairseq-preprocess writes beside ``prefix``: ``dict.<lang>.txt`` or ``dict.txt``."""
    parts = os.path.basename(prefix).split(".")
    name = f"dict.{parts[-1]}.txt" if len(parts) >= 3 else "dict.txt"
    return os.path.join(os.path.dirname(prefix), name)


def check_split_file(prefix: str, dictionary: Any = None) -> None:
    """Refuse an mmap split ``prefix`` (``.bin`` + ``.idx``) that is empty, shorter than its index
    says, or holds a token id the ``dictionary`` does not have (:class:`DataConfigError`)."""
    bin_path, idx_path = indexed_dataset.data_file_path(prefix), indexed_dataset.index_file_path(prefix)
    split = os.path.basename(prefix).split(".")[0]
    size = os.path.getsize(bin_path)
    if size == 0:
        flag = PREPROCESS_FLAG.get(split, "--trainpref/--validpref/--testpref")
        raise DataConfigError(
            f"the {split} split {bin_path} holds no sentences; binarise a {split} file with sentences "
            f"(fairseq-preprocess {flag}) or use another data folder"
        )
    index = indexed_dataset.MMapIndexedDataset.Index(idx_path)
    dtype = np.dtype(index.dtype)
    expected = int(index.sizes.astype(np.int64).sum()) * dtype.itemsize
    del index
    if size != expected:
        raise DataConfigError(
            f"{bin_path} has {size} bytes where its index {idx_path} needs {expected} (an interrupted copy or "
            "fairseq-preprocess run?); binarise the split again"
        )
    if dictionary is None:
        return
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    largest = int(tokens.max())
    del tokens
    if largest >= len(dictionary):
        raise DataConfigError(
            f"{bin_path} holds token id {largest}, but its dictionary ({_dictionary_file(prefix)}) has only "
            f"{len(dictionary)} entries: the split was binarised with another dictionary. Use the dictionary "
            "fairseq-preprocess wrote with this data, or binarise the data again with this one (--srcdict/--tgtdict)"
        )


def load_indexed_dataset(original, path, dictionary=None, dataset_impl=None, combine=False, default="cached"):
    """fairseq's ``data_utils.load_indexed_dataset`` (``original``) after :func:`check_split_file` on every file
    it will open (``path``, and ``path1``, ``path2``, ... with ``combine``)."""
    for k in itertools.count():
        path_k = path + (str(k) if k > 0 else "")
        impl = dataset_impl or indexed_dataset.infer_dataset_impl(path_k)
        if impl != "mmap" or not indexed_dataset.MMapIndexedDataset.exists(path_k):
            break
        check_split_file(path_k, dictionary)
        if not combine:
            break
    return original(path, dictionary, dataset_impl, combine, default)


def guarded(arch_fn: Callable) -> Callable:
    """A plugin architecture function (``ARCH_CONFIG_REGISTRY``, which fairseq calls on the parsed arguments in
    ``options.parse_args_and_arch``) that first refuses a task of the other kind and ``--ddp-backend
    fully_sharded``, and after its defaults an embedding dimension the heads do not divide."""

    def arch(args):
        check_task_and_arch(args)
        check_ddp_backend(args)
        out = arch_fn(args)
        check_dimensions(args)  # after the architecture's defaults
        return out

    return arch
