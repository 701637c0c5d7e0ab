"""The export's input and output files: the checkpoint, its model arguments and dictionaries, the
plugin model rebuilt from them, and writes that leave either the old file or the whole new one.

- :func:`load_checkpoint`: the checkpoint (torch's ``weights_only`` loader with the plugin's allow-list,
  :func:`fairseq_deepinit.checkpoints.integrity.torch_load_checked`) and its resolved model arguments, from
  fairseq-train's ``argparse.Namespace`` or fairseq-hydra-train's ``model`` node;
- :func:`build_plugin_model`: the ``deepinit`` / ``deepinit_lm`` model of those arguments holding the
  checkpoint's weights, in float64 (the folds' arithmetic) or float32 (the comparisons with CTranslate2);
- :func:`check_finite`: a checkpoint whose weights hold NaN or inf is refused, naming the tensor;
- :func:`load_dictionaries`: the fairseq dictionaries the model was trained with (CTranslate2's vocabularies).

The output's checks and the write by rename are :mod:`.output`'s.
"""

from __future__ import annotations

import argparse
import copy
import os
from types import SimpleNamespace
from typing import List, Tuple

import torch

from .. import errors, model_config, options, resolve
from ..checkpoints import config_check
from ..checkpoints.integrity import torch_load_checked
from ..errors import ExportError
from ..spec import ModelSpec


def _hydra_model_args(node: dict) -> argparse.Namespace | None:
    """A hydra checkpoint's model node as the resolved Namespace a fairseq-train checkpoint stores: the model's
    ``build_model`` resolves a copy (model_config.py), the YAML's values are what the checkpoint keeps."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    try:
        args = model_config.as_namespace(node)
        if ARCH_MODEL_NAME_REGISTRY.get(args.arch) == config_check.LM_MODEL:
            args.encoder_layers = 0  # what the language model's build stores (lm/model.py, resolve_lm_args)
        options.resolve_and_validate(args)
    except Exception:  # not a model this plugin can build: "no model arguments" below
        return None
    return args


def model_args(state: dict) -> argparse.Namespace:
    """The resolved model arguments stored in a checkpoint of the plugin (fairseq-train or fairseq-hydra-train)."""
    cfg = state.get("cfg") or {}
    args = cfg.get("model") if isinstance(cfg, dict) else None
    if isinstance(args, dict) and args.get("_name"):  # fairseq-hydra-train's YAML node
        args = _hydra_model_args(args)
    if not isinstance(args, argparse.Namespace):
        args = state.get("args")
    if not isinstance(args, argparse.Namespace):
        raise ExportError("the checkpoint has no model arguments of the deepinit model (was it written by it?)")
    return args


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The :class:`~fairseq_deepinit.spec.ModelSpec` of a checkpoint's model arguments, resolved as its model's
    build resolves them (the arguments are only read); arguments no build could resolve (an edited file) are
    one line."""
    try:
        return resolve.resolve(args)
    except errors.DeepInitError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # a stored value of the wrong kind, or none
        raise ExportError(
            f"the checkpoint's model arguments do not describe a deepinit model ({errors.one_line(e)}); {MISFIT_FIX}"
        ) from e


def is_language_model(args) -> bool:
    """A ``deepinit_lm`` checkpoint (its build stores ``encoder_layers = 0``, lm/model.py)."""
    return getattr(args, "encoder_layers", None) == 0


def load_checkpoint(path: str) -> Tuple[dict, argparse.Namespace]:
    """``(state, a copy of its model arguments)``; a damaged or refused file is one-line error."""
    state = torch_load_checked(path, map_location="cpu")
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise ExportError(f"{path} holds no model state dict; give a checkpoint written by fairseq-train")
    args = copy.deepcopy(model_args(state))
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    arch = getattr(args, "arch", None)
    model = ARCH_MODEL_NAME_REGISTRY.get(arch)
    if arch is not None and model not in (config_check.TRANSLATION_MODEL, config_check.LM_MODEL):
        raise ExportError(
            f"{path} is a checkpoint of fairseq's {model or arch}, not of a deepinit model: a stock fairseq "
            "checkpoint needs no export (CTranslate2's own ct2-fairseq-converter reads it)"
        )
    return state, args


