"""DyT, Dynamic Tanh (Zhu, Chen, He, LeCun, Liu 2025, "Transformers without Normalization", eq. 1):
``--norm-type dyt``, every norm of the model replaced by ``weight * tanh(alpha x) + bias``.

The block is :class:`~fairseq_deepinit.modules.dyt.DyT` (jiachenzhu/DyT @ aab5dde ``dynamic_tanh.py:6-23``:
one learnable scalar ``alpha``, initialised 0.5; per-channel ``weight`` ones and ``bias`` zeros); the norm
type is built wherever ``--norm-type`` builds a norm: the sub-layer norms in fairseq's slots, the stacks'
final Pre-LN norms, ``--layernorm-embedding``, Sub-LN's and NormFormer's extra norms, MAtt's norm.

Options (owned by ``--norm-type dyt``; :mod:`.derf` has the same ones for ``--norm-type derf``):

- ``--dyt-alpha-init``: one value for every norm (released: 0.5), or per norm position as the LLaMA code
  (``other_tasks/LLaMA/fms_fsdp/models/llama.py:73-75,85-92,245-248``): ``attn,ffn,final`` = the norm
  before each attention (self and cross), before each FFN, and the stacks' final norms; a norm without a
  released position (the embedding norm, Sub-LN's and NormFormer's inner norms) takes ``ffn``'s, the
  value of "the others" beside attention. A released preset names the README's values per LLaMA 2
  size (:data:`~fairseq_deepinit.modules.dyt.RELEASED_ALPHA_INIT`). Per-position values are the
  released Pre-LN positions: with a Post-LN stack, fairseq's ``self_attn_layer_norm`` normalises the
  attention's output, the FFN's input, so they are refused there (one value still applies).
- ``--no-dyt-bias``: the LLaMA variant ``weight * tanh(alpha x)`` (``llama.py:32-46``).
- ``--dyt-embed-scale``: the LLaMA code's learnable scalar on the token embedding (``llama.py:208-209``,
  init sqrt(d) at ``275``, used at ``383``): fairseq's ``embed_scale`` (sqrt(d), or 1 with
  ``--no-scale-embedding``) made a parameter, its value at init unchanged; ``auto``: learnable for a
  decoder-only model (as both released language models), fixed for translation (no release).

No eps: ``--norm-eps`` is refused (nothing is divided; :func:`fairseq_deepinit.options.resolve_and_validate`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict

import torch.nn as nn

from ..errors import DeepInitConfigError
from ..modules.dyt import DYT_ALPHA_INIT, RELEASED_ALPHA_INIT, AlphaInit, learnable_embed_scale
from .record import Method, Option, flag, has_encoder

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


def validate_pointwise(norm: str, args) -> None:
    """``auto`` embedding scale resolved; per-position alphas refused on a Post-LN stack."""
    scale = f"{norm}_embed_scale"
    if getattr(args, scale) == "auto":
        setattr(args, scale, "fixed" if has_encoder(args) else "learnable")
    name = f"{norm}_alpha_init"
    post = (has_encoder(args) and not args.encoder_normalize_before) or not args.decoder_normalize_before
    if post and not uniform(parse_alpha_init(getattr(args, name))):
        raise DeepInitConfigError(
            f"{flag(name)} {getattr(args, name)} gives per-position alphas, which are the released Pre-LN "
            "positions (the norm before attention / before the FFN / the final norm); this model has a Post-LN "
            f"stack. Give one value (e.g. {flag(name)} 0.5) or add --encoder-normalize-before "
            "--decoder-normalize-before"
        )


def pointwise_norm_args(norm: str, extra: Callable[[Any], Dict[str, Any]] | None = None):
    """``norm_args(cfg, position)``: the norm's alpha at ``position`` (None: :data:`OTHER_POSITION`), its bias."""

    def norm_args(cfg, position: str | None) -> Dict[str, Any]:
        alpha = parse_alpha_init(getattr(cfg, f"{norm}_alpha_init"))
        kwargs = {"alpha_init": alpha.at(position or OTHER_POSITION), "bias": bool(getattr(cfg, f"{norm}_bias"))}
        return {**kwargs, **(extra(cfg) if extra is not None else {})}

    return norm_args


def learnable_embed_scales(norm: str):
    """``post_init``: each stack's ``embed_scale`` (a float) made a learnable scalar of the same value."""

    def post_init(model: nn.Module, cfg) -> None:
        if getattr(cfg, f"{norm}_embed_scale") != "learnable":
            return
        for stack in (getattr(model, "encoder", None), getattr(model, "decoder", None)):
            if stack is not None and isinstance(getattr(stack, "embed_scale", None), float):
                stack.embed_scale = learnable_embed_scale(stack.embed_scale)

    return post_init


def describe_pointwise(norm: str, args) -> str:
    alpha, scale = getattr(args, f"{norm}_alpha_init"), getattr(args, f"{norm}_embed_scale")
    bias = "" if getattr(args, f"{norm}_bias") else ", no bias"
    return f"{norm} alpha-init={alpha}{bias}, embed-scale={scale}"


METHOD = Method(
    name="dyt",
    title="DyT (Dynamic Tanh)",
    paper="Zhu, Chen, He, LeCun, Liu 2025, eq. 1",
    summary="every norm replaced by `weight * tanh(alpha x) + bias` (scalar alpha); per-position alpha, no bias "
    "and a learnable embedding scale as the LLaMA code",
    code="jiachenzhu/DyT @ aab5dde dynamic_tanh.py:6-23; other_tasks/LLaMA/fms_fsdp/models/llama.py:32-46,208-209,383",
    owner=("norm_type", "dyt"),
    options=pointwise_options("dyt", DYT_ALPHA_INIT, "DyT"),
    validate=lambda args: validate_pointwise("dyt", args),
    describe=lambda args: describe_pointwise("dyt", args),
    norm_args=pointwise_norm_args("dyt"),
    post_init=learnable_embed_scales("dyt"),
    # Pre-LN, the released language models' placement
    families={"dyt": dict(norm_type="dyt", encoder_normalize_before=True, decoder_normalize_before=True)},
)
