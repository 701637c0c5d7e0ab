"""Command-line options of the ``deepinit`` models and their start-up validation, from the method records.

Every option is declared once, by its method's record (:mod:`fairseq_deepinit.methods`; the options no
method owns by :mod:`fairseq_deepinit.methods.core`): this module adds them to fairseq's parser
(:func:`add_model_args`), resolves and validates them (:func:`resolve_and_validate`), describes the
resolved model (:func:`describe`) and lists them for the resume check and for generated configs
(:func:`all_options`, :func:`option_table`).

Every incompatible combination stops before the model is built, with a message that says what to
change; nothing is silently overridden. ``auto`` values are resolved from the init scheme's needs
(for example ``--norm-type auto`` is ``none`` under T-Fixup and ``layernorm`` otherwise) and the
resolved values are what the checkpoint stores. An option owned by a selector value (``--ds-init-alpha``
by ``--init-scheme ds-init``) gets its default under that value and is stored as None under any other,
so that re-validating the arguments stored in a checkpoint (generate, resume) gives the same answer.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F

from .errors import DeepInitConfigError
from .methods import INIT_SCHEMES, LAYER_TYPES, METHODS, RESIDUAL_SCALES, method_options
from .methods.record import Method, Option, flag, has_encoder
from .modules.norms import POINTWISE_NORMS

logger = logging.getLogger(__name__)

__all__ = [
    "ARCH_BOOL_FLAGS",
    "add_model_args",
    "all_options",
    "describe",
    "has_encoder",
    "option_table",
    "resolve_and_validate",
]

# fairseq store_true flags that named architectures set: their default becomes None so that an
# architecture can tell "not given" from "given" (fairseq's own t2t arch cannot, see README)
ARCH_BOOL_FLAGS = ("encoder_normalize_before", "decoder_normalize_before", "share_decoder_input_output_embed")


def all_options() -> List[Tuple[Option, Method]]:
    """Every option of the model, in method order, with the selectors' choices filled in from the records."""
    out = []
    for option, method in method_options().values():
        if option.name == "init_scheme":
            names = ", ".join(option.choices)
            option = dataclasses.replace(option, help=option.help.replace("scheme (", f"scheme; one of: {names} ("))
        out.append((option, method))
    return out


def option_table() -> List[Dict[str, Any]]:
    """One row per option, enough to generate a config dataclass: name, type, default, help, choices, the
    flag of a bool option's ``store_false`` twin, the owning ``(selector, value)`` (None: the option
    applies to every configuration; an owned option is None under other values), the method, and whether
    a resumed run must keep it."""
    return [
        {
            "name": o.name,
            "type": o.type,
            "default": o.default,
            "help": o.help,
            "choices": o.choices,
            "negative": o.negative,
            "owner": m.owner,
            "method": m.name,
            "resume": o.resume,
        }
        for o, m in all_options()
    ]


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(**{name: None for name in ARCH_BOOL_FLAGS})
    g = parser.add_argument_group("deepinit: normalisation, residual scaling and initialisation")
    for option, _method in all_options():
        option.add_to(g)


def _resolve_owned(args, selector: str) -> None:
    """Give the options owned by a value of ``selector`` their default under that value, refuse them
    (given) under another, store None otherwise; then check the values they got."""
    chosen = getattr(args, selector)
    for method in METHODS.values():
        if method.owner is None or method.owner[0] != selector:
            continue
        owner = method.owner[1]
        for option in method.options:
            value = getattr(args, option.name, None)
            if chosen == owner:
                setattr(args, option.name, option.default if value is None else value)
            elif value is not None and value is not False:
                raise DeepInitConfigError(
                    f"{option.flag} only applies to {flag(selector)} {owner}, not {chosen}; "
                    f"drop it or use {flag(selector)} {owner}"
                )
            else:
                setattr(args, option.name, None)
        if chosen == owner:
            _check_values(args, method)


def _check_values(args, method: Method) -> None:
    for option in method.options:
        value = getattr(args, option.name)
        problem = None if value is None else option.problem(value)
        if problem:
            raise method.error(problem)


def _unknown(selector: str, value, known) -> DeepInitConfigError:
    return DeepInitConfigError(f"unknown {flag(selector)} {value!r}; choose from {', '.join(sorted(known))}")


