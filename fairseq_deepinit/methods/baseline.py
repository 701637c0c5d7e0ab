"""The fairseq 0.8/0.9 baseline initialisation (``--init-scheme xavier``), today's fairseq (``fairseq``), and
the Post-LN / Pre-LN baselines (Xu et al. 2020, eq. 1-2: "v1" and tensor2tensor's "v2").

fairseq 0.8/0.9, which Admin (Liu et al. 2020) and T-Fixup (Huang et al. 2020) built on: every
Linear xavier_uniform with zero bias; attention q/k/v xavier_uniform with gain 1/sqrt(2) when
q, k, v share a dimension, out_proj xavier_uniform; embeddings N(0, d^-1/2) with a zero padding
row (fairseq's ``Embedding``, unchanged). fairseq 0.12 drifted: fc1/fc2 and q/k/v biases keep
torch's default U(+-1/sqrt(fan_in)); scheme ``fairseq`` leaves exactly that in place. Every other
scheme except ``fairseq`` starts from :func:`apply_baseline`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from fairseq.modules import MultiheadAttention

from .record import InitScheme, Method, iter_layers


def zero_bias(linear: nn.Module) -> None:
    bias = getattr(linear, "bias", None)
    if isinstance(bias, nn.Parameter):
        with torch.no_grad():
            bias.zero_()


def layer_linears(layer: nn.Module):
    """Every nn.Linear of a layer that is not a projection of a fairseq attention module."""
    in_attn = set()
    for m in layer.modules():
        if isinstance(m, MultiheadAttention):
            in_attn.update(id(p) for p in (m.q_proj, m.k_proj, m.v_proj, m.out_proj))
    return [m for m in layer.modules() if isinstance(m, nn.Linear) and id(m) not in in_attn]


def apply_baseline(model: nn.Module, cfg=None) -> None:
    """Re-initialise every layer's weights as fairseq 0.8/0.9 did (module order, seeded)."""
    for _stack, _idx, layer in iter_layers(model):
        for m in layer.modules():
            if isinstance(m, MultiheadAttention):
                m.reset_parameters()  # xavier_uniform, gain 1/sqrt(2) on q/k/v; out bias 0
                for proj in (m.q_proj, m.k_proj, m.v_proj):
                    zero_bias(proj)
        for lin in layer_linears(layer):
            nn.init.xavier_uniform_(lin.weight)
            zero_bias(lin)


METHOD = Method(
    name="baseline",
    title="Post-LN / Pre-LN baselines",
    paper="Vaswani et al. 2017; Xu et al. 2020, eq. 1-2 (v1 / v2); fairseq 0.8/0.9 init",
    summary="Post-LN or Pre-LN (`--encoder-normalize-before --decoder-normalize-before`), the papers' fairseq "
    "0.8/0.9 init (`xavier`, default) or today's fairseq 0.12 init (`fairseq`)",
    code="fairseq 0.9 `fairseq/modules/multihead_attention.py` reset_parameters",
    init_schemes=(
        InitScheme("fairseq", lambda model, cfg: None, "today's fairseq 0.12 initialisation, untouched"),
        InitScheme(
            "xavier", apply_baseline, "fairseq 0.8/0.9 baseline: xavier_uniform, zero biases (the papers' baseline)"
        ),
    ),
    families={
        "postln": dict(init_scheme="xavier"),
        "preln": dict(init_scheme="xavier", encoder_normalize_before=True, decoder_normalize_before=True),
    },
)
