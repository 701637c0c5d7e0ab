"""SmallInit (Nguyen & Salazar 2019, "Transformers without Tears", sec. 2.1).

Attention weights (q, k, v, out) ~ N(0, sqrt(2/(5d))), i.e. Xavier normal as if fan_out were 4d,
which keeps the attention sub-layer small at the start; FFN weights Xavier normal; biases 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from fairseq.modules import MultiheadAttention

from .base import SchemeSpec, iter_layers, own_value_projections, register_scheme
from .baseline import apply_baseline, layer_linears


def smallinit_std(d: int) -> float:
    return math.sqrt(2.0 / (5.0 * d))


@torch.no_grad()
def apply_smallinit(model: nn.Module, cfg) -> None:
    apply_baseline(model, cfg)  # zero biases, as the baseline
    for _stack, _l, layer in iter_layers(model):
        for m in layer.modules():
            if isinstance(m, MultiheadAttention):
                for proj in (m.q_proj, m.k_proj, m.v_proj, m.out_proj):
                    nn.init.normal_(proj.weight, 0.0, smallinit_std(m.embed_dim))
        own_v = own_value_projections(layer)
        for lin in layer_linears(layer):
            if lin in own_v:
                nn.init.normal_(lin.weight, 0.0, smallinit_std(lin.in_features))  # MAtt's W_v: an attention weight
            else:
                nn.init.xavier_normal_(lin.weight)


register_scheme(
    SchemeSpec(
        "smallinit",
        apply_smallinit,
        "SmallInit (Nguyen & Salazar 2019): attention N(0, sqrt(2/5d)), FFN Xavier normal",
    )
)
