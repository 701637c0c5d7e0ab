"""Learned attention sinks (gpt-oss 2025; x-transformers ``head_learned_sink``; DeepSeek-V4): ``--attention-sinks``,
one learned logit ``s_h`` per head in every softmax row's denominator, with no value,

    p_ij = exp(l_ij) / (exp(s_h) + sum_k exp(l_ik)),     o_i = sum_j p_ij v_j,

so a query may put weight on "nothing" (a row whose keys are all masked gives 0, not NaN). Released code:
openai/gpt-oss @ 7b58334 ``gpt_oss/torch/model.py:153-173, 189-191`` (``softmax(cat([QK, S]))[..., :-1]``, one
sink per head) and ``gpt_oss/triton/attention.py:165-203``; lucidrains/x-transformers @ 9252ed7
``x_transformers/attend.py:292-298, 592-628`` (init zeros, the sink dropped after the softmax and before
attention dropout). The parameter ``sinks`` ``(H,)`` is float32 and starts at 0 (x-transformers, HF
DeepSeek-V4; gpt-oss stores bf16); fairseq's ``--fp16`` / ``--bf16`` cast the whole model, sinks included.

Both ``--attention-impl`` paths: fairseq's explicit path appends the sink column after the masks; the fused
kernel gets an exact form with one more head dimension, the head padded to a multiple of 8 so that CUDA's fused
kernels take it in bf16 (:mod:`fairseq_deepinit.modules.attention_features`), which keeps ``is_causal`` for the
decoder. Encoder-decoder (extension): a sink in every attention, cross-
attention included (a target word may attend to nothing in the source); ``--no-attention-sinks-cross``
leaves the cross-attention without one.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..modules.attention_features import feature_attention
from .exporting import never
from .record import Method, Option, check_cross_off, own_attention_forward, standard_layer

OPTIONS = (
    Option(
        "attention_sinks",
        bool,
        False,
        "learned attention sinks: one learned logit per head in every softmax denominator (gpt-oss; docs/schemes.md)",
    ),
    Option(
        "attention_sinks_cross",
        bool,
        True,
        "with --attention-sinks: a sink in the encoder-decoder attention too (default; this project's extension)",
        negative="--no-attention-sinks-cross",
        negative_help="with --attention-sinks: no sink in the encoder-decoder attention (self-attention only)",
    ),
)


def validate_sinks(p, spec) -> None:
    check_cross_off(p, spec, "attention_sinks_cross")


def setup_sinks_layer(layer, p, spec) -> None:
    """Layer set-up: a zero float32 sink per head in every attention of the layer (not the cross-attention
    under ``--no-attention-sinks-cross``)."""
    for attn in layer.attention_modules():
        if attn.encoder_decoder_attention and not p.attention_sinks_cross:
            continue
        attn = feature_attention(attn)
        attn.sinks = nn.Parameter(torch.zeros(attn.num_heads, dtype=torch.float32, device=attn.q_proj.weight.device))


def describe_sinks(p) -> str:
    return "attention-sinks" + ("" if p.attention_sinks_cross else "(self-attention only)")


METHOD = Method(
    name="attention_sinks",
    title="Learned attention sinks",
    paper="gpt-oss (OpenAI 2025) model card, attention sinks; x-transformers head_learned_sink; DeepSeek-V4",
    summary="one learned logit per head (init 0, float32) in every softmax denominator, with no value; exact "
    "on both attention paths (SDPA: one more head dimension)",
    code="openai/gpt-oss @ 7b58334 gpt_oss/torch/model.py:153-173,189-191; lucidrains/x-transformers @ 9252ed7 "
    "x_transformers/attend.py:292-298,592-628",
    enabled_by="attention_sinks",
    options=OPTIONS,
    requires=(standard_layer("puts a sink in each attention of the standard layer (MAtt's merged one has none)"),),
    excludes=own_attention_forward("a sink"),
    validate=validate_sinks,
    describe=describe_sinks,
    layer_setup=setup_sinks_layer,
    export=never("--attention-sinks adds a learned logit to every softmax denominator, which neither target has"),
    families={
        "sinks": dict(init_scheme="xavier", attention_sinks=True, norm_placement="pre"),
    },
)
