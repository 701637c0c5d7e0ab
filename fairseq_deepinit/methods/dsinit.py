"""Depth-scaled initialisation, DS-Init (Zhang, Titov & Sennrich 2019, "Improving Deep
Transformer with Depth-Scaled Initialization and Merged Attention", eq. 15): ``--init-scheme ds-init``
(``--ds-init-variant``, ``--ds-init-alpha``). Its merged attention is :mod:`.matt`.

Every weight matrix inside layer l (l counted from 1, separately in encoder and decoder):
W ~ U(-gamma * alpha / sqrt(l), +gamma * alpha / sqrt(l)), gamma = sqrt(6 / (d_in + d_out)),
alpha in [0, 1] (1.0 in the paper). Biases 0, norms 1/0, embeddings untouched.

``--ds-init-variant code`` is the released TF code (bzhangGo/zero): every variable of layer l is
drawn by ``tf.variance_scaling_initializer(initializer_gain * (l)^-0.5, mode="fan_avg",
distribution="uniform")`` (models/transformer.py lines 38-42 and 124-128, models/transformer_aan.py
lines 43-47 and 157-161), i.e. U(+-gamma * sqrt(alpha) * l^(-1/4)) with gamma from the *variable's*
fans. The variables are not fairseq's: a self-attention's q, k and v are one d x 3d matrix there
(func.py line 196, ``linear(query, hidden_size * 3, scope="qkv_map")``), so their fan_avg is 2d and
their bound sqrt(2) smaller than that of three d x d matrices. Cross-attention q/k/v (func.py lines
207-212), the output map, the FFN and the AAN gate are separate matrices there as here.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from fairseq.modules import MultiheadAttention

from ..modules.init import apply_baseline
from ..modules.stacks import iter_layers
from .exporting import EXPORT_NEUTRAL
from .record import InitScheme, Method, Option


def ds_init_bound(d_in: int, d_out: int, layer: int, alpha: float = 1.0, variant: str = "paper") -> float:
    """The uniform bound of a ``d_in x d_out`` weight in layer ``layer`` (1-based)."""
    gamma = math.sqrt(6.0 / (d_in + d_out))
    if variant == "paper":
        return gamma * alpha / math.sqrt(layer)
    if variant == "code":
        return gamma * math.sqrt(alpha) * layer**-0.25
    raise ValueError(f"unknown DS-Init variant {variant!r}; choose paper or code")


def fused_self_attention_projections(layer: nn.Module) -> list[nn.Linear]:
    """The q/k/v projections that the released code holds as one fused ``qkv_map`` (d x 3d).

    Those of every self-attention in ``layer`` (``self_attention=True``); a value projection that is
    also an encoder-decoder attention's (MAtt's shared W_v) keeps the cross-attention's separate fans.
    """
    cross_v = {
        id(m.v_proj) for m in layer.modules() if isinstance(m, MultiheadAttention) and m.encoder_decoder_attention
    }
    out = []
    for m in layer.modules():
        if isinstance(m, MultiheadAttention) and m.self_attention:
            out += [p for p in (m.q_proj, m.k_proj, m.v_proj) if id(p) not in cross_v]
    return out


@torch.no_grad()
def apply_dsinit(model: nn.Module, p, spec) -> None:
    apply_baseline(model)  # zero biases, as the baseline
    alpha, variant = p.ds_init_alpha, p.ds_init_variant
    for _stack, depth, layer in iter_layers(model):
        for m in layer.modules():
            if isinstance(m, nn.Linear):
                b = ds_init_bound(m.in_features, m.out_features, depth, alpha, variant)
                nn.init.uniform_(m.weight, -b, b)
        if variant == "code":
            for proj in fused_self_attention_projections(layer):
                b = ds_init_bound(proj.in_features, 3 * proj.out_features, depth, alpha, variant)
                nn.init.uniform_(proj.weight, -b, b)


def _alpha_problem(alpha: float) -> str | None:
    return None if 0.0 <= alpha <= 1.0 else f"--ds-init-alpha must lie in [0, 1] (DS-Init eq. 15), got {alpha}"


METHOD = Method(
    name="dsinit",
    title="DS-Init",
    paper="Zhang, Titov & Sennrich 2019, eq. 15",
    summary="U(+-gamma alpha / sqrt(l)) per layer depth l (`code`: the released TF code's "
    "gamma sqrt(alpha) l^-1/4 with its fused q/k/v fans)",
    code="bzhangGo/zero models/transformer.py:38-42,124-128",
    enabled_by="init_scheme=ds-init",
    options=(
        Option(
            "ds_init_variant",
            str,
            "paper",
            "ds-init: 'paper' bound gamma*alpha/sqrt(l) (eq. 15, default) or the released "
            "code's gamma*sqrt(alpha)*l^(-1/4)",
            choices=("paper", "code"),
        ),
        Option("ds_init_alpha", float, 1.0, "ds-init: alpha in [0, 1] (default 1.0)", check=_alpha_problem),
    ),
    init_schemes=(
        InitScheme(
            "ds-init",
            apply_dsinit,
            "DS-Init (Zhang et al. 2019): U(+-gamma*alpha/sqrt(l)) per layer depth l",
            depth_scaled="DS-Init draws layer l's weights within 1/sqrt(l) of xavier's bound",
            two_matrix_ffn="DS-Init's variance argument (Zhang et al. 2019, sec. 4) passes one ReLU between fc1 and "
            "fc2; the product of a gated FFN's two projections has another variance",
        ),
    ),
    describe=lambda p: f"ds-init={p.ds_init_variant},alpha={p.ds_init_alpha}",
    families={"dsinit": dict(init_scheme="ds-init")},
    export=EXPORT_NEUTRAL,  # an init scheme
)
