"""A resumed ``deepinit`` run must build the model its checkpoint holds.

Before any state is loaded, the options that define the model (:data:`CHECKED_OPTIONS`, with the
``auto`` values resolved as the model build resolves them) are compared with the checkpoint's; a
difference stops the run with :class:`~fairseq_deepinit.errors.ConfigChangeError` listing them,
unless ``--allow-config-change`` (or a fine-tuning reset flag) says it is on purpose.

:data:`CHECKED_OPTIONS` is fairseq's options that shape the model (:data:`FAIRSEQ_MODEL_OPTIONS`) plus
every option of every method record that a resumed run must keep (``Option.resume``,
:func:`fairseq_deepinit.options.all_options`): a method's new option is checked without being listed here.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
from typing import Any, List, Tuple

from omegaconf import OmegaConf

from .. import model_config, options
from ..errors import ConfigChangeError
from . import numpy_data
from .integrity import CheckpointStatus

logger = logging.getLogger(__name__)

ALLOW_FLAG = "--allow-config-change"

# fairseq's model options whose change on resume gives a different model
FAIRSEQ_MODEL_OPTIONS: Tuple[str, ...] = (
    "arch",
    "encoder_normalize_before",
    "decoder_normalize_before",
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
)
# ... and every method option a resumed run must keep (checked for the deepinit models)
CHECKED_OPTIONS: Tuple[str, ...] = FAIRSEQ_MODEL_OPTIONS + tuple(o.name for o, _m in options.all_options() if o.resume)


def add_args(parser: argparse.ArgumentParser) -> None:
    """``--allow-config-change``; called from the ``deepinit`` model's ``add_args``."""
    parser.add_argument(
        ALLOW_FLAG,
        action="store_true",
        help="resume a checkpoint whose model options (arch, init scheme, norms, residual scale, layers, dims, "
        "decoder layer type) differ from this command's: log the differences and continue instead of stopping",
    )


# the plugin's models: translation (fairseq_deepinit.model) and language model (fairseq_deepinit.lm.model)
TRANSLATION_MODEL = "deepinit"
LM_MODEL = "deepinit_lm"
DEEPINIT_MODELS = (TRANSLATION_MODEL, LM_MODEL)


def _is_deepinit(args: argparse.Namespace | None) -> bool:
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    return args is not None and ARCH_MODEL_NAME_REGISTRY.get(getattr(args, "arch", None)) in DEEPINIT_MODELS


def _resolved(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the deepinit ``auto`` values resolved as the model build resolves them (a copy): the
    placement as the stacks have it, so that a checkpoint whose family gave fairseq's normalize-before flags
    and a run whose family gives ``--norm-placement pre`` compare equal."""

    out = copy.copy(args)
    if _is_deepinit(out):
        with contextlib.suppress(Exception):  # an invalid stored combination: compare as stored
            placements = {stack.placement for stack in options.resolve_and_validate(out).stacks}
            if len(placements) == 1:  # --norm-placement auto and the flags it reads compare as the placement given
                out.norm_placement = placements.pop()
    return out


def _namespace(args: Any) -> argparse.Namespace | None:
    """fairseq-train's model Namespace as it is; fairseq-hydra-train's model config (the trainer's ``DictConfig``,
    the dict its checkpoints store) of a deepinit model as the Namespace fairseq-train would have built."""
    if args is None or isinstance(args, argparse.Namespace):
        return args
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    if not (isinstance(args, dict) or OmegaConf.is_config(args)) or (
        ARCH_MODEL_NAME_REGISTRY.get(args.get("_name")) not in DEEPINIT_MODELS
    ):
        return None
    return model_config.as_namespace(args)


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
        a, b = getattr(saved, name, None), getattr(current, name, None)
        if _norm(a) != _norm(b):
            diffs.append((name, a, b))
    return diffs


def _shown(value: Any) -> str:
    """An option's value as the message prints it: an option not given (None) is "unset", not False."""
    return "unset" if value is None else str(value)


def _fmt_diffs(diffs: List[Tuple[str, Any, Any]]) -> str:
    return ", ".join(f"--{n.replace('_', '-')} {_shown(a)} -> {_shown(b)}" for n, a, b in diffs)


def check_parameters_fit(path: str, model: Any) -> None:
    """After ``--allow-config-change``: stop (:class:`ConfigChangeError`) if the checkpoint's weights cannot
    fill the new model (a parameter added, removed or of another shape), before fairseq's ``load_state_dict``
    fails with "Cannot load model parameters from checkpoint ...; please ensure that the architectures match".

    The saved tensors are memory-mapped, not read, and go through the model's own state-dict upgrade first
    (what fairseq's loader does), so only a real mismatch is refused; if that cannot be done, fairseq decides.
    """
    try:
        saved = dict(numpy_data.load(path, map_location="cpu", mmap=True, weights_only=True)["model"])
        model.upgrade_state_dict(saved)
        wanted = model.state_dict()
    except Exception:  # an unusual file or model: fairseq's own loader reports it
        return
    missing = [k for k in wanted if k not in saved]
    unexpected = [k for k in saved if k not in wanted]
    shapes = [
        f"{k} {list(saved[k].shape)} -> {list(wanted[k].shape)}"
        for k in wanted
        if k in saved and saved[k].shape != wanted[k].shape
    ]
    if not (missing or unexpected or shapes):
        return
    found = (("new", missing), ("gone", unexpected), ("reshaped", shapes))
    parts = [f"{what}: {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}" for what, items in found if items]
    raise ConfigChangeError(
        f"{ALLOW_FLAG} cannot continue from {path}: the new options change the model's parameters "
        f"({'; '.join(parts)}), which the checkpoint cannot fill. Resume with the checkpoint's options, or start a "
        "new run in another --save-dir"
    )


def check_config(status: CheckpointStatus, current: Any, fine_tuning: bool) -> bool:
    """Stop (:class:`ConfigChangeError`) if ``current`` (a deepinit model's args) differs from the checkpoint's.

    With ``--allow-config-change``, or when ``fine_tuning`` (any ``--reset-*`` flag: the run starts
    anew from the weights), the differences are logged as a warning instead, and True is returned (then
    :func:`check_parameters_fit` decides whether the weights still fit).
    """
    saved, current = _namespace(status.model_args), _namespace(current)
    if current is None or not _is_deepinit(current) or saved is None:
        return False
    diffs = config_differences(saved, current)
    if not diffs:
        return False
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
    return True
