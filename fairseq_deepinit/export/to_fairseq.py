"""``--to fairseq``: the plain weights (:mod:`.fold`) as a checkpoint of fairseq's own ``transformer`` /
``transformer_lm``, which stock fairseq loads without ``--user-dir`` under torch >= 2.6.

The checkpoint holds only tensors and plain containers: no pickled ``argparse.Namespace`` (``args`` is None,
the model arguments are a dict in ``cfg``), so torch's ``weights_only`` loader accepts it in a process that
never imported the plugin. Its model arguments are the training's with the plugin's options dropped and the
architecture named ``transformer`` / ``transformer_lm``; the language model's are exactly the fields of
fairseq's ``TransformerLanguageModelConfig`` (fairseq merges a checkpoint's config into that dataclass), with
the stored placement (fairseq applies ``base_lm_architecture``, which would force Pre-LN, only when a model is
built from the command line). The optimizer state is dropped.

:func:`check_stock_file` is the check after writing: it reloads the written file through fairseq's own
``checkpoint_utils.load_checkpoint_to_cpu``, builds fairseq's model from it and compares its log-probabilities
with the plugin model's on a random padded batch, both in float64.
"""

from __future__ import annotations

import dataclasses
import typing
from types import SimpleNamespace

import torch

from ..checkpoints.compat import pickled_globals
from ..errors import ExportError
from ..resolve import fairseq_flags
from .omega import _primitive, export_args
from .scoring import compare_log_probs
from .source import is_language_model, model_spec

LM_STOCK = "transformer_lm"
TRANSLATION_STOCK = "transformer"


def export_lm_args(args, changes: dict) -> dict:
    """The ``transformer_lm`` model arguments: every field of its config dataclass, as primitives."""
    from fairseq.models.transformer_lm import TransformerLanguageModelConfig

    out = {}
    for f in dataclasses.fields(TransformerLanguageModelConfig):
        if f.name.startswith("_") or not hasattr(args, f.name):
            continue
        value = _primitive(getattr(args, f.name))
        if isinstance(value, bool) and int in (f.type, *typing.get_args(f.type)):
            value = int(value)  # fairseq's base_lm_architecture stores base_shuffle=False in an int field
        out[f.name] = value
    out.update(changes)
    out.update(_name=LM_STOCK, checkpoint_activations=False, offload_activations=False)
    out.update(fairseq_flags(model_spec(args)))
    return out


def stock_args(args, changes: dict) -> dict:
    """The stock model's arguments (a dict of primitives) for a translation model or a language model."""
    if is_language_model(args):
        return export_lm_args(args, changes)
    return export_args(args, changes)


def stock_checkpoint(state: dict, src: str, model_sd: dict, model_args: dict, changes: dict, route: str) -> dict:
    """The exported checkpoint: ``state``'s config with ``model_args``, fairseq's task, no user dir.

    The optimizer state is dropped (only the last history entry's metadata is kept); a language model's
    criterion becomes fairseq's ``cross_entropy`` (the training's may be a plugin criterion stock fairseq lacks).
    """
    lm = model_args.get("_name") == LM_STOCK
    cfg = _primitive(state.get("cfg") or {})
    cfg["model"] = model_args
    if isinstance(cfg.get("task"), dict):
        cfg["task"]["_name"] = "language_modeling" if lm else "translation"
    if isinstance(cfg.get("common"), dict):
        cfg["common"]["user_dir"] = None
    history = state.get("optimizer_history") or [{}]
    last = {k: v for k, v in history[-1].items() if k != "optimizer"}
    last = _primitive(last) | {"num_updates": int(last.get("num_updates", 0) or 0)}
    # what fairseq's loader expects of the entry (checkpoint_utils._upgrade_state_dict), whatever wrote the source
    last.setdefault("optimizer_name", "Adam")
    last.setdefault("lr_scheduler_state", {"best": last.pop("best_loss", None)})
    if lm:
        if isinstance(cfg.get("criterion"), dict):
            cfg["criterion"] = {"_name": "cross_entropy", "sentence_avg": False}
        last["criterion_name"] = "CrossEntropy"
    return {
        "args": None,
        "cfg": cfg,
        "model": {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in model_sd.items()},
        "criterion": None,
        "optimizer_history": [last],
        "task_state": {},
        "extra_state": {"deepinit_export": {"source": src, "route": route, "changes": _primitive(changes)}},
    }