def check_profiled(state: dict, src: str, stack: str) -> None:
    """A model whose residuals are profiled (Admin's) and whose first ``stack`` layer never was is not trained
    (its omega is the placeholder): nothing to export. Models without the flag pass."""
    flag = state["model"].get(f"{stack}.layers.0.residuals.self_attn.profiled")
    if flag is not None and not bool(flag):
        raise ExportError(f"{src}: omega was never profiled; this is not a trained Admin model")


def dictionary_of_size(size: int):
    """A fairseq Dictionary of ``size`` symbols (special symbols first), for a model whose words do not matter."""
    from fairseq.data import Dictionary

    d = Dictionary()
    i = 0
    while len(d) < size:
        d.add_symbol(f"w{i}")
        i += 1
    return d


def build_plugin_model(sd: dict, args, dtype: torch.dtype, src_dict=None, tgt_dict=None) -> torch.nn.Module:
    """The plugin model of ``args`` holding ``sd`` (strict), in ``dtype``, in eval mode.

    Built in ``dtype`` before the weights are loaded, so that float64 holds the checkpoint's values unrounded.
    Dictionaries default to stand-ins of the embedding's size (only their size and special symbols matter).
    """
    from ..lm.model import DeepInitLanguageModel
    from ..model import DeepInitTransformerModel

    lm = is_language_model(args)
    tgt_dict = tgt_dict or dictionary_of_size(embedding_rows(sd, "decoder", args))
    if src_dict is None:
        src_dict = tgt_dict if lm else dictionary_of_size(embedding_rows(sd, "encoder", args))
    task = SimpleNamespace(source_dictionary=src_dict, target_dictionary=tgt_dict)
    a = copy.deepcopy(args)
    a.task = None  # only evaluated: no profiling-task checks
    a.checkpoint_activations = a.offload_activations = False  # the layers themselves, not their training wrappers
    cls = DeepInitLanguageModel if lm else DeepInitTransformerModel
    model = cls.build_model(a, task).to(dtype)
    try:
        model.load_state_dict(sd, strict=True, model_cfg=a)
    except RuntimeError as e:  # torch's report of missing, unexpected or reshaped keys: many lines
        raise ExportError(_misfit(model.state_dict(), sd, args) or errors.one_line(e)) from e
    return model.eval()


def _fit_advice(args) -> str:
    return f"the checkpoint's weights do not fit the model its arguments describe (--arch {getattr(args, 'arch', '?')})"


def embedding_rows(sd: dict, stack: str, args) -> int:
    """The rows of ``stack``'s token embedding in ``sd`` (its dictionary's size), or a one-line refusal."""
    key = f"{stack}.embed_tokens.weight"
    weight = sd.get(key)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ExportError(f"{_fit_advice(args)}: {'reshaped' if key in sd else 'missing'} {key}; {MISFIT_FIX}")
    return weight.size(0)


#: what to do about a state dict that does not fit its model
MISFIT_FIX = "export the checkpoint as fairseq-train wrote it (an edited or damaged file cannot be exported)"


def _misfit(want: dict, got: dict, args, show: int = 3) -> str:
    """One line naming the missing, unexpected and reshaped keys of ``got`` against the model's ``want``."""

    def names(keys) -> str:
        keys = sorted(keys)
        more = f" and {len(keys) - show} more" if len(keys) > show else ""
        return ", ".join(keys[:show]) + more

    missing = set(want) - set(got)
    extra = set(got) - set(want)
    reshaped = {
        f"{k} ({list(got[k].shape)} in the checkpoint, {list(want[k].shape)} in the model)"
        for k in set(want) & set(got)
        if isinstance(got[k], torch.Tensor) and got[k].shape != want[k].shape
    }
    found = (("missing", missing), ("unexpected", extra), ("reshaped", reshaped))
    parts = [f"{what} {names(keys)}" for what, keys in found if keys]
    return f"{_fit_advice(args)}: {'; '.join(parts)}; {MISFIT_FIX}" if parts else ""


