"""Fold Admin's omega into a plain Post-LN ``transformer`` checkpoint (Liu et al. 2020, appendix C).

``deepinit-export-admin ADMIN.pt OUT.pt`` (or ``python -m fairseq_deepinit.admin.export``) writes a
checkpoint of fairseq's own ``transformer`` that stock ``fairseq-generate`` loads without
``--user-dir`` and that computes the same function (the fold: :mod:`.fold`). The derivation, per stack, for sub-layers
k = 1..K in forward order, with LN_k the norm after sub-layer k (gamma_k, beta_k)::

    Admin:     x_k  = LN_k(x_{k-1} * w_k + f_k(x_{k-1}))
    exported:  x'_k = LN'_k(x'_{k-1} + f'_k(x'_{k-1}))       with x'_{k-1} = x_{k-1} * w_k

- f'_k(y) = f_k(y / w_k): the sub-layer's input projections take 1/w_k on their input columns
  (FFN: fc1; self-attention: q, k, v; cross-attention: q only, its keys and values read the encoder
  output, which stays unscaled);
- LN'_{k-1} = w_k * LN_{k-1}: gamma_{k-1} and beta_{k-1} times w_k, so that its output is already
  the next sub-layer's scaled input; the last norm of each stack is unchanged (the encoder output
  feeds the cross-attention keys/values, the decoder output the output projection);
- the first sub-layer's input is the embedding, x_0 = embed_scale * E[token] + P[position] (then
  dropout, which commutes with the scaling). x_0 * w_1 is ``layernorm_embedding`` scaled by w_1 when
  the model has one; otherwise E's columns and the position table are scaled by w_1: sinusoidal
  positions become a learned table (sinusoid * w_1, ``--*-learned-pos``), since a fixed sinusoid
  cannot carry a per-dimension scale. When the decoder's output projection is tied to its scaled
  embedding, the decoder's last norm is divided by w_1 (logits = E (w_1 * x / w_1)); when encoder
  and decoder shared one embedding but their w_1 differ, the export un-shares them. Nothing changes
  where w_1 = 1 exactly (the default start of the recurrence, kept when omega is frozen).

The fold is computed in float64 and written in float32. The exported checkpoint holds only
tensors and plain containers (no pickled ``argparse.Namespace``), so torch >= 2.6's
``weights_only`` loading accepts it without this plugin. Unless ``--no-check``, both models are
built and run on a random batch, and the export fails if their log-probabilities differ by more than
``--tolerance``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import sys
from types import SimpleNamespace
from typing import Callable, List

import torch
from fairseq.models import build_model
from omegaconf import OmegaConf

from .. import errors, model_config, options
from ..checkpoints import config_check
from ..checkpoints.integrity import torch_load_checked
from ..errors import AdminExportError
from ..model import DeepInitTransformerModel
from .fold import _primitive, check_exportable, export_args, fold_state_dict

__all__ = ["check_exportable", "export_args", "export_checkpoint", "fold_state_dict", "main", "verify"]

logger = logging.getLogger(__name__)


def _load(path: str) -> dict:
    # the package import allow-listed fairseq's Namespace (checkpoints.compat); a damaged file is a
    # one-line error, exit 1
    return torch_load_checked(path, map_location="cpu")


def check_destination(src: str, dst: str) -> None:
    """Refuse, before the checkpoint is read, an output the export cannot or must not write.

    The output must not be the input (the export would replace the training checkpoint), nor a
    folder, nor under a path whose existing part is a file. A missing parent folder is created when
    the export is written (:func:`save_export`), as fairseq-train creates its ``--save-dir``.
    """
    if os.path.realpath(dst) == os.path.realpath(src) or (
        os.path.exists(dst) and os.path.exists(src) and os.path.samefile(dst, src)
    ):
        raise AdminExportError(
            f"the output {dst} is the input checkpoint; the export would replace it. Give another file name, e.g. "
            f"{os.path.splitext(dst)[0]}.exported.pt"
        )
    if os.path.isdir(dst):
        raise AdminExportError(
            f"the output {dst} is a folder; give the exported checkpoint's file name, e.g. "
            f"{os.path.join(dst, 'checkpoint.exported.pt')}"
        )
    existing = os.path.dirname(os.path.abspath(dst))
    while not os.path.exists(existing):  # the deepest folder that exists (the root always does)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise AdminExportError(f"the output {dst} cannot be written: {existing} is a file, not a folder")


def save_export(state: dict, dst: str) -> None:
    """``torch.save`` to a temporary file beside ``dst``, then a rename: ``dst`` is either what it was
    or the whole export, and a failed write (disk full, no permission) is an :class:`AdminExportError`."""
    folder = os.path.dirname(os.path.abspath(dst))
    tmp = os.path.join(folder, f".{os.path.basename(dst)}.{os.getpid()}.tmp")
    try:
        os.makedirs(folder, exist_ok=True)
        torch.save(state, tmp)
        os.replace(tmp, dst)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise AdminExportError(f"cannot write {dst}: {errors.one_line(e)}") from e


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


def _model_args(state: dict):
    cfg = state.get("cfg") or {}
    args = cfg.get("model") if isinstance(cfg, dict) else None
    if isinstance(args, dict) and args.get("_name"):  # fairseq-hydra-train's YAML node
        args = _hydra_model_args(args)
    if not isinstance(args, argparse.Namespace):
        args = state.get("args")
    if not isinstance(args, argparse.Namespace):
        raise AdminExportError("the checkpoint has no model arguments of the deepinit model (was it written by it?)")
    return args


def check_profiled(state: dict, src: str, stack: str) -> None:
    """An Admin checkpoint whose first ``stack`` layer was never profiled is not a trained Admin model."""
    flag = state["model"].get(f"{stack}.layers.0.residuals.self_attn.profiled")
    if flag is not None and not bool(flag):
        raise AdminExportError(f"{src}: omega was never profiled; this is not a trained Admin model")


def stock_checkpoint(
    state: dict, src: str, model_sd: dict, model_args: dict, changes: dict, task: str, criterion: tuple | None = None
) -> dict:
    """The exported checkpoint: ``state``'s config with ``model_args``, fairseq's ``task``, no user dir.

    The optimizer state is dropped (only the last history entry's metadata is kept); ``criterion``,
    ``(cfg dict, class name)``, replaces the training criterion (a plugin criterion stock fairseq lacks).
    """
    cfg = _primitive(state.get("cfg") or {})
    cfg["model"] = model_args
    if isinstance(cfg.get("task"), dict):
        cfg["task"]["_name"] = task
    if isinstance(cfg.get("common"), dict):
        cfg["common"]["user_dir"] = None
    history = state.get("optimizer_history") or [{}]
    last = {k: v for k, v in history[-1].items() if k != "optimizer"}
    last = _primitive(last) | {"num_updates": int(last.get("num_updates", 0) or 0)}
    if criterion is not None:
        if isinstance(cfg.get("criterion"), dict):
            cfg["criterion"] = criterion[0]
        last["criterion_name"] = criterion[1]
    return {
        "args": None,
        "cfg": cfg,
        "model": model_sd,
        "criterion": None,
        "optimizer_history": [last],
        "task_state": {},
        "extra_state": {"deepinit_export": {"source": src, "from": "admin", "changes": _primitive(changes)}},
    }


def export_checkpoint(src: str, dst: str, check: bool = True, tolerance: float = 1e-4) -> dict:
    """Fold ``src`` (an Admin checkpoint) into ``dst``; returns a summary (changes, check result)."""
    check_destination(src, dst)
    state = _load(src)
    args = copy.deepcopy(_model_args(state))
    if getattr(args, "encoder_layers", None) == 0:
        raise AdminExportError(f"{src} is a deepinit language model; use deepinit-export-admin-lm for it")
    check_exportable(args)
    check_profiled(state, src, "encoder")
    model_sd, changes = fold_state_dict(state["model"], args)
    model_args = export_args(args, changes)
    out = stock_checkpoint(state, src, model_sd, model_args, changes, "translation")
    summary = {"changes": changes}
    if check:
        summary["max_abs_diff"] = verify(state["model"], args, model_sd, model_args, tolerance)
    save_export(out, dst)
    return summary


def _dictionary(size: int):
    from fairseq.data import Dictionary

    d = Dictionary()
    i = 0
    while len(d) < size:
        d.add_symbol(f"w{i}")
        i += 1
    return d


def verify(admin_sd, admin_args, plain_sd, plain_args: dict, tolerance: float, seed: int = 0) -> float:
    """Build both models, run them on one random batch (with padding), compare log-probabilities."""
    src_dict = _dictionary(admin_sd["encoder.embed_tokens.weight"].size(0))
    tgt_dict = (
        src_dict if admin_args.share_all_embeddings else _dictionary(admin_sd["decoder.embed_tokens.weight"].size(0))
    )
    task = SimpleNamespace(source_dictionary=src_dict, target_dictionary=tgt_dict)
    a_args = copy.deepcopy(admin_args)
    a_args.task = None  # no profiling-task checks: this model is only evaluated
    # in float64 before loading, so that a float64 state dict is compared without rounding
    admin_model = DeepInitTransformerModel.build_model(a_args, task).double()
    admin_model.load_state_dict(admin_sd, strict=True, model_cfg=a_args)
    plain_model = build_model(OmegaConf.create(plain_args), task).double()
    plain_model.load_state_dict(plain_sd, strict=True)
    if type(plain_model).__module__.startswith("fairseq_deepinit"):
        raise AdminExportError("the exported model was built by the plugin, not by stock fairseq")

    g = torch.Generator().manual_seed(seed)
    bsz, src_len, tgt_len = 4, 9, 7
    src = torch.randint(4, len(src_dict), (bsz, src_len), generator=g)
    src[0, :3] = src_dict.pad()  # left padding, as fairseq's translation batches
    prev = torch.randint(4, len(tgt_dict), (bsz, tgt_len), generator=g)
    prev[1, -2:] = tgt_dict.pad()
    prev[:, 0] = tgt_dict.eos()
    lengths = src.ne(src_dict.pad()).sum(1)
    outs = []
    for m in (admin_model, plain_model):
        m.eval()
        with torch.no_grad():
            logits, _ = m(src, lengths, prev)
            outs.append(torch.log_softmax(logits, -1))
    diff = (outs[0] - outs[1]).abs()
    diff = diff[prev.ne(tgt_dict.pad())].max().item()
    if not diff <= tolerance:
        raise AdminExportError(f"the exported model's log-probabilities differ by {diff:.3g} > {tolerance}")
    return diff


def export_parser(prog: str, description: str, checkpoint_help: str, output_help: str) -> argparse.ArgumentParser:
    """The command line every Admin export tool shares: CHECKPOINT OUTPUT [--no-check] [--tolerance]."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("checkpoint", help=checkpoint_help)
    parser.add_argument("output", help=output_help)
    parser.add_argument(
        "--no-check", action="store_true", help="skip building both models and comparing outputs (default: compare)"
    )
    parser.add_argument(
        "--tolerance", type=float, default=1e-4, help="largest allowed |log-prob difference| (default: %(default)s)"
    )
    return parser


def run_export(
    parser: argparse.ArgumentParser, export: Callable[..., dict], stock_arch: str, argv: List[str] | None
) -> int:
    """Parse ``argv``, run ``export(checkpoint, output, check=, tolerance=)``, log its summary.

    A bad checkpoint, output or option is one line on stderr (``PROG: error: ...``) and exit status 1:
    every plugin error (:func:`fairseq_deepinit.errors.is_plugin_error`) and a missing input file.
    """
    a = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO)
    try:
        summary = export(a.checkpoint, a.output, check=not a.no_check, tolerance=a.tolerance)
    except Exception as e:
        if not (errors.is_plugin_error(e) or isinstance(e, FileNotFoundError)):
            raise
        message = getattr(e, "message", None) or errors.one_line(e)
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 1
    changes = ", ".join(f"{k}={v}" for k, v in summary["changes"].items()) or "none"
    check = (
        f"max |log-prob difference| on a random batch {summary['max_abs_diff']:.2e}"
        if "max_abs_diff" in summary
        else "not checked"
    )
    logger.info(f"wrote {a.output}: arch {stock_arch}, argument changes: {changes}; {check}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``deepinit-export-admin``."""
    return export_parser(
        "deepinit-export-admin",
        "Fold Admin's omega into a plain Post-LN fairseq 'transformer' checkpoint (Liu et al. 2020, "
        "appendix C) that stock fairseq-generate loads without --user-dir.",
        "an Admin checkpoint written by fairseq-train (--arch admin_*)",
        "where to write the plain transformer checkpoint",
    )


def main(argv: List[str] | None = None) -> int:
    return run_export(build_parser(), export_checkpoint, "transformer", argv)


if __name__ == "__main__":
    sys.exit(main())