def _random_batch(model, seed: int = 0):
    """``(src_tokens, src_lengths, prev_output_tokens, target mask)``: left-padded sources and right-padded
    targets, as fairseq's translation batches (a language model's tokens in ``prev_output_tokens``)."""
    dec = model.decoder.dictionary
    g = torch.Generator().manual_seed(seed)
    bsz, src_len, tgt_len = 4, 9, 7
    prev = torch.randint(dec.nspecial, len(dec), (bsz, tgt_len), generator=g)
    prev[1, -2:] = dec.pad()
    if getattr(model, "encoder", None) is None:
        return None, None, prev, prev.ne(dec.pad())
    enc = model.encoder.dictionary
    src = torch.randint(enc.nspecial, len(enc), (bsz, src_len), generator=g)
    src[0, :3] = enc.pad()
    prev[:, 0] = dec.eos()
    return src, src.ne(enc.pad()).sum(1), prev, prev.ne(dec.pad())


def log_probs(model, batch) -> torch.Tensor:
    """The model's log-probabilities on ``batch`` (:func:`_random_batch`)."""
    src, lengths, prev, _ = batch
    with torch.no_grad():
        logits = model(prev)[0] if src is None else model(src, lengths, prev)[0]
        return torch.log_softmax(logits.to(torch.float64), -1)


def compare(plugin_model, stock_model, tolerance: float) -> float:
    """The largest |log-prob difference| of the two models on one random padded batch (refused above ``tolerance``
    or where a value is not finite: :func:`.scoring.compare_log_probs`), after checking that fairseq built its
    own class."""
    from fairseq.models.transformer import TransformerModel
    from fairseq.models.transformer_lm import TransformerLanguageModel

    want = TransformerLanguageModel if getattr(plugin_model, "encoder", None) is None else TransformerModel
    if type(stock_model) is not want:
        raise ExportError(
            f"the exported model was built as {type(stock_model).__name__}, not fairseq's {want.__name__}"
        )
    stock_model.eval()
    batch = _random_batch(plugin_model)
    mask = batch[3]
    return compare_log_probs(
        [log_probs(plugin_model, batch)[mask]], [log_probs(stock_model, batch)[mask]], tolerance, "the exported model"
    )


def build_stock(model_args, plugin_model, sd: dict):
    """fairseq's own model of ``model_args`` (a dict or DictConfig) holding ``sd`` (strict), in float64."""
    from fairseq.models import build_model
    from omegaconf import DictConfig, OmegaConf

    cfg = model_args if isinstance(model_args, DictConfig) else OmegaConf.create(model_args)
    dec = plugin_model.decoder.dictionary
    enc = dec if getattr(plugin_model, "encoder", None) is None else plugin_model.encoder.dictionary
    task = SimpleNamespace(source_dictionary=enc, target_dictionary=dec)
    stock = build_model(cfg, task, from_checkpoint=True).to(torch.float64)
    stock.load_state_dict(sd, strict=True, model_cfg=cfg)
    return stock


def check_stock_file(path: str, plugin_model, tolerance: float) -> float:
    """Reload the written ``path`` as stock fairseq does and compare it with ``plugin_model`` (float64).

    Refuses a file that pickles anything besides tensors and plain containers (stock fairseq could not load
    it under torch >= 2.6 without the plugin), a model that fairseq builds as anything but its own class, and
    log-probabilities further than ``tolerance`` apart. Returns the largest difference.
    """
    from fairseq import checkpoint_utils

    unsafe = pickled_globals(path)
    if unsafe:
        raise ExportError(f"the exported checkpoint pickles {', '.join(unsafe)}; stock fairseq could not load it")
    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    return compare(plugin_model, build_stock(state["cfg"]["model"], plugin_model, state["model"]), tolerance)


def write_stock(state: dict, src: str, dst_tmp: str, plain_sd: dict, args, changes: dict, route: str) -> None:
    """Write the stock checkpoint of ``plain_sd`` to ``dst_tmp`` (:func:`stock_checkpoint`)."""
    torch.save(stock_checkpoint(state, src, plain_sd, stock_args(args, changes), changes, route), dst_tmp)


__all__ = [
    "build_stock",
    "check_stock_file",
    "compare",
    "export_lm_args",
    "stock_args",
    "stock_checkpoint",
    "write_stock",
]
