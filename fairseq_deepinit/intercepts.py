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
  (:func:`fairseq_deepinit.patches.guard_architectures`, with the ``--ddp-backend`` check).
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

import itertools
import os
from typing import Any

import numpy as np
from fairseq.data import indexed_dataset
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY, MODEL_REGISTRY, FairseqLanguageModel
from fairseq.tasks import TASK_REGISTRY
from fairseq.tasks.language_modeling import LanguageModelingTask
from fairseq.tasks.translation import TranslationTask

from .architectures import FAMILIES
from .checkpoints.config_check import DEEPINIT_MODELS
from .errors import DataConfigError, DeepInitConfigError

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
