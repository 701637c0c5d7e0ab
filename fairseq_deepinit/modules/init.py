"""The fairseq 0.8/0.9 initialisation of a layer, which the papers' baselines and most init schemes start from.

fairseq 0.8/0.9, which Admin (Liu et al. 2020) and T-Fixup (Huang et al. 2020) built on: every
Linear xavier_uniform with zero bias; attention q/k/v xavier_uniform with gain 1/sqrt(2) when
q, k, v share a dimension, out_proj xavier_uniform; embeddings N(0, d^-1/2) with a zero padding
row (fairseq's ``Embedding``, unchanged). fairseq 0.12 drifted: fc1/fc2 and q/k/v biases keep
torch's default U(+-1/sqrt(fan_in)) (``--init-scheme fairseq`` leaves exactly that in place).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from fairseq.modules import MultiheadAttention

from .stacks import iter_layers


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


def apply_baseline(model: nn.Module, *_unused) -> None:
    """Re-initialise every layer's weights as fairseq 0.8/0.9 did (module order, seeded): the ``xavier``
    scheme's ``apply`` (fairseq 0.9 ``fairseq/modules/multihead_attention.py`` reset_parameters)."""
    for _stack, _idx, layer in iter_layers(model):
        for m in layer.modules():
            if isinstance(m, MultiheadAttention):
                m.reset_parameters()  # xavier_uniform, gain 1/sqrt(2) on q/k/v; out bias 0
                for proj in (m.q_proj, m.k_proj, m.v_proj):
                    zero_bias(proj)
        for lin in layer_linears(layer):
            nn.init.xavier_uniform_(lin.weight)
            zero_bias(lin)
