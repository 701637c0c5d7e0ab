"""Depth-scaled initialisation, DS-Init (Zhang, Titov & Sennrich 2019, "Improving Deep
Transformer with Depth-Scaled Initialization and Merged Attention", eq. 15).

Every weight matrix inside layer l (l counted from 1, separately in encoder and decoder):
W ~ U(-gamma * alpha / sqrt(l), +gamma * alpha / sqrt(l)), gamma = sqrt(6 / (d_in + d_out)),
alpha in [0, 1] (1.0 in the paper). ``--ds-init-variant code`` uses the released TF code's
bound gamma * sqrt(alpha) * l^(-1/4) (variance_scaling with scale alpha / sqrt(l)). Biases 0,
norms 1/0, embeddings untouched.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from . import SchemeSpec, iter_layers, register_scheme
from .baseline import apply_baseline


def ds_init_bound(d_in: int, d_out: int, layer: int, alpha: float = 1.0, variant: str = "paper") -> float:
    gamma = math.sqrt(6.0 / (d_in + d_out))
    if variant == "paper":
        return gamma * alpha / math.sqrt(layer)
    if variant == "code":
        return gamma * math.sqrt(alpha) * layer**-0.25
    raise ValueError(f"unknown DS-Init variant {variant!r}; choose paper or code")


@torch.no_grad()
def apply_dsinit(model: nn.Module, cfg) -> None:
    apply_baseline(model, cfg)  # zero biases, as the baseline
    for _stack, depth, layer in iter_layers(model):
        for m in layer.modules():
            if isinstance(m, nn.Linear):
                b = ds_init_bound(m.in_features, m.out_features, depth, cfg.ds_init_alpha, cfg.ds_init_variant)
                nn.init.uniform_(m.weight, -b, b)


register_scheme(
    SchemeSpec(
        "ds-init",
        apply_dsinit,
        "DS-Init (Zhang et al. 2019): U(+-gamma*alpha/sqrt(l)) per layer depth l",
    )
)
