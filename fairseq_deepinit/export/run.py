"""One export, start to end: read the checkpoint, classify it, refuse it or fold it, write, check, rename.

The order is the guarantee: everything that can refuse (the arguments, the output path, the checkpoint, the
route of the target, Admin's profiling flag, non-finite weights, the state dict against its model, the
dictionaries, the ``ctranslate2`` package) is checked before anything is written, the arguments and the output
before the checkpoint is read; the model is then written beside the output, reloaded and compared with the
plugin model, and only then renamed into place (:func:`.output.save_atomically`), so the output is either
untouched or a checked export.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import List

import torch

from ..errors import ExportError
from . import hf_tokenizer, model_card, output, scoring, source, to_ct2, to_fairseq, to_hf
from . import route as routes
from .fold import plain_state_dict
from .route import Route

logger = logging.getLogger(__name__)

#: the quantizations CTranslate2's converters accept (ctranslate2/specs/model_spec.py ACCEPTED_MODEL_TYPES)
QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16", "float32")
CT2_PIN = "ctranslate2==4.8.5"
METADATA = "deepinit_export.json"
#: the targets whose model is a folder
FOLDERS = {routes.CTRANSLATE2: output.CT2_FOLDER, routes.HUGGINGFACE: output.HF_FOLDER}


def _require_ctranslate2() -> None:
    try:
        import ctranslate2  # noqa: F401
    except ImportError as e:
        raise ExportError(
            f"--to ctranslate2 needs the ctranslate2 package: pip install {CT2_PIN} (requirements/ctranslate2.txt)"
        ) from e


@dataclass(frozen=True)
class Only:
    """What a narrower command over this same export takes (``deepinit-export-admin`` and ``-lm``, aliases of
    ``deepinit-export --to fairseq``).

    ``lm``: only language models (True) or only translation models (False), None both; ``other``: the command
    for the other kind, named in its refusal; ``residual``: only models of this residual scaling (its name
    in the messages: ``label``), whose fold to a stock transformer must exist; ``error``: the class of those
    refusals.
    """

    lm: bool | None = None
    other: str = ""
    residual: str | None = None
    label: str = ""
    error: type = ExportError


def check_kind(args, only: Only, src: str) -> None:
    """Refuse, in one line, a language model where ``only`` takes translation models, or the other way round
    (read from the stored arguments before anything else: ``src`` is the checkpoint, for the messages)."""
    lm = source.is_language_model(args)
    if only.lm is False and lm:
        raise ExportError(f"{src} is a deepinit language model; use {only.other} for it")
    if only.lm is True and not lm:
        raise ExportError(f"{src} is not a deepinit language model; use {only.other} for translation")


def check_only(route: Route, only: Only) -> None:
    """Refuse, in one line, a model whose residual scaling is not ``only``'s, or whose fold to a stock
    transformer the route refuses."""
    if only.residual is None:
        return
    if route.residual != only.residual:
        raise only.error(
            f"this checkpoint uses --residual-scale {route.residual}, not {only.label}; nothing to fold (only "
            f"{only.label} checkpoints can be exported)"
        )
    if routes.FAIRSEQ in route.reasons:
        raise only.error(f"cannot fold {only.label} into a stock transformer with: {route.reasons[routes.FAIRSEQ]}")


def prepare(src: str, dst: str, target: str, only: Only | None = None, force: bool = False, tolerance: float = 1e-4):
    """``(state, args, spec, route)`` of ``src`` once every check before the model is built has passed (``spec``:
    the model's, resolved from the checkpoint's arguments once).

    ``only``: what a narrower command takes (:class:`Only`); ``force``: replace an existing output
    (:func:`.output.check_destination` says which).
    """
    output.check_arguments(dst, tolerance)
    output.check_destination(src, dst, folder=FOLDERS.get(target), force=force)
    if target == routes.CTRANSLATE2:
        _require_ctranslate2()
    if target == routes.HUGGINGFACE:
        to_hf.require_transformers()
    state, args = source.load_checkpoint(src)
    if only is not None:
        check_kind(args, only, src)
    spec = source.model_spec(args)
    route = routes.classify(args, spec)
    if only is not None:
        check_only(route, only)
    route.check(target)
    source.check_profiled(state, src, "decoder" if route.lm else "encoder")
    source.check_finite(state["model"], src)
    return state, args, spec, route


def export_fairseq(
    src: str, dst: str, check: bool = True, tolerance: float = 1e-4, only: Only | None = None, force: bool = False
) -> dict:
    """``--to fairseq``: a stock ``transformer`` / ``transformer_lm`` checkpoint (``only``: what a narrower
    command takes); returns a summary."""
    state, args, _spec, route = prepare(src, dst, routes.FAIRSEQ, only, force, tolerance)
    model = source.build_plugin_model(state["model"], args, torch.float64)
    plain, changes = plain_state_dict(model, args, route)
    summary = {"route": route, "changes": changes, "arch": to_fairseq.stock_args(args, changes)["_name"]}

    def write(tmp: str) -> None:
        to_fairseq.write_stock(state, src, tmp, plain, args, changes, route.fairseq)
        if check:
            summary["max_abs_diff"] = to_fairseq.check_stock_file(tmp, model, tolerance)

    output.save_atomically(write, dst)
    return summary


def export_ct2(
    src: str,
    dst: str,
    quantization: str | None = None,
    data: str | None = None,
    check: bool = True,
    tolerance: float = 1e-4,
    force: bool = False,
) -> dict:
    """``--to ctranslate2``: a CTranslate2 model folder (vocabularies included); returns a summary.

    The check scores random sentences with the written float32 model and the plugin model in float64
    (:func:`.scoring.check_ct2_dir`); a quantized model is written after that check from the same spec and
    its difference is reported, not bounded (quantization is an approximation the user asked for); a non-finite
    value in it is refused all the same.
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ExportError(f"unknown --quantization {quantization}; choose from {', '.join(QUANTIZATIONS)}")
    state, args, _spec, route = prepare(src, dst, routes.CTRANSLATE2, force=force, tolerance=tolerance)
    dicts = source.load_dictionaries(state, args, data)
    vocabularies: List[List[str]] = [to_ct2.vocabulary(d) for d in dicts[: 1 if route.lm else 2]]
    model = source.build_plugin_model(state["model"], args, torch.float64)
    plain, _changes = plain_state_dict(model, args, route)
    facts = to_ct2.stack_facts(model, args, route)
    summary = {"route": route, "quantization": quantization or "float32"}

    def save(folder: str, q: str | None) -> None:
        spec = to_ct2.build_spec(plain, route, facts, vocabularies)
        spec.validate()
        spec.optimize(quantization=q)
        os.makedirs(folder, exist_ok=True)
        spec.save(folder)

    def write(tmp: str) -> None:
        save(tmp, None)
        if check:
            summary["max_abs_diff"] = scoring.check_ct2_dir(tmp, model, vocabularies, tolerance)
        if quantization not in (None, "float32"):
            for name in os.listdir(tmp):
                os.unlink(os.path.join(tmp, name))
            save(tmp, quantization)
            if check:
                summary["quantized_max_abs_diff"] = scoring.check_ct2_dir(
                    tmp, model, vocabularies, float("inf"), compute_type="default"
                )
        meta = {
            "source": os.path.abspath(src),
            "model": "language model" if route.lm else "translation",
            "route": route.describe(),
            "quantization": quantization or "float32",
            "ctranslate2_layer_norm_epsilon": route.ct2_eps,
            "max_target_positions": int(getattr(args, "max_target_positions", 1024) or 1024),
            "decoding": "docs/export.md, 'Decoding as fairseq-generate'",
        }
        with open(os.path.join(tmp, METADATA), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)

    output.save_atomically(write, dst)
    return summary


