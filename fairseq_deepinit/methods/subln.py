"""Sub-LN (Magneto; Wang et al. 2022, "Foundation Transformers", sec. 2, Figure 1 and Algorithm 1):
``--subln``, an extra norm inside each sub-layer of a Pre-LN model, and a depth-dependent init gain.

Layer order, as in torchscale's released code (microsoft/torchscale @ 4d1e0e8)::

    self-attention:  x + out_proj(LN_in(Attn(LN(x))))      component/multihead_attention.py:49-53, 166-169
    FFN:             x + fc2(LN_in(act(fc1(LN(x)))))       component/feedforward_network.py:123, 134-139

the inner norm of the FFN over its hidden width; cross-attention gets none (multihead_attention.py:51,
``subln and self.self_attention``). Init: every weight and bias of fc1, fc2, out_proj and v_proj is
multiplied by gamma (architecture/encoder.py:254-270, decoder.py:300-314, the decoder skipping its
cross-attention), gamma by the layer's kind (:mod:`~fairseq_deepinit.modules.stacks`; torchscale's
``is_encoder_decoder``)::

    encoder (encoder-decoder):            gamma = sqrt(ln(3M) ln(2N) / 3)     encoder.py:255-260
    decoder with cross-attention:         gamma = sqrt(ln(3M))                decoder.py:301-302
    decoder-only (no cross-attention):    gamma = sqrt(ln(2M))                decoder.py:303-304

(N, M = encoder, decoder layers). The gain multiplies whatever ``--init-scheme`` set (torchscale's own base init is
nn.Linear's default; ``--init-scheme fairseq`` is the closest). The inner norms follow ``--norm-type``
and ``--norm-eps`` (torchscale: LayerNorm, eps 1e-5); each is the ``norm`` of a
:class:`~fairseq_deepinit.modules.linear.NormedLinear` put in the place of the Linear fairseq built
(``out_proj``, ``fc2``), computing with that Linear's parameters. fairseq's attention calls its output
projection as a module only outside its fused ``F.multi_head_attention_forward`` path, so a Sub-LN
self-attention takes fairseq's explicit path under ``--attention-impl fairseq``; ``--attention-impl
sdpa``'s fused path calls ``out_proj`` as a module too and serves it (same values).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..modules.linear import NormedLinear
from ..modules.stacks import DECODER, DECODER_ONLY, ENCODER, StackKind, iter_layers
from .exporting import never
from .record import FLAG, INIT, TAG, Method, Option, Rule, a_norm, plain_residual, pre_ln, standard_layer


def subln_gain(kind: StackKind, encoder_layers: int, decoder_layers: int) -> float:
    """Sub-LN's init gain gamma for a layer of ``kind`` (encoder.py:255-260, decoder.py:301-304)."""
    if kind == ENCODER:
        return math.sqrt(math.log(3 * decoder_layers) * math.log(2 * encoder_layers) / 3)
    if kind == DECODER:
        return math.sqrt(math.log(3 * decoder_layers))
    if kind == DECODER_ONLY:
        return math.sqrt(math.log(2 * decoder_layers))
    raise ValueError(f"Sub-LN has no gain for a {kind} layer")


def setup_subln_layer(layer: nn.Module, p, spec) -> None:
    """Layer set-up: a norm in front of the self-attention's ``out_proj`` and of the FFN's ``fc2``."""
    embed_dim, ffn_dim = layer.embed_dim, layer.fc1.out_features
    attn = layer.self_attn
    attn.out_proj = NormedLinear.around(attn.out_proj, layer.build_norm(embed_dim))
    # off fairseq's F.multi_head_attention_forward (which never calls out_proj as a module); the SDPA path serves it
    attn.skip_embed_dim_check = True
    layer.fc2 = NormedLinear.around(layer.fc2, layer.build_norm(ffn_dim))


@torch.no_grad()
def apply_subln_gain(model: nn.Module, p, spec) -> None:
    """Post-init: fc1, fc2, self-attention out_proj and v_proj (weights and biases) times gamma."""
    for _stack, _l, layer in iter_layers(model):
        gamma = subln_gain(layer.kind, spec.layers("encoder"), spec.layers("decoder"))
        for lin in (layer.fc1, layer.fc2, layer.self_attn.v_proj, layer.self_attn.out_proj):
            lin.weight.mul_(gamma)
            if isinstance(lin.bias, nn.Parameter):
                lin.bias.mul_(gamma)


METHOD = Method(
    name="subln",
    title="Sub-LN (Magneto)",
    paper="Wang et al. 2022 (Foundation Transformers), sec. 2, Fig. 1, Algorithm 1",
    summary="Pre-LN plus a norm before each self-attention's out_proj and each FFN's fc2; depth-dependent init "
    "gain gamma",
    code="microsoft/torchscale @ 4d1e0e8 component/multihead_attention.py:49-53,166-169, "
    "architecture/encoder.py:254-270, decoder.py:300-314",
    enabled_by="subln",
    options=(
        Option(
            "subln",
            bool,
            False,
            "Sub-LN (Magneto): Pre-LN plus a norm before each self-attention's out_proj and each FFN's fc2, "
            "and torchscale's depth-dependent init gain (docs/schemes.md)",
        ),
    ),
    requires=(
        a_norm("adds norms inside each sub-layer"),
        pre_ln("Pre-LN with extra norms, Magneto"),
        plain_residual("keeps the plain residual x + f(x)"),
        standard_layer("is defined on the standard layer"),
    ),
    excludes=(
        Rule(
            INIT, ("ds-init",), "DS-Init already scales every layer's init by its depth, which its gain would compound"
        ),
        Rule(TAG, ("ffn-inner-norm",), "both put a norm before each FFN's fc2"),
        Rule(TAG, ("bias-free-projections",), "it rebuilds the projections whose biases that drops"),
        Rule(FLAG, ("quant_noise_pq",), "its noise hooks sit on the projections it rebuilds"),
    ),
    tags={"ffn-inner-norm": (), "branch-norm": (), "two-matrix-ffn-init": ()},
    describe=lambda p: "subln",
    layer_setup=setup_subln_layer,
    post_init=apply_subln_gain,
    export=never("--subln (Sub-LN) puts a norm before each out_proj and fc2, which neither target has"),
    families={"subln": dict(init_scheme="fairseq", subln=True, norm_placement="pre")},
)