def resolve_and_validate(args) -> None:
    """Resolve ``auto`` values and the options' defaults in place and reject incompatible combinations."""
    eps_given = getattr(args, "norm_eps", None) is not None  # before the defaults fill it in
    core = METHODS["core"]
    for option in core.options:
        if getattr(args, option.name, None) is None:
            setattr(args, option.name, option.default)
    for name in ARCH_BOOL_FLAGS:
        setattr(args, name, bool(getattr(args, name, False)))
    _resolve_norm_placement(args)
    scheme = INIT_SCHEMES.get(args.init_scheme)
    if scheme is None:
        raise _unknown("init_scheme", args.init_scheme, INIT_SCHEMES)
    _resolve_owned(args, "init_scheme")
    for option in (core_option("norm_eps"), core_option("norm_type")):
        problem = option.problem(getattr(args, option.name))
        if problem:
            raise DeepInitConfigError(problem)

    # norm type
    if args.norm_type == "auto":
        args.norm_type = scheme.default_norm
    elif args.norm_type not in scheme.allowed_norms and not args.force_norm_with_scheme:
        allowed = " or ".join(scheme.allowed_norms)
        raise DeepInitConfigError(
            f"--init-scheme {scheme.name} needs --norm-type {allowed} ({scheme.norm_reason}); got "
            f"--norm-type {args.norm_type}. Drop --norm-type, or add --force-norm-with-scheme for an ablation."
        )
    if args.norm_type in POINTWISE_NORMS:
        # nothing is divided: an eps would be stored and never used (stored as None, so that stored args resolve again)
        if eps_given:
            raise DeepInitConfigError(
                f"--norm-eps does not apply to --norm-type {args.norm_type} (a point-wise function, no statistics, "
                "nothing divided by); drop --norm-eps"
            )
        args.norm_eps = None
    _resolve_owned(args, "norm_type")

    # residual scaling
    if args.residual_scale == "auto":
        args.residual_scale = scheme.residual
    elif scheme.residual != "none" and args.residual_scale != scheme.residual:
        raise DeepInitConfigError(
            f"--init-scheme {scheme.name} needs --residual-scale {scheme.residual}; got {args.residual_scale}. "
            f"Drop --residual-scale or set it to {scheme.residual}."
        )
    residual = RESIDUAL_SCALES.get(args.residual_scale)
    if residual is None:
        raise _unknown("residual_scale", args.residual_scale, RESIDUAL_SCALES)
    if (scheme.placement == "post" or residual.placement == "post") and (
        args.encoder_normalize_before or args.decoder_normalize_before
    ):
        what = f"--init-scheme {scheme.name}" if scheme.placement == "post" else f"--residual-scale {residual.name}"
        remove = "--encoder-normalize-before / --decoder-normalize-before"
        if args.norm_placement != "auto":
            remove = f"--norm-placement {args.norm_placement} (or give --norm-placement post)"
        raise DeepInitConfigError(f"{what} is defined for Post-LN only; remove {remove}")
    if args.norm_type == "none" and (args.encoder_normalize_before or args.decoder_normalize_before):
        # without a norm, Pre-LN and Post-LN compute the same x + f(x): the flag is harmless but does nothing
        logger.warning(
            "--encoder/--decoder-normalize-before have no effect with --norm-type none (no norm to place); "
            "the model is the same as without them"
        )

    if args.decoder_layer_type not in LAYER_TYPES:
        raise _unknown("decoder_layer_type", args.decoder_layer_type, LAYER_TYPES)
    _resolve_owned(args, "decoder_layer_type")
    _resolve_owned(args, "residual_scale")
    _validate_attention_impl(args)

    # features: their defaults reproduce the model without them (older checkpoints lack the options)
    for method in METHODS.values():
        if method.owner is None and method.name != "core":
            for option in method.options:
                if getattr(args, option.name, None) is None:
                    setattr(args, option.name, option.default)
            _check_values(args, method)
    for method in METHODS.values():
        if method.validate is not None and method.selected(args):
            method.validate(args)

    if getattr(args, "layernorm_embedding", False) and args.norm_type == "none":
        raise DeepInitConfigError(
            "--layernorm-embedding asks for an embedding norm but --norm-type is none; drop one of them"
        )


def _resolve_norm_placement(args) -> None:
    """``--norm-placement`` and fairseq's ``--encoder-/--decoder-normalize-before``: ``auto`` keeps the
    flags (a placement per stack); ``post`` refuses them; ``pre``, ``peri`` and ``reordered`` set both, so
    that fairseq builds each stack's final norm (``transformer_encoder.py:100-103``,
    ``transformer_decoder.py:126-129``), which all three keep (OLMo-core ``lm_head.py:230``)."""
    placement = getattr(args, "norm_placement", None) or "auto"
    option = method_options()["norm_placement"][0]
    problem = option.problem(placement)
    if problem:
        raise DeepInitConfigError(problem)
    args.norm_placement = placement
    if placement == "post" and (args.encoder_normalize_before or args.decoder_normalize_before):
        raise DeepInitConfigError(
            "--norm-placement post contradicts --encoder-/--decoder-normalize-before (given, or set by the "
            "--arch); drop one of them"
        )
    if placement not in ("auto", "post"):
        args.encoder_normalize_before = args.decoder_normalize_before = True


def _stack_placement(args, stack: str) -> str:
    if getattr(args, "norm_placement", None) not in (None, "auto"):
        return args.norm_placement
    return "pre" if getattr(args, f"{stack}_normalize_before") else "post"


def core_option(name: str) -> Option:
    return next(o for o in METHODS["core"].options if o.name == name)


def _validate_attention_impl(args) -> None:
    """``--attention-impl``: a known one, and refused where the fused path cannot serve."""
    impl = args.attention_impl
    problem = core_option("attention_impl").problem(impl)
    if problem:
        raise DeepInitConfigError(problem)
    if impl != "sdpa":
        return
    if not hasattr(F, "scaled_dot_product_attention"):
        raise DeepInitConfigError(
            f"--attention-impl sdpa needs torch >= 2.0 (found {torch.__version__}); use --attention-impl fairseq"
        )
    for name in ("encoder_xformers_att_config", "decoder_xformers_att_config"):
        if getattr(args, name, None):
            raise DeepInitConfigError(
                f"--{name.replace('_', '-')} selects xFormers attention and --attention-impl sdpa selects PyTorch's "
                "fused kernel; use one of them"
            )


def describe(args) -> str:
    """The model's log line: the resolved axes, then each selected method's own part."""
    parts = [
        f"init={args.init_scheme}",
        f"norm={args.norm_type}",
        *([f"encoder={_stack_placement(args, 'encoder')}-norm"] if has_encoder(args) else []),
        f"decoder={_stack_placement(args, 'decoder')}-norm",
        f"residual={args.residual_scale}",
        f"decoder-layer={args.decoder_layer_type}",
    ]
    for method in METHODS.values():
        if method.describe is not None and method.selected(args):
            part = method.describe(args)
            if part:
                parts.append(part)
    return "deepinit: " + ", ".join(parts)
