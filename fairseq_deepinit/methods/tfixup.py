"""T-Fixup (Huang et al. 2020, "Improving Transformer Optimization Through Better Initialization").

Sec. 3.2 / released code, starting from the fairseq 0.8/0.9 baseline with embeddings N(0, d^-1/2):

- encoder layers: fc1, fc2, self_attn.out_proj scaled by 0.67 N_e^(-1/4);
  self_attn.v_proj by 0.67 N_e^(-1/4) * sqrt(2) (undoing the baseline's 1/sqrt(2) gain);
- decoder layers: fc1, fc2, self_attn.out_proj, encoder_attn.out_proj by (9 N_d)^(-1/4);
  self_attn.v_proj and encoder_attn.v_proj by (9 N_d)^(-1/4) * sqrt(2);
- q and k projections are not scaled;
- input embeddings: encoder x (9 N_e)^(-1/4) (the released code uses the encoder depth), decoder
  x (9 N_d)^(-1/4) unless all embeddings are shared;
- every LayerNorm removed (``--norm-type none``) and no warmup (``--lr-scheduler tfixup``).

A decoder-only language model (no encoder) gets the decoder rules with N_d its layers: this
project's extension, see docs/lm.md. The lr schedule is :mod:`fairseq_deepinit.training.tfixup_schedule`.
"""

from __future__ import annotations

import math

import torch

from ..modules.init import apply_baseline
from ..modules.stacks import iter_layers
from .exporting import EXPORT_NEUTRAL
from .record import InitScheme, Method


def tfixup_factors(stack: str, encoder_layers: int, decoder_layers: int) -> tuple:
    """(scale of fc1/fc2/out_proj, scale of v_proj) for a layer of ``stack`` (Huang et al. sec. 3.2)."""
    if stack == "encoder":
        s = 0.67 * encoder_layers**-0.25
    else:
        s = (9.0 * decoder_layers) ** -0.25
    return s, s * math.sqrt(2.0)


def embedding_factor(stack: str, encoder_layers: int, decoder_layers: int) -> float:
    n = encoder_layers if stack == "encoder" else decoder_layers
    return (9.0 * n) ** -0.25


@torch.no_grad()
def apply_tfixup(model, p, spec) -> None:
    apply_baseline(model)
    n_e, n_d = spec.layers("encoder"), spec.layers("decoder")
    for stack, _l, layer in iter_layers(model):
        s, s_v = tfixup_factors(stack, n_e, n_d)
        layer.fc1.weight.mul_(s)
        layer.fc2.weight.mul_(s)
        for attn in (getattr(layer, "self_attn", None), getattr(layer, "encoder_attn", None)):
            if attn is not None:
                attn.out_proj.weight.mul_(s)
                attn.v_proj.weight.mul_(s_v)
        for w_v in layer.own_value_projections():
            w_v.weight.mul_(s)  # its baseline is xavier with gain 1, so no sqrt(2) to undo
    encoder = getattr(model, "encoder", None)  # absent in a decoder-only language model
    if encoder is not None:
        encoder.embed_tokens.weight.mul_(embedding_factor("encoder", n_e, n_d))
    if encoder is None or model.decoder.embed_tokens is not encoder.embed_tokens:
        model.decoder.embed_tokens.weight.mul_(embedding_factor("decoder", n_e, n_d))


METHOD = Method(
    name="tfixup",
    title="T-Fixup",
    paper="Huang et al. 2020, sec. 3.2",
    summary="depth-scaled init of v/out projections, FFN and embeddings; no LayerNorm, no warmup "
    "(`--lr-scheduler tfixup`)",
    code="layer6ai-labs/T-Fixup",
    init_schemes=(
        InitScheme(
            "t-fixup",
            apply_tfixup,
            "T-Fixup (Huang et al. 2020): depth-scaled init, no LayerNorm, no warmup",
            default_norm="none",
            allowed_norms=("none",),
            norm_reason="T-Fixup removes every LayerNorm",
            embeddings=True,
            depth_scaled="T-Fixup scales v/out/fc1/fc2 by L^-1/4",
            two_matrix_ffn="T-Fixup's bound on each update (Huang et al. 2020, sec. 3.2) scales v/out/fc1/fc2 as the "
            "only matrices of the branches; a gated FFN's third, W_g, has no constant from that argument",
        ),
    ),
    families={"tfixup": dict(init_scheme="t-fixup")},
    export=EXPORT_NEUTRAL,  # an init scheme (its norm-free model is the norm axis's)
    architectures={
        # T-Fixup Fig. 4b: 200 encoder + 200 decoder layers of d=64, FFN 128, 2 heads
        "tfixup_iwslt_de_en_200l": (
            "iwslt_de_en",
            dict(
                init_scheme="t-fixup",
                encoder_embed_dim=64,
                encoder_ffn_embed_dim=128,
                encoder_attention_heads=2,
                encoder_layers=200,
                decoder_embed_dim=64,
                decoder_ffn_embed_dim=128,
                decoder_attention_heads=2,
                decoder_layers=200,
            ),
        ),
    },
)
