"""Fold Admin's omega into a stock ``transformer_lm`` checkpoint (Liu et al. 2020, appendix C).

``deepinit-export-admin-lm ADMIN_LM.pt OUT.pt`` (or ``python -m fairseq_deepinit.lm.export``) writes a
checkpoint of fairseq's own ``transformer_lm`` that stock ``fairseq-eval-lm`` / ``fairseq-interactive``
load without ``--user-dir`` and that computes the same function. The fold is the translation one
(:func:`fairseq_deepinit.admin.fold.fold_state_dict`, whose docstring has the derivation) over the one
decoder stack: each sub-layer's input projections (self-attention q, k, v; FFN fc1) take 1/omega_k,
the preceding norm omega_k, the embedding and positions the first omega (sinusoidal positions become a
learned table), and a tied output projection is compensated in the last norm.

The stored model arguments are exactly the fields of fairseq's ``TransformerLanguageModelConfig``
(fairseq merges a checkpoint's config into that dataclass), with ``decoder_normalize_before`` false:
fairseq applies ``base_lm_architecture`` (which would force Pre-LN) only when a model is built from
the command line, not when it is loaded from a checkpoint.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import typing
from types import SimpleNamespace
from typing import List

import torch
from fairseq.models import build_model
from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig
from omegaconf import OmegaConf

from ..admin.export import (
    _dictionary,
    _load,
    _model_args,
    check_destination,
    check_profiled,
    export_parser,
    run_export,
    save_export,
    stock_checkpoint,
)
from ..admin.fold import _primitive, check_exportable, fold_state_dict
from ..errors import AdminExportError
from .model import DeepInitLanguageModel

STOCK_NAME = "transformer_lm"


def export_lm_args(args, changes: dict) -> dict:
    """The ``transformer_lm`` model arguments: every field of its config dataclass, as primitives."""
    out = {}
    for f in dataclasses.fields(TransformerLanguageModelConfig):
        if f.name.startswith("_") or not hasattr(args, f.name):
            continue
        value = _primitive(getattr(args, f.name))
        if isinstance(value, bool) and int in (f.type, *typing.get_args(f.type)):
            value = int(value)  # fairseq's base_lm_architecture stores base_shuffle=False in an int field
        out[f.name] = value
    out.update(changes)
    out.update(
        _name=STOCK_NAME,
        decoder_normalize_before=False,
        checkpoint_activations=False,
        offload_activations=False,
    )
    return out


def verify_lm(admin_sd, admin_args, plain_sd, plain_args: dict, tolerance: float, seed: int = 0) -> float:
    """Build both models, run them on one random right-padded batch, compare log-probabilities."""
    dictionary = _dictionary(admin_sd["decoder.embed_tokens.weight"].size(0))
    task = SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    a_args = copy.deepcopy(admin_args)
    a_args.task = None  # only evaluated: no profiling-task checks
    admin_model = DeepInitLanguageModel.build_model(a_args, task).double()
    admin_model.load_state_dict(admin_sd, strict=True, model_cfg=a_args)
    plain_model = build_model(OmegaConf.create(plain_args), task, from_checkpoint=True).double()
    plain_model.load_state_dict(plain_sd, strict=True)
    if type(plain_model) is not TransformerLanguageModel:
        raise AdminExportError(f"the exported model was built as {type(plain_model).__name__}, not fairseq's")
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, len(dictionary), (3, 11), generator=g)
    tokens[1, -3:] = dictionary.pad()
    outs = []
    for m in (admin_model, plain_model):
        m.eval()
        with torch.no_grad():
            outs.append(torch.log_softmax(m(tokens)[0], -1))
    diff = (outs[0] - outs[1]).abs()[tokens.ne(dictionary.pad())].max().item()
    if not diff <= tolerance:
        raise AdminExportError(f"the exported model's log-probabilities differ by {diff:.3g} > {tolerance}")
    return diff


def export_lm_checkpoint(src: str, dst: str, check: bool = True, tolerance: float = 1e-4) -> dict:
    """Fold ``src`` (an Admin ``deepinit_lm`` checkpoint) into ``dst``; returns a summary."""
    check_destination(src, dst)
    state = _load(src)
    args = copy.deepcopy(_model_args(state))
    if getattr(args, "encoder_layers", None) != 0:
        raise AdminExportError(f"{src} is not a deepinit language model; use deepinit-export-admin for translation")
    check_exportable(args)
    check_profiled(state, src, "decoder")
    model_sd, changes = fold_state_dict(state["model"], args)
    model_args = export_lm_args(args, changes)
    criterion = ({"_name": "cross_entropy", "sentence_avg": False}, "CrossEntropy")
    out = stock_checkpoint(state, src, model_sd, model_args, changes, "language_modeling", criterion)
    summary = {"changes": changes}
    if check:
        summary["max_abs_diff"] = verify_lm(state["model"], args, model_sd, model_args, tolerance)
    save_export(out, dst)
    return summary


def build_parser() -> argparse.ArgumentParser:
    """``deepinit-export-admin-lm``'s options (also walked by tests/test_tools.py)."""
    return export_parser(
        "deepinit-export-admin-lm",
        "Fold Admin's omega into a stock fairseq 'transformer_lm' checkpoint that fairseq-eval-lm loads "
        "without --user-dir (Liu et al. 2020, appendix C).",
        "an Admin language-model checkpoint (--arch admin_lm*)",
        "where to write the transformer_lm checkpoint",
    )


def main(argv: List[str] | None = None) -> int:
    return run_export(build_parser(), export_lm_checkpoint, STOCK_NAME, argv)


if __name__ == "__main__":
    sys.exit(main())
