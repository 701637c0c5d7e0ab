"""DeepNorm (Wang et al. 2022, "DeepNet: Scaling Transformers to 1,000 Layers", eq. (2), Table 1):
``--init-scheme deepnorm`` (with ``--residual-scale deepnorm``, Post-LN), ``--deepnorm-variant``.

From the baseline, v_proj, out_proj, fc1 and fc2 of every layer ~ xavier_normal with gain
beta_enc = 0.87 (N^4 M)^(-1/16) (encoder) or beta_dec = (12 M)^(-1/4) (decoder, both attentions),
and q_proj, k_proj ~ xavier_normal with gain 1 (the paper's Figure 2 pseudocode, ``deepnorm_init``);
the residual is ``LN(alpha * x + f(x))`` (``--residual-scale deepnorm``, Post-LN) with
alpha_enc = 0.81 (N^4 M)^(1/16), alpha_dec = (3 M)^(1/4). N = encoder, M = decoder layers. A
decoder-only layer (``layer.kind``, :mod:`~fairseq_deepinit.modules.stacks`) takes Table 1's
decoder-only row: beta = (8M)^(-1/4), alpha = (2M)^(1/4).

``--deepnorm-variant torchscale`` reproduces the init of DeepNet's released code instead
(microsoft/torchscale @ 4d1e0e8): the layers' q/k/v/out projections and fc1/fc2 keep PyTorch's
``nn.Linear`` default init (weights and biases U(+-1/sqrt(fan_in)); torchscale's
``MultiheadAttention.reset_parameters`` with its xavier gains, component/multihead_attention.py:61-66,
is defined but never called), then every weight *and bias* of fc1, fc2, out_proj and v_proj is
divided by ``init_scale`` (architecture/encoder.py:235-252, decoder.py:286-298), by the layer's kind::

    encoder (encoder-decoder):          init_scale = (N^4 M)^(1/16) / 1.15    encoder.py:236-242
    decoder with cross-attention:       init_scale = (12 M)^(1/4)             decoder.py:287-288
    decoder-only:                       init_scale = (8 M)^(1/4)              decoder.py:289-290

i.e. an encoder gain 1.15 (N^4 M)^(-1/16), 1.15/0.87 = 1.32 times the paper's beta_enc, on a base
init that differs per projection (fc2's fan-in is the FFN width). The residual alpha is the same
in both variants (encoder.py:78-85, decoder.py:89-91). Embeddings and norms keep the plugin's baseline.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..modules.init import apply_baseline
from ..modules.residual import ConstantResidual
from ..modules.stacks import DECODER, DECODER_ONLY, ENCODER, StackKind, iter_layers
from .exporting import EXPORT_NEUTRAL, folds
from .record import WITH_NORM, InitScheme, Method, Option, ResidualScaling, post_ln


def deepnorm_alpha(kind: StackKind, encoder_layers: int, decoder_layers: int) -> float:
    """DeepNet (Wang et al. 2022) Table 1: the residual alpha of a layer of ``kind``.

    Encoder-decoder: alpha_enc = 0.81 (N^4 M)^(1/16), alpha_dec = (3M)^(1/4); decoder-only:
    (2M)^(1/4) (torchscale @ 4d1e0e8, architecture/encoder.py:78-87, decoder.py:89-93).
    """
    n, m = encoder_layers, decoder_layers
    if kind == ENCODER:
        return 0.81 * (n**4 * m) ** (1.0 / 16)
    if kind == DECODER:
        return (3.0 * m) ** 0.25
    if kind == DECODER_ONLY:
        return (2.0 * m) ** 0.25
    raise ValueError(f"DeepNorm has no constants for a {kind} layer")


def deepnorm_beta(kind: StackKind, encoder_layers: int, decoder_layers: int) -> float:
    """DeepNet (Wang et al. 2022) Table 1: the init gain beta of a layer of ``kind``.

    Encoder-decoder: beta_enc = 0.87 (N^4 M)^(-1/16), beta_dec = (12M)^(-1/4); decoder-only:
    (8M)^(-1/4).
    """
    n, m = encoder_layers, decoder_layers
    if kind == ENCODER:
        return 0.87 * (n**4 * m) ** (-1.0 / 16)
    if kind == DECODER:
        return (12.0 * m) ** -0.25
    if kind == DECODER_ONLY:
        return (8.0 * m) ** -0.25
    raise ValueError(f"DeepNorm has no constants for a {kind} layer")


def torchscale_init_scale(kind: StackKind, encoder_layers: int, decoder_layers: int) -> float:
    """torchscale's DeepNorm divisor for a layer of ``kind`` (encoder.py:236-242, decoder.py:287-290)."""
    if kind == ENCODER:
        return (encoder_layers**4 * decoder_layers) ** (1.0 / 16) / 1.15
    if kind == DECODER:
        return (12.0 * decoder_layers) ** 0.25
    if kind == DECODER_ONLY:
        return (8.0 * decoder_layers) ** 0.25
    raise ValueError(f"torchscale's DeepNorm has no divisor for a {kind} layer")


