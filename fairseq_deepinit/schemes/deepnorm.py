"""DeepNorm initialisation (Wang et al. 2022, "DeepNet: Scaling Transformers to 1,000 Layers",
Table 1, encoder-decoder).

From the baseline, v_proj, out_proj, fc1 and fc2 of every layer ~ xavier_normal with gain
beta_enc = 0.87 (N^4 M)^(-1/16) (encoder) or beta_dec = (12 M)^(-1/4) (decoder, both attentions),
and q_proj, k_proj ~ xavier_normal with gain 1 (the paper's Figure 2 pseudocode, ``deepnorm_init``);
the residual is ``LN(alpha * x + f(x))`` (``--residual-scale deepnorm``, Post-LN) with
alpha_enc = 0.81 (N^4 M)^(1/16), alpha_dec = (3 M)^(1/4). N = encoder, M = decoder layers.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..modules.residual import deepnorm_beta
from .base import WITH_NORM, SchemeSpec, iter_layers, own_value_projections, register_scheme
from .baseline import apply_baseline


@torch.no_grad()
def apply_deepnorm(model: nn.Module, cfg) -> None:
    apply_baseline(model, cfg)
    for stack, _l, layer in iter_layers(model):
        beta = deepnorm_beta(stack, cfg.encoder.layers, cfg.decoder.layers)
        targets = [layer.fc1, layer.fc2]
        for attn in (getattr(layer, "self_attn", None), getattr(layer, "encoder_attn", None)):
            if attn is not None:
                targets += [attn.v_proj, attn.out_proj]
                # Figure 2: q, k are xavier_normal with gain 1 (not the baseline's uniform 1/sqrt(2))
                nn.init.xavier_normal_(attn.q_proj.weight, gain=1.0)
                nn.init.xavier_normal_(attn.k_proj.weight, gain=1.0)
        targets += own_value_projections(layer)
        for lin in targets:
            nn.init.xavier_normal_(lin.weight, gain=beta)


register_scheme(
    SchemeSpec(
        "deepnorm",
        apply_deepnorm,
        "DeepNorm (Wang et al. 2022): residual alpha and init gain beta, Post-LN",
        allowed_norms=WITH_NORM,
        norm_reason="DeepNorm is a Post-LN scheme",
        residual="deepnorm",
        needs_post_ln=True,
    )
)
