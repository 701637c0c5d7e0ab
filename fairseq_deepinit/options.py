"""Command-line options of the ``deepinit`` model and their start-up validation.

Every incompatible combination stops before the model is built, with a message that says what to
change; nothing is silently overridden. ``auto`` values are resolved from the init scheme's needs
(for example ``--norm-type auto`` is ``none`` under T-Fixup and ``layernorm`` otherwise) and the
resolved values are what the checkpoint stores.
"""

from __future__ import annotations

import argparse
import logging
import math

from .errors import DeepInitConfigError
from .modules import attention
from .modules.layers import DECODER_LAYER_TYPES
from .modules.norms import NORM_TYPES
from .modules.residual import RESIDUAL_BUILDERS
from .schemes import SCHEMES

logger = logging.getLogger(__name__)


# fairseq store_true flags that named architectures set: their default becomes None so that an
# architecture can tell "not given" from "given" (fairseq's own t2t arch cannot, see README)
ARCH_BOOL_FLAGS = ("encoder_normalize_before", "decoder_normalize_before", "share_decoder_input_output_embed")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(**{name: None for name in ARCH_BOOL_FLAGS})
    g = parser.add_argument_group("deepinit: normalisation, residual scaling and initialisation")
    g.add_argument(
        "--init-scheme",
        choices=sorted(SCHEMES),
        metavar="SCHEME",
        help="initialisation scheme; one of: " + ", ".join(sorted(SCHEMES)) + " (default: xavier, the "
        "fairseq 0.8/0.9 baseline the papers used)",
    )
    g.add_argument(
        "--norm-type",
        choices=("auto",) + NORM_TYPES,
        help="normalisation layer replacing every LayerNorm (auto: what the init scheme needs; "
        "layernorm unless the scheme removes norms)",
    )
    g.add_argument("--norm-eps", type=float, help="epsilon of the normalisation layers (default 1e-5)")
    g.add_argument(
        "--residual-scale",
        choices=("auto",) + tuple(sorted(RESIDUAL_BUILDERS)),
        help="residual-branch scaling (auto: what the init scheme needs, none otherwise)",
    )
    g.add_argument(
        "--fixnorm",
        action="store_true",
        default=None,
        help="FixNorm: unit-norm word embeddings and a tied output layer over them "
        "(needs --share-decoder-input-output-embed or --share-all-embeddings)",
    )
    g.add_argument(
        "--decoder-layer-type",
        choices=tuple(sorted(DECODER_LAYER_TYPES)),
        help="decoder layer implementation (default: standard)",
    )
    g.add_argument(
        "--lipschitz-bias-free",
        action="store_true",
        default=None,
        help="lipschitz: drop the biases of q/k/v/out projections and fc2 (released code)",
    )
    g.add_argument(
        "--ds-init-variant",
        choices=("paper", "code"),
        help="ds-init: 'paper' bound gamma*alpha/sqrt(l) (eq. 15, default) or the released "
        "code's gamma*sqrt(alpha)*l^(-1/4)",
    )
    g.add_argument("--ds-init-alpha", type=float, help="ds-init: alpha in [0, 1] (default 1.0)")
    g.add_argument(
        "--deepnorm-variant",
        choices=("paper", "torchscale"),
        help="deepnorm: the DeepNet paper's init (Table 1, Figure 2; default) or torchscale's released code "
        "(nn.Linear default init divided by (N^4 M)^(1/16)/1.15 and (12M)^(1/4), decoder-only (8M)^(1/4); "
        "docs/schemes.md)",
    )
    g.add_argument(
        "--force-norm-with-scheme",
        action="store_true",
        default=None,
        help="allow a --norm-type that the init scheme normally removes (e.g. LayerNorm "
        "under t-fixup); for ablations only",
    )
    for add_args, _validate, _describe in _LAYER_TYPE_HOOKS.values():
        add_args(g)
    for add_args, _validate, _describe in _RESIDUAL_HOOKS.values():
        add_args(g)
    for add_args, _validate, _describe in _FEATURE_HOOKS.values():
        add_args(g)
    attention.add_args(g)


