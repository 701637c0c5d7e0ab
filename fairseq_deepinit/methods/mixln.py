"""Mix-LN (Li, Yin, Liu 2024, "Mix-LN: Unleashing the Power of Deeper Layers by Combining Pre-LN and
Post-LN"): ``--mix-ln``, the first k layers of a stack Post-LN, the others Pre-LN, then the stack's final norm.

Released code: pixeli99/MixLN @ ff45826 ``peft_pretraining/modeling_llama.py``: ``NORM_TYPE=post_pre`` and
``POST_NUM=k`` (265-268; ``layer_index < k`` is Post-LN, from 0); construction 325-333; forward 565-601::

    layer i < k  (Post-LN, 566-583):  h = N_a(x + Attn(x));     out = N_f(h + FFN(h))
    layer i >= k (Pre-LN, 584-601):   h = x + Attn(N_a(x));     out = h + FFN(N_f(h))

Nothing sits between the two parts (the last Post-LN layer's normalised output is the first Pre-LN
layer's residual stream), and ``LlamaModel`` applies its final ``self.norm`` (929, applied at 1077)
whatever the mix. Here each layer's placement comes from :func:`mixln_placement` (the record's
``placement`` rule, read by :func:`fairseq_deepinit.plan.layer_plan`), and the stacks are built Pre-LN
(``--encoder-/--decoder-normalize-before``), which is what makes fairseq build the final norm
(``transformer_encoder.py:100-103``, ``transformer_decoder.py:126-129``); a Post-LN layer's two (three)
norms are fairseq's sub-layer norms used after the sum.

k: the scripts run ``post_pre 3`` on 12 layers (``scripts/run_71m.sh``, ``configs/llama_71m.json``) and
``post_pre 6`` on 24 (``scripts/run_1b.sh``); the LayerNorm-Scaling README the same for 130M to 1B: k/L =
0.25, the paper's Post-LN ratio alpha. ``--mixln-ratio`` (default 0.25) gives ``k = floor(ratio * L)`` per
stack (floor reproduces both released depths; 1 of 6 layers, 4 of 18), ``--mixln-post-layers k`` sets k
itself (both stacks). Encoder-decoder translation is this project's extension: the split per stack, a
Post-LN decoder layer normalising after each of its three sums.
"""

from __future__ import annotations

import math

from ..errors import DeepInitConfigError
from ..modules.stacks import StackKind
from .record import Method, Option, has_encoder, missing_pre_ln_flags

POST_LN_RATIO = 0.25  # k / L of every released run (3 of 12, 6 of 24 layers)


def num_post_layers(cfg, layers: int) -> int:
    """k of a stack of ``layers`` layers: ``--mixln-post-layers`` if given, else ``floor(ratio * layers)``."""
    k = getattr(cfg, "mixln_post_layers", None)
    if k is not None:
        return k
    # the epsilon keeps 0.25 * 12 from flooring to 2 where a ratio's binary value lies just below k / L
    return math.floor(cfg.mixln_ratio * layers + 1e-9)


def mixln_placement(cfg, kind: StackKind, index: int) -> str | None:
    """Layer ``index`` (from 1) of a stack of ``kind``: ``"post"`` for the first k, ``"pre"`` after
    (modeling_llama.py:566, ``layer_index < max_post_norm_layer`` with ``layer_index = index - 1``)."""
    if not getattr(cfg, "mix_ln", False):
        return None
    layers = cfg.encoder.layers if kind.stack == "encoder" else cfg.decoder.layers
    return "post" if index <= num_post_layers(cfg, layers) else "pre"


def _ratio_problem(value: float) -> str | None:
    return (
        None if 0.0 <= value <= 1.0 else f"--mixln-ratio must be in [0, 1] (the Post-LN share of a stack); got {value}"
    )


def _k_problem(value: int) -> str | None:
    return None if value >= 0 else f"--mixln-post-layers must be >= 0; got {value}"


