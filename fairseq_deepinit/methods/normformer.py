"""NormFormer (Shleifer et al. 2021, "NormFormer: Improved Transformer Pretraining with Extra
Normalization", sec. 2, Figure 1) on the translation model, both stacks: fairseq's own options
``--scale-attn``, ``--scale-fc``, ``--scale-heads``, ``--scale-resids``, which fairseq 0.12 exposes only
for ``transformer_lm`` (fairseq/models/transformer_lm.py:198-212) and builds only in its decoder layer.

- decoder: fairseq's ``TransformerDecoderLayerBase`` builds them itself
  (fairseq/modules/transformer_layer.py:277-325); the plugin passes the flags through and gives
  ``attn_ln`` / ``ffn_layernorm`` the ``--norm-type`` (the layer set-up below);
- encoder: fairseq's encoder layer has none of them, so the layer set-up adds the same modules under the
  same names;
- both: the layers' forwards apply them as fairseq's decoder layer does (its lines 460-466 and
  508-514; :class:`~fairseq_deepinit.modules.layer_base.DeepInitLayer`): ``c_attn`` (one learned scale per
  head) and ``attn_ln`` on the self-attention's output, ``ffn_layernorm`` before fc2, ``w_resid`` on the
  FFN's residual::

      x = x + dropout(attn_ln(c_attn * SelfAttn(LN(x))))
      x = w_resid * x + dropout(fc2(ffn_layernorm(act(fc1(LN(x))))))

  ``c_attn`` is applied, as in fairseq (transformer_layer.py:460-463), to the heads of the attention's
  *output projection* (the paper's HeadScale scales the heads before it; fairseq's layout is kept so
  that both stacks and fairseq's LM agree).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..modules.stacks import ENCODER
from .exporting import never
from .record import INIT, Method, Option, Rule, a_norm, plain_residual, pre_ln, standard_layer

NORMFORMER_FLAGS = ("scale_attn", "scale_fc", "scale_heads", "scale_resids")


def setup_normformer_layer(layer: nn.Module, p, spec) -> None:
    """Layer set-up: NormFormer's modules on the encoder, ``--norm-type`` on both stacks' norms.

    Only builds parameters and modules, under fairseq's decoder-layer names; the layers' forwards
    apply them (:class:`~fairseq_deepinit.modules.layer_base.DeepInitLayer`).
    """
    d = layer.embed_dim
    ffn_dim = layer.fc1.out_features
    if layer.kind == ENCODER:
        # registered in the order of earlier versions (c_attn, w_resid, then the norms): fairseq's
        # optimizer state follows parameter order, so resuming their checkpoints keeps working
        layer.c_attn = nn.Parameter(torch.ones(layer.nh)) if p.scale_heads else None
        layer.w_resid = nn.Parameter(torch.ones(d)) if p.scale_resids else None
    if p.scale_attn:
        layer.attn_ln = layer.build_norm(d)
    if p.scale_fc:
        layer.ffn_layernorm = layer.build_norm(ffn_dim)


METHOD = Method(
    name="normformer",
    title="NormFormer (both stacks)",
    paper="Shleifer et al. 2021, sec. 2, Fig. 1",
    summary="Pre-LN plus a norm on each self-attention's output, a norm before fc2, a learned scale per head "
    "(and per-dimension residual scale)",
    code="fairseq 0.12 fairseq/modules/transformer_layer.py:277-325,460-466,508-514",
    enabled_by=NORMFORMER_FLAGS,
    options=tuple(
        Option(name, bool, False, what + "; both stacks")
        for name, what in (
            ("scale_attn", "a norm on each self-attention's output (NormFormer)"),
            ("scale_fc", "a norm on each FFN's hidden layer, before fc2 (NormFormer)"),
            ("scale_heads", "a learned scale per attention head (NormFormer's HeadScale, fairseq's layout)"),
            ("scale_resids", "a learned per-dimension scale on each FFN's residual (NormFormer's ResScale)"),
        )
    ),
    requires=(
        a_norm("add{s} norms", when=("scale_attn", "scale_fc")),
        pre_ln(),
        plain_residual("keep{s} the plain residual x + f(x)"),
        standard_layer("appl{ies} to the standard layer"),
    ),
    excludes=(Rule(INIT, ("t-fixup", "rezero"), "NormFormer adds norms, which the scheme removes"),),
    tags={
        "ffn-inner-norm": ("scale_fc",),
        "branch-norm": ("scale_attn", "scale_fc"),
        "residual-scale": ("scale_resids",),
    },
    describe=lambda p: "normformer=" + "+".join(n for n in NORMFORMER_FLAGS if p[n]),
    layer_setup=setup_normformer_layer,
    export=never(
        "NormFormer (--scale-attn/--scale-fc/--scale-heads/--scale-resids) adds norms and scales inside the "
        "sub-layers, which neither target has"
    ),
    families={
        # NormFormer's paper configuration: the three extra operations (ResScale is its small-model option)
        "normformer": dict(
            init_scheme="xavier",
            scale_attn=True,
            scale_fc=True,
            scale_heads=True,
            norm_placement="pre",
        ),
    },
)