# defaults of options that are not scheme-specific
_DEFAULTS = {
    "init_scheme": "xavier",
    "norm_type": "auto",
    "norm_eps": 1e-5,
    "residual_scale": "auto",
    "fixnorm": False,
    "decoder_layer_type": "standard",
    "force_norm_with_scheme": False,
}
# scheme-specific options: name -> (scheme it belongs to, default)
_SCHEME_OPTIONS = {
    "lipschitz_bias_free": ("lipschitz", False),
    "ds_init_variant": ("ds-init", "paper"),
    "ds_init_alpha": ("ds-init", 1.0),
    "deepnorm_variant": ("deepnorm", "paper"),
}
# decoder-layer-type-specific options, registered by the layer type's module: name -> (layer type,
# default), None under other layer types (as scheme options); and per layer type its
# (add_args(group), validate(args), describe(args) -> str) hooks
_LAYER_TYPE_OPTIONS: dict = {}
_LAYER_TYPE_HOOKS: dict = {}


def register_layer_type_options(layer_type: str, defaults: dict, add_args, validate, describe) -> None:
    """Options of one ``--decoder-layer-type``, added, resolved and validated with the others."""
    if layer_type in _LAYER_TYPE_HOOKS:
        raise ValueError(f"options of decoder layer type {layer_type!r} are already registered")
    _LAYER_TYPE_OPTIONS.update({name: (layer_type, default) for name, default in defaults.items()})
    _LAYER_TYPE_HOOKS[layer_type] = (add_args, validate, describe)


# residual-scale-specific options (Admin's --admin-*), registered by the residual's module in the same
# way: name -> (residual scale, default), None under other residual scales
_RESIDUAL_OPTIONS: dict = {}
_RESIDUAL_HOOKS: dict = {}


def register_residual_options(residual: str, defaults: dict, add_args, validate, describe) -> None:
    """Options of one ``--residual-scale``, added, resolved and validated with the others."""
    if residual in _RESIDUAL_HOOKS:
        raise ValueError(f"options of residual scale {residual!r} are already registered")
    _RESIDUAL_OPTIONS.update({name: (residual, default) for name, default in defaults.items()})
    _RESIDUAL_HOOKS[residual] = (add_args, validate, describe)


# options of features that any configuration may switch on (Sub-LN, NormFormer), registered by the
# feature's module: name -> default (the default reproduces the model without the feature, so older
# checkpoints, which lack the option, load unchanged); per feature its (add_args, validate, describe)
# hooks, validate called after every other option is resolved, describe returning "" when off
_FEATURE_OPTIONS: dict = {}
_FEATURE_HOOKS: dict = {}


def register_feature_options(feature: str, defaults: dict, add_args, validate, describe) -> None:
    """Options of one feature that is not owned by another option's value (e.g. ``--subln``)."""
    if feature in _FEATURE_HOOKS:
        raise ValueError(f"options of feature {feature!r} are already registered")
    _FEATURE_OPTIONS.update(defaults)
    _FEATURE_HOOKS[feature] = (add_args, validate, describe)