def _ratio_given(args) -> bool:
    """Whether ``--mixln-ratio`` was given: a value other than the default the resolution fills in (an explicit
    ``--mixln-ratio 0.25`` cannot be told from none; it means the same)."""
    return getattr(args, "mixln_ratio", None) not in (None, POST_LN_RATIO)


def validate_mixln_args(args) -> None:
    """Mix-LN's cross-option checks (one-line :class:`DeepInitConfigError`)."""
    if not args.mix_ln:
        for given, option in (
            (args.mixln_post_layers is not None, "--mixln-post-layers"),
            (_ratio_given(args), "--mixln-ratio"),
        ):
            if given:
                raise DeepInitConfigError(f"{option} needs --mix-ln; add it or drop the option")
        return
    if args.mixln_post_layers is not None and _ratio_given(args):
        raise DeepInitConfigError(
            f"--mixln-post-layers {args.mixln_post_layers} sets k itself and --mixln-ratio {args.mixln_ratio:g} "
            "would compute it from the depth; give one of them"
        )
    if args.norm_type == "none":
        raise DeepInitConfigError("--mix-ln places norms and --norm-type none removes them; drop one")
    flags = missing_pre_ln_flags(args)
    if flags:
        raise DeepInitConfigError(
            "--mix-ln makes the first layers Post-LN and the rest Pre-LN with the stack's final norm, which "
            f"fairseq builds for a Pre-LN stack only; add {flags} (the mixln_* "
            "architectures set them)"
        )
    if getattr(args, "norm_placement", "auto") in ("peri", "reordered"):
        raise DeepInitConfigError(
            f"--mix-ln chooses each layer's placement (Post-LN, then Pre-LN) and --norm-placement "
            f"{args.norm_placement} asks for another one in every layer; drop --norm-placement"
        )
    if args.residual_scale != "none":
        raise DeepInitConfigError(
            f"--mix-ln keeps the plain residual x + f(x); drop --residual-scale {args.residual_scale}"
        )
    k = args.mixln_post_layers
    stacks = [("decoder", args.decoder_layers)] + ([("encoder", args.encoder_layers)] if has_encoder(args) else [])
    for stack, layers in stacks:
        if k is not None and k > layers:
            raise DeepInitConfigError(
                f"--mixln-post-layers {k} is more than the {stack}'s {layers} layers; give at most {layers}"
            )


def describe_mixln(args) -> str:
    if not args.mix_ln:
        return ""
    if args.mixln_post_layers is not None:
        return f"mix-ln=post x{args.mixln_post_layers}"
    return f"mix-ln=post ratio {args.mixln_ratio:g}"


METHOD = Method(
    name="mixln",
    title="Mix-LN",
    paper="Li, Yin & Liu 2024 (Mix-LN, ICLR 2025)",
    summary="The first k = floor(0.25 L) layers of each stack Post-LN, the rest Pre-LN, then the stack's final norm",
    code="pixeli99/MixLN @ ff45826 peft_pretraining/modeling_llama.py:265-268,325-333,565-601",
    options=(
        Option(
            "mix_ln",
            bool,
            False,
            "Mix-LN (Li et al. 2024): the first k layers of each stack Post-LN, the rest Pre-LN, then the stack's "
            "final norm (needs --encoder-/--decoder-normalize-before; docs/schemes.md)",
        ),
        Option(
            "mixln_ratio",
            float,
            POST_LN_RATIO,
            "Mix-LN: k = floor(ratio * layers) Post-LN layers per stack (default 0.25, the paper's alpha; the "
            "released runs' 3 of 12 and 6 of 24)",
            metavar="R",
            check=_ratio_problem,
        ),
        Option(
            "mixln_post_layers",
            int,
            None,
            "Mix-LN: k itself, the Post-LN layers of each stack (the released scripts' POST_NUM; overrides "
            "--mixln-ratio)",
            metavar="K",
            check=_k_problem,
        ),
    ),
    validate=validate_mixln_args,
    describe=describe_mixln,
    placement=mixln_placement,
    families={
        "mixln": dict(init_scheme="xavier", mix_ln=True, encoder_normalize_before=True, decoder_normalize_before=True),
    },
)