def _torchscale_targets(layer: nn.Module) -> tuple:
    """(every projection torchscale builds as a default nn.Linear, those it divides by init_scale)."""
    linears, divided = [layer.fc1, layer.fc2], [layer.fc1, layer.fc2]
    for attn in (getattr(layer, "self_attn", None), getattr(layer, "encoder_attn", None)):
        if attn is not None:
            linears += [attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj]
            divided += [attn.v_proj, attn.out_proj]
    own_v = layer.own_value_projections()
    return linears + own_v, divided + own_v


@torch.no_grad()
def apply_deepnorm_torchscale(model: nn.Module, spec) -> None:
    """torchscale's DeepNorm init (see the module docstring)."""
    apply_baseline(model)
    for _stack, _l, layer in iter_layers(model):
        scale = torchscale_init_scale(layer.kind, spec.layers("encoder"), spec.layers("decoder"))
        linears, divided = _torchscale_targets(layer)
        for lin in linears:
            nn.Linear.reset_parameters(lin)  # kaiming_uniform(a=sqrt(5)) weight, U(+-1/sqrt(fan_in)) bias
        for lin in divided:
            lin.weight.div_(scale)
            if isinstance(lin.bias, nn.Parameter):
                lin.bias.div_(scale)


@torch.no_grad()
def apply_deepnorm(model: nn.Module, p, spec) -> None:
    if p.deepnorm_variant == "torchscale":
        apply_deepnorm_torchscale(model, spec)
        return
    apply_baseline(model)
    for _stack, _l, layer in iter_layers(model):
        beta = deepnorm_beta(layer.kind, spec.layers("encoder"), spec.layers("decoder"))
        targets = [layer.fc1, layer.fc2]
        for attn in (getattr(layer, "self_attn", None), getattr(layer, "encoder_attn", None)):
            if attn is not None:
                targets += [attn.v_proj, attn.out_proj]
                # Figure 2: q, k are xavier_normal with gain 1 (not the baseline's uniform 1/sqrt(2))
                nn.init.xavier_normal_(attn.q_proj.weight, gain=1.0)
                nn.init.xavier_normal_(attn.k_proj.weight, gain=1.0)
        targets += layer.own_value_projections()
        for lin in targets:
            nn.init.xavier_normal_(lin.weight, gain=beta)


METHOD = Method(
    name="deepnorm",
    title="DeepNorm",
    paper="Wang et al. 2022 (DeepNet), eq. (2), Table 1, Fig. 2",
    summary="`LN(alpha x + f(x))` with alpha by depth, init gain beta on v/out/FFN (Post-LN); `torchscale`: the "
    "released code's nn.Linear init divided by its init_scale",
    code="microsoft/torchscale @ 4d1e0e8 architecture/encoder.py:78-89,235-252, decoder.py:89-95,286-298",
    enabled_by="init_scheme=deepnorm",
    options=(
        Option(
            "deepnorm_variant",
            str,
            "paper",
            "deepnorm: the DeepNet paper's init (Table 1, Figure 2; default) or torchscale's released code "
            "(nn.Linear default init divided by (N^4 M)^(1/16)/1.15 and (12M)^(1/4), decoder-only (8M)^(1/4); "
            "docs/schemes.md)",
            choices=("paper", "torchscale"),
        ),
    ),
    init_schemes=(
        InitScheme(
            "deepnorm",
            apply_deepnorm,
            "DeepNorm (Wang et al. 2022): residual alpha and init gain beta, Post-LN",
            allowed_norms=WITH_NORM,
            norm_reason="DeepNorm is a Post-LN scheme",
            residual="deepnorm",
            requires=(post_ln(),),
            depth_scaled="DeepNorm's init gain beta shrinks with depth",
            two_matrix_ffn="DeepNorm's beta (Wang et al. 2022, sec. 4) bounds the model update with the FFN as two "
            "matrices fc1, fc2 scaled by beta; a gated FFN's product of two projections is not in that bound",
        ),
    ),
    residual_scalings=(
        ResidualScaling(
            "deepnorm",
            lambda stack, sublayer, p: ConstantResidual(stack.residual_constant),
            "alpha * x + f(x), alpha by the layer's kind (DeepNet Table 1)",
            requires=(post_ln(),),
            constant=lambda p, kind, encoder_layers, decoder_layers: deepnorm_alpha(
                kind, encoder_layers, decoder_layers
            ),
            export=folds("DeepNorm's alpha (as Admin's omega)", "constant-omega", "omega"),
        ),
    ),
    describe=lambda p: f"deepnorm-variant={p.deepnorm_variant}",
    export=EXPORT_NEUTRAL,  # the variant picks the init and alpha; the fold reads alpha from the built model
    families={
        "deepnorm": dict(init_scheme="deepnorm"),
        # torchscale's DeepNorm constants
        "deepnorm_torchscale": dict(init_scheme="deepnorm", deepnorm_variant="torchscale"),
    },
)