def check_norm_eps(eps: float) -> None:
    """``--norm-eps`` must be a finite number > 0.

    Every norm divides by ``sqrt(var + eps)`` (LayerNorm, RMSNorm) or ``sqrt(||x||^2 + eps^2)`` (ScaleNorm):
    eps <= 0 can divide by zero, ``inf`` turns every norm's output into 0 (a model that learns
    nothing, with no error), and ``nan`` makes every output NaN (fairseq only notices at the first
    update, with its generic non-finite gradient error).
    """
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise DeepInitConfigError(
            f"--norm-eps must be a finite number greater than 0 (default 1e-5), got {eps}; "
            "drop --norm-eps or give e.g. --norm-eps 1e-6"
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _resolve_owned_options(args, owned: dict, selector: str) -> None:
    """Give options owned by one value of ``selector`` their default, or refuse them under another value.

    ``owned`` maps option name -> (owning value of ``args.<selector>``, default). Under other values
    the option is stored as None, so that re-validating the resolved arguments stored in a checkpoint
    (generate, resume) gives the same answer.
    """
    chosen = getattr(args, selector)
    for name, (owner, default) in owned.items():
        value = getattr(args, name, None)
        if chosen == owner:
            setattr(args, name, default if value is None else value)
        elif value is not None and value is not False:
            raise DeepInitConfigError(
                f"{_flag(name)} only applies to {_flag(selector)} {owner}, not {chosen}; "
                f"drop it or use {_flag(selector)} {owner}"
            )
        else:
            setattr(args, name, None)


def resolve_and_validate(args) -> None:
    """Resolve ``auto`` values in place and reject incompatible combinations."""
    for name, default in _DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    for name in ARCH_BOOL_FLAGS:
        setattr(args, name, bool(getattr(args, name, False)))
    scheme = SCHEMES.get(args.init_scheme)
    if scheme is None:
        raise DeepInitConfigError(
            f"unknown --init-scheme {args.init_scheme!r}; choose from {', '.join(sorted(SCHEMES))}"
        )

    # scheme-specific options stay None under other schemes, so that re-validating the resolved
    # arguments stored in a checkpoint (generate, resume) gives the same answer
    _resolve_owned_options(args, _SCHEME_OPTIONS, "init_scheme")

    if args.init_scheme == "ds-init" and args.ds_init_variant not in ("paper", "code"):
        raise DeepInitConfigError(f"unknown --ds-init-variant {args.ds_init_variant!r}; choose from code, paper")
    if args.init_scheme == "ds-init" and not 0.0 <= args.ds_init_alpha <= 1.0:
        raise DeepInitConfigError(f"--ds-init-alpha must lie in [0, 1] (DS-Init eq. 15), got {args.ds_init_alpha}")
    if args.init_scheme == "deepnorm" and args.deepnorm_variant not in ("paper", "torchscale"):
        raise DeepInitConfigError(
            f"unknown --deepnorm-variant {args.deepnorm_variant!r}; choose from paper, torchscale"
        )
    check_norm_eps(args.norm_eps)

    # norm type
    if args.norm_type not in ("auto",) + NORM_TYPES:
        raise DeepInitConfigError(f"unknown --norm-type {args.norm_type!r}; choose from auto, {', '.join(NORM_TYPES)}")
    if args.norm_type == "auto":
        args.norm_type = scheme.default_norm
    elif args.norm_type not in scheme.allowed_norms and not args.force_norm_with_scheme:
        allowed = " or ".join(scheme.allowed_norms)
        raise DeepInitConfigError(
            f"--init-scheme {scheme.name} needs --norm-type {allowed} ({scheme.norm_reason}); got "
            f"--norm-type {args.norm_type}. Drop --norm-type, or add --force-norm-with-scheme for an ablation."
        )

    # residual scaling
    if args.residual_scale == "auto":
        args.residual_scale = scheme.residual
    elif scheme.residual != "none" and args.residual_scale != scheme.residual:
        raise DeepInitConfigError(
            f"--init-scheme {scheme.name} needs --residual-scale {scheme.residual}; got {args.residual_scale}. "
            f"Drop --residual-scale or set it to {scheme.residual}."
        )
    if args.residual_scale not in RESIDUAL_BUILDERS:
        raise DeepInitConfigError(
            f"unknown --residual-scale {args.residual_scale!r}; choose from {', '.join(sorted(RESIDUAL_BUILDERS))}"
        )
    needs_post = scheme.needs_post_ln or args.residual_scale in POST_LN_RESIDUALS
    if needs_post and (args.encoder_normalize_before or args.decoder_normalize_before):
        what = f"--init-scheme {scheme.name}" if scheme.needs_post_ln else f"--residual-scale {args.residual_scale}"
        raise DeepInitConfigError(
            f"{what} is defined for Post-LN only; remove --encoder-normalize-before / --decoder-normalize-before"
        )

    if args.norm_type == "none" and (args.encoder_normalize_before or args.decoder_normalize_before):
        # without a norm, Pre-LN and Post-LN compute the same x + f(x): the flag is harmless but does nothing
        logger.warning(
            "--encoder/--decoder-normalize-before have no effect with --norm-type none (no norm to place); "
            "the model is the same as without them"
        )

    if args.decoder_layer_type not in DECODER_LAYER_TYPES:
        raise DeepInitConfigError(
            f"unknown --decoder-layer-type {args.decoder_layer_type!r}; choose from "
            f"{', '.join(sorted(DECODER_LAYER_TYPES))}"
        )
    _resolve_owned_options(args, _LAYER_TYPE_OPTIONS, "decoder_layer_type")
    if args.decoder_layer_type in _LAYER_TYPE_HOOKS:
        _LAYER_TYPE_HOOKS[args.decoder_layer_type][1](args)

    _resolve_owned_options(args, _RESIDUAL_OPTIONS, "residual_scale")
    if args.residual_scale in _RESIDUAL_HOOKS:
        _RESIDUAL_HOOKS[args.residual_scale][1](args)
    attention.validate(args)
    for name, default in _FEATURE_OPTIONS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    for _add_args, validate, _describe in _FEATURE_HOOKS.values():
        validate(args)

    if args.fixnorm:
        if not (args.share_decoder_input_output_embed or getattr(args, "share_all_embeddings", False)):
            raise DeepInitConfigError(
                "--fixnorm scores outputs against the normalised input embeddings; add "
                "--share-decoder-input-output-embed (or --share-all-embeddings)"
            )
        if getattr(args, "adaptive_softmax_cutoff", None) or getattr(args, "adaptive_input", False):
            raise DeepInitConfigError("--fixnorm does not combine with adaptive input/softmax; drop one of them")
        if args.init_scheme == "t-fixup":
            # FixNorm divides every embedding row by its norm, which would silently undo T-Fixup's
            # (9N)^(-1/4) embedding scaling (Huang et al. 2020, sec. 3.2)
            raise DeepInitConfigError(
                "--fixnorm normalises the embeddings and would undo T-Fixup's embedding scaling; drop --fixnorm "
                "or use another --init-scheme"
            )
    if getattr(args, "layernorm_embedding", False) and args.norm_type == "none":
        raise DeepInitConfigError(
            "--layernorm-embedding asks for an embedding norm but --norm-type is none; drop one of them"
        )


# residual scalings whose definition is Post-LN (registered by their modules)
POST_LN_RESIDUALS: set = {"deepnorm"}


def has_encoder(args) -> bool:
    """False for a decoder-only model: the language model stores ``encoder_layers = 0`` (lm/model.py).

    For option checks only; the formulas read each layer's kind (modules/stacks.py).
    """
    return getattr(args, "encoder_layers", None) != 0


def describe(args) -> str:
    parts = [
        f"init={args.init_scheme}",
        f"norm={args.norm_type}",
        *([f"encoder={'pre' if args.encoder_normalize_before else 'post'}-norm"] if has_encoder(args) else []),
        f"decoder={'pre' if args.decoder_normalize_before else 'post'}-norm",
        f"residual={args.residual_scale}",
        f"decoder-layer={args.decoder_layer_type}",
    ]
    if args.fixnorm:
        parts.append("fixnorm")
    if args.init_scheme == "ds-init":
        parts.append(f"ds-init={args.ds_init_variant},alpha={args.ds_init_alpha}")
    if args.lipschitz_bias_free:
        parts.append("bias-free")
    if args.decoder_layer_type in _LAYER_TYPE_HOOKS:
        parts.append(_LAYER_TYPE_HOOKS[args.decoder_layer_type][2](args))
    if args.residual_scale in _RESIDUAL_HOOKS:
        parts.append(_RESIDUAL_HOOKS[args.residual_scale][2](args))
    if args.init_scheme == "deepnorm":
        parts.append(f"deepnorm-variant={args.deepnorm_variant}")
    parts += [d for d in (hooks[2](args) for hooks in _FEATURE_HOOKS.values()) if d]
    return "deepinit: " + ", ".join(parts)
