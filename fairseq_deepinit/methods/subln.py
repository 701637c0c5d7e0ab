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

from ..errors import DeepInitConfigError
from ..modules.linear import NormedLinear
from ..modules.stacks import DECODER, DECODER_ONLY, ENCODER, StackKind
from .record import Method, Option, iter_layers, missing_pre_ln_flags

# init schemes with their own depth-dependent scaling or norm removal, which Sub-LN's gain would compound
_SCHEME_CONFLICTS = {
    "t-fixup": "T-Fixup removes the norms Sub-LN adds to and scales the same weights by depth",
    "ds-init": "DS-Init already scales every layer's init by its depth",
    "deepnorm": "DeepNorm is Post-LN with its own depth-dependent init",
    "admin": "Admin is Post-LN",
    "rezero": "ReZero removes the norms",
    "rezero+postln": "ReZero with Post-LN is Post-LN",
}


def subln_gain(kind: StackKind, encoder_layers: int, decoder_layers: int) -> float:
    """Sub-LN's init gain gamma for a layer of ``kind`` (encoder.py:255-260, decoder.py:301-304)."""
    if kind == ENCODER:
        return math.sqrt(math.log(3 * decoder_layers) * math.log(2 * encoder_layers) / 3)
    if kind == DECODER:
        return math.sqrt(math.log(3 * decoder_layers))
    if kind == DECODER_ONLY:
        return math.sqrt(math.log(2 * decoder_layers))
    raise ValueError(f"Sub-LN has no gain for a {kind} layer")


def setup_subln_layer(layer: nn.Module, cfg) -> None:
    """Layer set-up: a norm in front of the self-attention's ``out_proj`` and of the FFN's ``fc2``."""
    if not getattr(cfg, "subln", False):
        return
    embed_dim, ffn_dim = layer.embed_dim, layer.fc1.out_features
    attn = layer.self_attn
    attn.out_proj = NormedLinear.around(attn.out_proj, layer.build_norm(embed_dim))
    # off fairseq's F.multi_head_attention_forward (which never calls out_proj as a module); the SDPA path serves it
    attn.skip_embed_dim_check = True
    layer.fc2 = NormedLinear.around(layer.fc2, layer.build_norm(ffn_dim))


@torch.no_grad()
def apply_subln_gain(model: nn.Module, cfg) -> None:
    """Post-init: fc1, fc2, self-attention out_proj and v_proj (weights and biases) times gamma."""
    if not getattr(cfg, "subln", False):
        return
    for _stack, _l, layer in iter_layers(model):
        gamma = subln_gain(layer.kind, cfg.encoder.layers, cfg.decoder.layers)
        for lin in (layer.fc1, layer.fc2, layer.self_attn.v_proj, layer.self_attn.out_proj):
            lin.weight.mul_(gamma)
            if isinstance(lin.bias, nn.Parameter):
                lin.bias.mul_(gamma)


def validate_subln_args(args) -> None:
    if not args.subln:
        return
    if args.init_scheme in _SCHEME_CONFLICTS:
        raise DeepInitConfigError(
            f"--subln does not combine with --init-scheme {args.init_scheme} ({_SCHEME_CONFLICTS[args.init_scheme]}); "
            "use --init-scheme xavier or fairseq, or drop --subln"
        )
    if args.norm_type == "none":
        raise DeepInitConfigError("--subln adds norms inside each sub-layer; --norm-type none removes them. Drop one.")
    missing = missing_pre_ln_flags(args)
    if missing:
        raise DeepInitConfigError(
            f"--subln is Pre-LN with extra norms (Magneto); add {missing} (the subln_* architectures set them)"
        )
    if args.residual_scale != "none":
        raise DeepInitConfigError(
            f"--subln keeps the plain residual x + f(x); drop --residual-scale {args.residual_scale}"
        )
    if args.decoder_layer_type != "standard":
        raise DeepInitConfigError(
            f"--subln is defined on the standard layer; drop --decoder-layer-type {args.decoder_layer_type}"
        )
    if getattr(args, "scale_fc", False):
        raise DeepInitConfigError("--subln already normalises the FFN's hidden layer; drop --scale-fc")
    if getattr(args, "lipschitz_bias_free", False) or getattr(args, "quant_noise_pq", 0):
        raise DeepInitConfigError("--subln does not combine with --lipschitz-bias-free or --quant-noise-pq; drop one")


METHOD = Method(
    name="subln",
    title="Sub-LN (Magneto)",
    paper="Wang et al. 2022 (Foundation Transformers), sec. 2, Fig. 1, Algorithm 1",
    summary="Pre-LN plus a norm before each self-attention's out_proj and each FFN's fc2; depth-dependent init "
    "gain gamma",
    code="microsoft/torchscale @ 4d1e0e8 component/multihead_attention.py:49-53,166-169, "
    "architecture/encoder.py:254-270, decoder.py:300-314",
    options=(
        Option(
            "subln",
            bool,
            False,
            "Sub-LN (Magneto): Pre-LN plus a norm before each self-attention's out_proj and each FFN's fc2, "
            "and torchscale's depth-dependent init gain (docs/schemes.md)",
        ),
    ),
    validate=validate_subln_args,
    describe=lambda args: "subln" if args.subln else "",
    layer_setup=setup_subln_layer,
    post_init=apply_subln_gain,
    families={
        "subln": dict(init_scheme="fairseq", subln=True, encoder_normalize_before=True, decoder_normalize_before=True)
    },
)