def check_finite(sd: dict, src: str) -> None:
    """Refuse a state dict with a NaN or infinite value, naming the first such tensor (its export could not be
    checked: every comparison with a NaN fails, and a model that computes NaN has nothing exact to export)."""
    bad = [k for k, v in sd.items() if isinstance(v, torch.Tensor) and v.is_floating_point() and not v.isfinite().all()]
    if bad:
        v = sd[bad[0]]
        count = int((~v.isfinite()).sum())
        more = f" (and {len(bad) - 1} other tensors)" if len(bad) > 1 else ""
        raise ExportError(
            f"{src}: the weight {bad[0]} holds {count} non-finite values (NaN or inf){more}; the training diverged "
            "before this checkpoint: export an earlier one (checkpointN.pt, or checkpoint_best.pt)"
        )


def task_options(state: dict) -> dict:
    """The training's task options stored in the checkpoint (fairseq-train's Namespace or the ``task`` node)."""
    task = (state.get("cfg") or {}).get("task") if isinstance(state.get("cfg"), dict) else None
    if isinstance(task, dict):
        return task
    return vars(state["args"]) if isinstance(state.get("args"), argparse.Namespace) else {}


def data_folder(state: dict, data: str | None) -> str:
    """``data``, else the first folder of the training's ``task.data`` ("" when none is stored)."""
    return data or str(task_options(state).get("data") or "").split(os.pathsep)[0]


def dictionary_files(state: dict, args, data: str | None) -> List[str]:
    """The paths of the model's fairseq dictionaries (source, target; one for a language model) in ``data`` (a
    fairseq-preprocess folder), else in the training's ``task.data`` stored in the checkpoint."""
    from fairseq.data import data_utils

    task = task_options(state)
    folder = data_folder(state, data)
    if not folder or not os.path.isdir(folder):
        raise ExportError(
            f"the dictionaries are needed for the exported vocabularies and the training data folder "
            f"{folder or '(none stored)'} is not there; give --data DIR, the fairseq-preprocess folder of the model"
        )
    if is_language_model(args):
        return [os.path.join(folder, "dict.txt")]
    src, tgt = task.get("source_lang"), task.get("target_lang")
    if not src or not tgt:
        src, tgt = data_utils.infer_language_pair(folder)
    return [os.path.join(folder, f"dict.{src}.txt"), os.path.join(folder, f"dict.{tgt}.txt")]


def load_dictionaries(state: dict, args, data: str | None) -> Tuple[object, object]:
    """``(source, target)`` fairseq dictionaries of the model (the same one twice for a language model), from
    :func:`dictionary_files`; each must have as many symbols as the model's embedding has rows."""
    from fairseq.data import Dictionary

    files = dictionary_files(state, args, data)
    dicts = []
    for path in files:
        if not os.path.isfile(path):
            raise ExportError(f"no dictionary {path}; give --data DIR, the fairseq-preprocess folder of the model")
        dicts.append(Dictionary.load(path))
    stacks = ["decoder"] if len(dicts) == 1 else ["encoder", "decoder"]
    for d, stack, path in zip(dicts, stacks, files, strict=True):
        rows = embedding_rows(state["model"], stack, args)
        if len(d) != rows:
            raise ExportError(
                f"{path} has {len(d)} symbols and the model's {stack} embedding {rows} rows: give --data the folder "
                "the model was trained on"
            )
    return (dicts[0], dicts[-1])