def export_hf(
    src: str, dst: str, data: str | None = None, check: bool = True, tolerance: float = 1e-4, force: bool = False
) -> dict:
    """``--to huggingface``: a transformers model folder (FSMT, M2M100 or XGLM: :mod:`.to_hf`) with its generation
    config, the fairseq dictionaries, a model card and, where the data folder says how its text was made, the
    tokenizer; returns a summary.

    The model goes through its stock fairseq form (the folds of ``--to fairseq``), is written in float32 with
    ``save_pretrained``, reloaded with transformers' auto class and compared with the plugin model in float64
    (:func:`.to_hf.check_hf_dir`) before the folder is renamed into place.
    """
    state, args, spec, route = prepare(src, dst, routes.HUGGINGFACE, force=force, tolerance=tolerance)
    files = source.dictionary_files(state, args, data)
    dicts = list(source.load_dictionaries(state, args, data))[: len(files)]
    model = source.build_plugin_model(state["model"], args, torch.float64, dicts[0], dicts[-1])
    plain, changes = plain_state_dict(model, args, route)
    stock_args = to_fairseq.stock_args(args, changes)
    stock = to_fairseq.build_stock(stock_args, model, plain)
    task = source.task_options(state)
    langs = [task.get("source_lang") or "src", task.get("target_lang") or "tgt"]
    hf = to_hf.hf_model(route.hf_class, stock, stock_args, dicts, to_hf.dropouts(stock_args), langs)
    class_name, _config, auto = to_hf.CLASSES[route.hf_class]
    pipeline = hf_tokenizer.describe_pipeline(source.data_folder(state, data))
    summary = {"route": route, "hf_class": class_name, "tokenizer": pipeline is not None}

    def write(tmp: str) -> None:
        hf.save_pretrained(tmp)
        to_hf.generation_config(hf, stock_args).save_pretrained(tmp)
        names = model_card.copy_dictionaries(tmp, files)
        tokenizers = []
        if pipeline is not None:
            positions = int(hf.config.max_position_embeddings)
            tokenizers = hf_tokenizer.write_tokenizer(tmp, dicts[0], dicts[-1], pipeline, model_max_length=positions)
        if check:
            summary["max_abs_diff"] = to_hf.check_hf_dir(tmp, model, tolerance)
        diff = summary.get("max_abs_diff")
        target = [os.path.relpath(t, tmp) for t in tokenizers[1:]]
        model_card.write_card(tmp, src, state, args, spec, route, hf, auto, pipeline is not None, names, diff, target)

    output.save_atomically(write, dst)
    return summary


def export(src: str, dst: str, to: str, **kwargs) -> dict:
    """``deepinit-export``'s work: :func:`export_fairseq`, :func:`export_ct2` or :func:`export_hf`."""
    if to == routes.FAIRSEQ:
        for name in ("quantization", "data"):
            if kwargs.pop(name, None) is not None:
                raise ExportError(f"--{name} applies to --to ctranslate2 only; drop it for --to fairseq")
        return export_fairseq(src, dst, **kwargs)
    if to == routes.CTRANSLATE2:
        return export_ct2(src, dst, **kwargs)
    if to == routes.HUGGINGFACE:
        if kwargs.pop("quantization", None) is not None:
            raise ExportError("--quantization applies to --to ctranslate2 only; drop it for --to huggingface")
        return export_hf(src, dst, **kwargs)
    raise ExportError(f"unknown --to {to}; choose from {', '.join(routes.TARGETS)}")
