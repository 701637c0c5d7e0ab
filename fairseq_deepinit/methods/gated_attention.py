"""Gated attention (Qiu et al. 2025, "Gated Attention for Large Language Models", arXiv 2505.06708, the G1
position): ``--gated-attention``, a sigmoid gate on each head's attention output,

    o_h = softmax(q_h k_h^T / sqrt(dh)) v_h * sigmoid(W_g x + b_g)_h,     out = out_proj(concat_h o_h),

after the softmax-weighted sum (after SDPA) and before the head merge and ``out_proj``; ``x`` is the
attention's query-side input. ``--gated-attention-granularity headwise`` (one gate per head, ``H`` outputs:
OLMo-core's default ``GateGranularity.headwise``) or ``elementwise`` (one per output element, ``H dh``:
Megatron-LM ``attention_output_gate``, the release's "further enhances sparsity"). Released code:
qiuzh20/gated_attention @ 49645df ``modeling_qwen3.py:271-276, 304-313, 353-360`` (the gate rows fused into
``q_proj``); allenai/OLMo-core @ fa6c501 ``src/olmo_core/nn/attention/__init__.py:392-405, 636-654, 753-759``
(a separate ``w_g``, the sigmoid in float32, ``w_g`` initialised like ``w_q``), which this follows: a
separate ``gate.proj`` per attention (the same function as the fused layout), with a bias as fairseq's
projections have, initialised as fairseq initialises ``q_proj`` (xavier_uniform, gain 1/sqrt(2)), bias 0.

Encoder-decoder (this project's extension; the releases are decoder-only): every attention gets its own
gate, encoder and decoder self-attention and the decoder's cross-attention, whose gate reads the decoder
stream (the query side); ``--no-gated-attention-cross`` leaves the cross-attention ungated. The block:
:mod:`fairseq_deepinit.modules.attention_features`.
"""

from __future__ import annotations

import math

import torch.nn as nn

from ..modules.attention_features import GATE_KINDS, AttentionGate, FeatureAttention, feature_attention
from .exporting import never
from .record import Method, Option, check_cross_off, own_attention_forward, standard_layer

OPTIONS = (
    Option(
        "gated_attention",
        bool,
        False,
        "gated attention: a sigmoid gate on each head's attention output before out_proj (Qiu et al. 2025; "
        "docs/schemes.md)",
    ),
    Option(
        "gated_attention_granularity",
        str,
        "headwise",
        "with --gated-attention: headwise (one gate per head, OLMo-core's default; default) or elementwise (one "
        "per output element, Megatron-LM)",
        choices=GATE_KINDS,
    ),
    Option(
        "gated_attention_cross",
        bool,
        True,
        "with --gated-attention: gate the encoder-decoder attention too (default; this project's extension)",
        negative="--no-gated-attention-cross",
        negative_help="with --gated-attention: leave the encoder-decoder attention ungated (self-attention only)",
    ),
)


def validate_gated_attention(p, spec) -> None:
    check_cross_off(p, spec, "gated_attention_cross")


def setup_gated_attention_layer(layer, p, spec) -> None:
    """Layer set-up: a gate in every attention of the layer (not the cross-attention under
    ``--no-gated-attention-cross``)."""
    for attn in layer.attention_modules():
        if attn.encoder_decoder_attention and not p.gated_attention_cross:
            continue
        attn = feature_attention(attn)
        bias = attn.q_proj.bias is not None
        attn.gate = AttentionGate(attn.embed_dim, attn.num_heads, p.gated_attention_granularity, bias=bias)


def init_gates(model: nn.Module, p, spec) -> None:
    """After the init scheme: each gate projection as fairseq initialises ``q_proj`` (OLMo-core: ``w_g`` like
    ``w_q``), xavier_uniform with gain 1/sqrt(2), bias 0 (sigmoid 0.5 for a zero input)."""
    for m in model.modules():
        if isinstance(m, FeatureAttention) and m.gate is not None:
            nn.init.xavier_uniform_(m.gate.proj.weight, gain=1 / math.sqrt(2))
            if m.gate.proj.bias is not None:
                nn.init.zeros_(m.gate.proj.bias)


def describe_gated_attention(p) -> str:
    cross = "" if p.gated_attention_cross else ",self-attention only"
    return f"gated-attention={p.gated_attention_granularity}{cross}"


METHOD = Method(
    name="gated_attention",
    title="Gated attention",
    paper="Qiu et al. 2025 (arXiv 2505.06708), G1 gate; OLMo-core, Megatron-LM attention_output_gate",
    summary="a sigmoid gate from the query-side input on each head's attention output (after SDPA, before "
    "out_proj), headwise or elementwise, sigmoid in float32",
    code="qiuzh20/gated_attention @ 49645df modeling_qwen3.py:271-276,304-313,353-360; allenai/OLMo-core @ "
    "fa6c501 src/olmo_core/nn/attention/__init__.py:392-405,636-654,753-759",
    enabled_by="gated_attention",
    options=OPTIONS,
    requires=(standard_layer("gates each attention of the standard layer (MAtt's merged sub-layer has none)"),),
    excludes=own_attention_forward("a gate"),
    validate=validate_gated_attention,
    describe=describe_gated_attention,
    layer_setup=setup_gated_attention_layer,
    post_init=init_gates,
    export=never(
        "--gated-attention multiplies each head's attention output by a sigmoid gate before out_proj, which "
        "neither target has"
    ),
    families={
        # Pre-LN + gated attention with the Pre-LN baseline's init: the preln_* model plus the gates only
        "gatedattn": dict(init_scheme="xavier", gated_attention=True, norm_placement="pre"),
    },
)
