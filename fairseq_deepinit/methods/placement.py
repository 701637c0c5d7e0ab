"""Norm placement as one switch: Post-LN, Pre-LN, Peri-LN and OLMo 2's reordered norm (``--norm-placement``).

Each residual sub-layer ``F`` (self-attention, cross-attention, FFN) of every layer, ``N`` its norm
(:mod:`fairseq_deepinit.modules.sublayer` computes them):

- ``post``: ``x + F(x)`` then ``N``; ``pre``: ``x + F(N(x))`` (fairseq's ``--*-normalize-before``);
- ``peri`` (Peri-LN, Kim et al. 2025, "Peri-LN: Revisiting Layer Normalization in the Transformer
  Architecture"; Sandwich-LN is the same placement): ``x + N_out(F(N_in(x)))``, allenai/OLMo-core @
  fa6c501 ``src/olmo_core/nn/transformer/block.py:312-373`` (``PeriNormTransformerBlock``: the output
  norms ``post_attention_norm`` / ``post_feed_forward_norm`` at 345-346, forward at 348-361);
- ``reordered`` (OLMo 2, Team OLMo 2024, "2 OLMo 2 Furious"): ``x + N(F(x))``, ``block.py:293-309``
  (``ReorderedNormTransformerBlock``).

The output norm comes before the residual dropout (OLMo-core ``src/olmo_core/nn/residual_stream.py:18-19``
drops out the normalised branch). ``pre``, ``peri`` and ``reordered`` end each stack with a final norm (OLMo-core's
LM head norm, ``src/olmo_core/nn/lm_head.py:230``; fairseq's ``layer_norm``, built with
``--*-normalize-before``); ``post`` has none. The embedding norm (OLMo-core ``model.py:110-136``, applied at
588-592) is fairseq's ``--layernorm-embedding`` slot, of ``--norm-type``. The encoder-decoder (cross-attention
under the same rule) is this project's extension: the released blocks are decoder-only.

HybridNorm (Zhuo et al. 2025, BryceZhuo/HybridNorm @ f0dd605 ``dense_model/olmo/model.py:433-489,
814-893``) is not a value of this switch: its attention has no input norm but per-head q/k/v norms inside
(``433-466``), and its FFN reads and bypasses ``N(x + Attn(x))``, a rule per sub-layer rather than per
layer (docs/schemes.md).

``auto`` (the default) leaves fairseq's flags in charge, so every existing configuration builds as
before; :func:`fairseq_deepinit.resolve.resolve` resolves it into each stack's ``placement`` (an explicit
placement refuses ``post``'s contradiction with the flags; what is defined on one placement only says so
in its record's ``requires``).
"""

from __future__ import annotations

from ..modules.sublayer import PLACEMENTS
from .exporting import FAIRSEQ, Export
from .record import Method, Option, a_norm


def _placed(spec, placement: str) -> bool:
    return any(stack.placement == placement for stack in spec.stacks)


def _reordered(p, spec, args) -> str | None:
    if _placed(spec, "reordered"):
        return (
            "--norm-placement reordered (OLMo 2) normalises each branch's output only, a placement neither target has"
        )
    return None


def _peri(p, spec, args) -> str | None:
    if _placed(spec, "peri"):
        return "--norm-placement peri (Peri-LN): a stock transformer has no norm on a sub-layer's output"
    return None


#: CTranslate2 has Peri-LN's output norms (``external_pre_post_encoder_layers``), a stock transformer does not
EXPORT = Export(neither=_reordered, refuses={FAIRSEQ: _peri})

METHOD = Method(
    name="placement",
    title="Norm placement (Peri-LN, OLMo 2 reordered)",
    paper='Kim et al. 2025 (Peri-LN); Team OLMo 2024, "2 OLMo 2 Furious" (reordered norm)',
    summary="one switch for where each sub-layer's norm sits: post, pre, peri `x + N(F(N(x)))`, reordered "
    "`x + N(F(x))`; final norm for all but post; embedding norm: `--layernorm-embedding`",
    code="allenai/OLMo-core @ fa6c501 src/olmo_core/nn/transformer/block.py:293-309,312-373, model.py:110-136,588-592",
    enabled_by=("norm_placement=peri", "norm_placement=reordered"),
    options=(
        Option(
            "norm_placement",
            str,
            "auto",
            "where each sub-layer's norm sits: post (Post-LN), pre (Pre-LN), peri (Peri-LN: a norm before and "
            "after each branch), reordered (OLMo 2: a norm on each branch's output); pre/peri/reordered end "
            "each stack with a norm. auto (default): --encoder-/--decoder-normalize-before decide",
            choices=("auto",) + PLACEMENTS,
        ),
    ),
    requires=(a_norm("places norms"),),
    export=EXPORT,
    families={
        "periln": dict(init_scheme="xavier", norm_placement="peri"),
        "reordered": dict(init_scheme="xavier", norm_placement="reordered"),
    },
)
