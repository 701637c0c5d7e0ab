"""What DyT (:mod:`.dyt`) and Derf (:mod:`.derf`), the point-wise norm types, share: their options (alpha per
norm position or a released preset, the bias, a learnable embedding scale) and the hooks that read them.
A helper of the two records, not a record itself.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict

import torch.nn as nn

from ..errors import DeepInitConfigError
from ..modules.dyt import RELEASED_ALPHA_INIT, AlphaInit, learnable_embed_scale
from .exporting import never
from .record import Option, Validate, flag

#: released per-position presets accepted by ``--<norm>-alpha-init`` (the modules' 0.5 is the plain number)
ALPHA_PRESETS = tuple(name for name in RELEASED_ALPHA_INIT if name not in ("dyt", "derf"))
#: the position of a norm that has none in the releases (embedding norm, Sub-LN / NormFormer inner norms)
OTHER_POSITION = "ffn"
EMBED_SCALES = ("auto", "fixed", "learnable")


def parse_alpha_init(text: str) -> AlphaInit:
    """``"0.5"`` (every position), ``"0.8,0.2,0.2"`` (attn, ffn, final) or a preset of :data:`ALPHA_PRESETS`.

    Raises ValueError for anything else, or a value that is not a finite number > 0.
    """
    if text in ALPHA_PRESETS:
        return RELEASED_ALPHA_INIT[text]
    values = [float(part) for part in str(text).split(",")]
    if len(values) not in (1, 3) or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(text)
    return AlphaInit(*(values * 3 if len(values) == 1 else values))


def uniform(alpha: AlphaInit) -> bool:
    return alpha.attn == alpha.ffn == alpha.final


def alpha_problem(name: str) -> Callable[[Any], str | None]:
    def check(text) -> str | None:
        try:
            parse_alpha_init(text)
        except ValueError:
            return (
                f"{flag(name)} {text!r}: give one number > 0 (every norm), three comma-separated numbers > 0 "
                f"(attn,ffn,final), or a released preset: {', '.join(ALPHA_PRESETS)}"
            )
        return None

    return check


def pointwise_options(norm: str, alpha_default: float, title: str) -> tuple:
    """The options every point-wise norm type has, named ``<norm>_*``."""
    return (
        Option(
            f"{norm}_alpha_init",
            str,
            str(alpha_default),
            f"{norm}: initial alpha of every {title} (default {alpha_default}, released), or attn,ffn,final per "
            "norm position (Pre-LN; the LLaMA code's), or a released preset: " + ", ".join(ALPHA_PRESETS),
            metavar="A|ATTN,FFN,FINAL|PRESET",
            check=alpha_problem(f"{norm}_alpha_init"),
        ),
        Option(
            f"{norm}_bias",
            bool,
            True,
            f"{norm}: a per-channel bias in every {title} (default, released)",
            negative=f"--no-{norm}-bias",
            negative_help=f"{norm}: no bias (the LLaMA variant, llama.py:32-46)",
        ),
        Option(
            f"{norm}_embed_scale",
            str,
            "auto",
            f"{norm}: fairseq's embedding scale sqrt(d) as a learnable scalar (learnable, the released language "
            "models) or a constant (fixed); auto: learnable for a decoder-only model, fixed for translation",
            choices=EMBED_SCALES,
        ),
    )


def embed_scale(norm: str) -> Callable[[Any, Dict[str, int]], Dict[str, Any]]:
    """``derive``: the ``auto`` embedding scale, fixed for translation, learnable for a decoder-only model."""

    def derive(p, layers: Dict[str, int]) -> Dict[str, Any]:
        if p[f"{norm}_embed_scale"] != "auto":
            return {}
        return {f"{norm}_embed_scale": "fixed" if layers["encoder"] else "learnable"}

    return derive


def validate_pointwise(norm: str) -> Validate:
    """``validate``: per-position alphas refused on a Post-LN stack."""

    def validate(p, spec) -> None:
        name = f"{norm}_alpha_init"
        post = any(s.placement == "post" for s in spec.stacks)
        if post and not uniform(parse_alpha_init(p[name])):
            raise DeepInitConfigError(
                f"{flag(name)} {p[name]} gives per-position alphas, which are the released Pre-LN "
                "positions (the norm before attention / before the FFN / the final norm); this model has a Post-LN "
                f"stack. Give one value (e.g. {flag(name)} 0.5) or add --encoder-normalize-before "
                "--decoder-normalize-before"
            )

    return validate


def pointwise_norm_args(norm: str, extra: Callable[[Any], Dict[str, Any]] | None = None):
    """``norm_args(p, position)``: the norm's alpha at ``position`` (None: :data:`OTHER_POSITION`), its bias."""

    def norm_args(p, position: str | None) -> Dict[str, Any]:
        alpha = parse_alpha_init(p[f"{norm}_alpha_init"])
        kwargs = {"alpha_init": alpha.at(position or OTHER_POSITION), "bias": bool(p[f"{norm}_bias"])}
        return {**kwargs, **(extra(p) if extra is not None else {})}

    return norm_args


def learnable_embed_scales(norm: str):
    """``post_init``: each stack's ``embed_scale`` (a float) made a learnable scalar of the same value."""

    def post_init(model: nn.Module, p, spec) -> None:
        if p[f"{norm}_embed_scale"] != "learnable":
            return
        for stack in (getattr(model, "encoder", None), getattr(model, "decoder", None)):
            if stack is not None and isinstance(getattr(stack, "embed_scale", None), float):
                stack.embed_scale = learnable_embed_scale(stack.embed_scale)

    return post_init


def describe_pointwise(norm: str, p) -> str:
    alpha, scale = p[f"{norm}_alpha_init"], p[f"{norm}_embed_scale"]
    bias = "" if p[f"{norm}_bias"] else ", no bias"
    return f"{norm} alpha-init={alpha}{bias}, embed-scale={scale}"


def pointwise_hooks(norm: str, extra: Callable[[Any], Dict[str, Any]] | None = None) -> Dict[str, Any]:
    """The record fields every point-wise norm type has (``Method(..., **pointwise_hooks("dyt"))``): the
    ``auto`` embedding scale derived, per-position alphas checked, the log line, each norm's arguments
    (``extra``: more of them, Derf's shift), the learnable embedding scale."""

    def describe(p) -> str:
        more = extra(p) if extra is not None else {}
        return describe_pointwise(norm, p) + "".join(f", {k.replace('_', '-')}={v}" for k, v in more.items())

    return dict(
        derive=embed_scale(norm),
        validate=validate_pointwise(norm),
        describe=describe,
        norm_args=pointwise_norm_args(norm, extra),
        post_init=learnable_embed_scales(norm),
        export=never(f"--norm-type {norm} is a point-wise tanh/erf in each norm's place, which neither target has"),
    )
