"""One line for a model that cannot be loaded: fairseq-generate/-interactive/-eval-lm ``--path``, and resume.

Wrappers of fairseq 0.12.3's ``checkpoint_utils.load_model_ensemble_and_task`` (``fairseq/checkpoint_utils.py``,
line 419) and ``Trainer.load_checkpoint`` (``fairseq/trainer.py``, line 465), installed by
:mod:`fairseq_deepinit.patches`; each calls fairseq's function and only changes its errors: a ``--path`` that is
missing, a folder or a bare state dict; a checkpoint whose weights do not fit the model its options build (a key
missing, one too many, or a tensor of another shape: torch's "Error(s) in loading state_dict", which fairseq's
trainer hides behind "Cannot load model parameters ... please ensure that the architectures match"); a resume
whose criterion or optimizer is not the checkpoint's (fairseq's assertion); a plugin error inside fairseq's own
``except``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, List, Tuple

from fairseq import checkpoint_utils
from fairseq.file_io import PathManager

from ..errors import CheckpointFileError, plugin_error_in

# fairseq's Trainer.load_checkpoint (trainer.py:606-612) when the checkpoint's criterion or optimizer class is not
# this run's: "Criterion does not match; please reset the optimizer (--reset-optimizer). <saved> vs <current>"
_STATE_CHECK = re.compile(r"(Criterion|Optimizer) does not match; .* (\S+) vs (\S+)$")

_LOAD_ERROR = "Error(s) in loading state_dict for "
_KEYS = re.compile(r'(Missing|Unexpected) key\(s\) in state_dict: ((?:"[^"]*"(?:, )?)+)')
_SHAPE = re.compile(r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from "
                    r"checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)")  # fmt: skip


def _registered(kind: str, class_name: str) -> str:
    """``--criterion NAME`` / ``--optimizer NAME`` of a registered class, else the class name (fairseq's wrappers
    such as ``FP16Optimizer``)."""
    from fairseq.registry import REGISTRIES

    registry = REGISTRIES.get(kind, {}).get("registry", {})
    name = next((n for n, cls in registry.items() if getattr(cls, "__name__", None) == class_name), None)
    return f"--{kind} {name}" if name else f"the {kind} {class_name}"


_VOCAB = re.compile(r"(embed_tokens|output_projection)\.weight$")  # a row per dictionary entry


def dictionary_sizes(exc: BaseException | None) -> Tuple[int, int] | None:
    """``(the checkpoint's rows, the model's)`` when torch's state-dict error in ``exc``'s chain is only word
    embeddings / output projections with another number of rows (the model was built with another dictionary
    than the checkpoint's: a data folder binarised with another one); else None."""
    while exc is not None and not (isinstance(exc, RuntimeError) and _LOAD_ERROR in str(exc)):
        exc = exc.__cause__ or exc.__context__
    if exc is None or _KEYS.search(str(exc)):
        return None
    shapes = [(k, json.loads(a), json.loads(b)) for k, a, b in _SHAPE.findall(str(exc))]
    if not shapes or not all(_VOCAB.search(k) and len(a) == len(b) == 2 and a[1] == b[1] for k, a, b in shapes):
        return None
    return shapes[0][1][0], shapes[0][2][0]


def _dictionary_clause(exc: BaseException) -> str | None:
    sizes = dictionary_sizes(exc)
    if sizes is None:
        return None
    return (
        f"its word embeddings have {sizes[0]} rows and the data folder's dictionary {sizes[1]} entries: the data "
        "was binarised with another dictionary than the one the checkpoint was trained with. Use the data folder it "
        "was trained with, or binarise the data again with its dictionaries (fairseq-preprocess --srcdict/--tgtdict)"
    )


def _first(items: List[str]) -> str:
    return ", ".join(items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")


def weights_mismatch(exc: BaseException | None) -> str | None:
    """What torch's ``Module.load_state_dict`` found (``torch/nn/modules/module.py``, its "Error(s) in loading
    state_dict" RuntimeError) in ``exc`` or the exceptions it was raised from or while handling, as one clause;
    None when there is no such error (fairseq's ``Trainer.load_checkpoint`` raises its own exception inside
    ``except``, trainer.py:596-600, so torch's is its context)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if isinstance(exc, RuntimeError) and _LOAD_ERROR in text:
            keys = {kind: re.findall(r'"([^"]*)"', names) for kind, names in _KEYS.findall(text)}
            shapes = [f"{k} {a} in the file, {b} in the model" for k, a, b in _SHAPE.findall(text)]
            parts = [
                f"{what}: {_first(items)}"
                for what, items in (
                    ("missing from it", keys.get("Missing", [])),
                    ("not in the model", keys.get("Unexpected", [])),
                    ("reshaped", shapes),
                )
                if items
            ]
            return "; ".join(parts) or text.splitlines()[0]
        exc = exc.__cause__ or exc.__context__
    return None


def load_model_ensemble_and_task(
    original: Callable, filenames: list, arg_overrides: dict | None = None, task: Any = None, strict: bool = True,
    suffix: str = "", num_shards: int = 1, state: dict | None = None,
) -> Any:  # fmt: skip
    """fairseq's ``checkpoint_utils.load_model_ensemble_and_task`` (line 419), through which fairseq-generate,
    -interactive and -eval-lm (``--path``) and deepinit-diagnose load models, with one line for a file that does
    not exist or is a folder (fairseq: ``OSError: Model file not found`` or ``IsADirectoryError``), for a
    checkpoint with neither ``args`` nor ``cfg`` (``RuntimeError: Neither args nor cfg exist in state ...``), and
    for weights that do not fit the model (torch's "Error(s) in loading state_dict"; embeddings of another size:
    the data folder's dictionary is not the checkpoint's). Only these errors change, for any model's checkpoint;
    what loads, loads as in fairseq."""
    for name in filenames if state is None else []:
        path = checkpoint_utils.get_maybe_sharded_checkpoint_filename(name, suffix, 0, num_shards)
        if PathManager.path_requires_pathmanager(path):
            continue
        if os.path.isdir(path):
            raise CheckpointFileError(
                f"checkpoint {path} is a folder: give a checkpoint file in it ({path}/checkpoint_best.pt, ...)"
            )
        if not PathManager.exists(path):
            raise CheckpointFileError(
                f"checkpoint {path} does not exist; give a checkpoint written by fairseq-train "
                "(<save-dir>/checkpoint_best.pt, ...)"
            )
    try:
        return original(filenames, arg_overrides, task, strict, suffix, num_shards, state)
    except RuntimeError as e:
        which = filenames[0] if len(filenames) == 1 else "one of " + ", ".join(map(str, filenames))
        vocab = _dictionary_clause(e)
        if vocab is not None:
            raise CheckpointFileError(f"checkpoint {which} does not fit the task's data: {vocab}") from None
        mismatch = weights_mismatch(e)
        if mismatch is not None:
            raise CheckpointFileError(
                f"checkpoint {which} holds weights that do not fit the model its own options build ({mismatch}): "
                "the file was changed after fairseq-train wrote it (or --model-overrides changes the model). Use a "
                "checkpoint as fairseq-train wrote it"
            ) from None
        if "Neither args nor cfg exist in state" not in str(e):
            raise
        raise CheckpointFileError(
            f"checkpoint {which} holds neither 'args' nor 'cfg' (the options fairseq-train saves with the weights): it "
            "was not written by fairseq-train (a bare state dict?). Use a checkpoint written by fairseq-train"
        ) from None


def trainer_load_checkpoint(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    """fairseq's ``Trainer.load_checkpoint`` (trainer.py, line 465) that lets a plugin error through.

    Its ``except Exception`` around the model's ``load_state_dict`` (line 596) raises
    ``Exception("Cannot load model parameters ...; please ensure that the architectures match")``
    for whatever failed, which would hide a plugin error's message (and its class from a library
    caller); that plugin error is raised instead.
    """
    filename = args[0] if args else kwargs.get("filename")
    try:
        return original(self, *args, **kwargs)
    except AssertionError as e:
        m = _STATE_CHECK.match(str(e))
        if m is None:
            raise
        what = m.group(1).lower()
        saved, current = _registered(what, m.group(2)), _registered(what, m.group(3))
        raise CheckpointFileError(
            f"{filename} was trained with {saved} and this run uses {current}, whose state fairseq does not carry "
            f"over. Resume with the checkpoint's --{what}, or add --reset-optimizer to start the optimizer and the "
            "learning-rate schedule afresh from its weights"
        ) from None
    except Exception as e:
        plugin = plugin_error_in(e)
        if plugin is not None and plugin is not e:
            raise plugin from None
        mismatch = weights_mismatch(e) if plugin is None else None
        if mismatch is None:
            raise
        vocab = _dictionary_clause(e)
        if vocab is not None:
            raise CheckpointFileError(f"checkpoint {filename} does not fit this run's data: {vocab}") from None
        raise CheckpointFileError(
            f"checkpoint {filename} holds weights that do not fit the model this run builds ({mismatch}): the file "
            "was changed after fairseq-train wrote it, or this run's model options are not the ones it was trained "
            "with. Resume with those options, pass --restore-file with another checkpoint, or start a new run in "
            "another --save-dir"
        ) from None
