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
  508-514; :class:`~fairseq_deepinit.modules.layers.DeepInitLayer`): ``c_attn`` (one learned scale per
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

from ..errors import DeepInitConfigError
from ..modules.stacks import ENCODER
from .record import Method, Option, missing_pre_ln_flags

NORMFORMER_FLAGS = ("scale_attn", "scale_fc", "scale_heads", "scale_resids")


def setup_normformer_layer(layer: nn.Module, cfg) -> None:
    """Layer set-up: NormFormer's modules on the encoder, ``--norm-type`` on both stacks' norms.

    Only builds parameters and modules, under fairseq's decoder-layer names; the layers' forwards
    apply them (:class:`~fairseq_deepinit.modules.layers.DeepInitLayer`).
    """
    if not any(getattr(cfg, name, False) for name in NORMFORMER_FLAGS):
        return
    d = layer.embed_dim
    ffn_dim = layer.fc1.out_features
    if layer.kind == ENCODER:
        # registered in the order of earlier versions (c_attn, w_resid, then the norms): fairseq's
        # optimizer state follows parameter order, so resuming their checkpoints keeps working
        layer.c_attn = nn.Parameter(torch.ones(layer.nh)) if cfg.scale_heads else None
        layer.w_resid = nn.Parameter(torch.ones(d)) if cfg.scale_resids else None
    if cfg.scale_attn:
        layer.attn_ln = layer.build_norm(d)
    if cfg.scale_fc:
        layer.ffn_layernorm = layer.build_norm(ffn_dim)


def validate_normformer_args(args) -> None:
    given = [n for n in NORMFORMER_FLAGS if getattr(args, n)]
    if not given:
        return
    flags = " ".join("--" + n.replace("_", "-") for n in given)
    if args.norm_type == "none" and (args.scale_attn or args.scale_fc):
        raise DeepInitConfigError(f"{flags}: NormFormer adds norms and --norm-type none removes them; drop one")
    missing = missing_pre_ln_flags(args)
    if missing:
        raise DeepInitConfigError(
            f"{flags}: NormFormer is defined on Pre-LN; add {missing} (the normformer_* architectures set them)"
        )
    if args.residual_scale != "none":
        raise DeepInitConfigError(f"{flags} keep the plain residual; drop --residual-scale {args.residual_scale}")
    if args.decoder_layer_type != "standard":
        raise DeepInitConfigError(f"{flags} apply to the standard layer; drop --decoder-layer-type")
    if args.init_scheme in ("t-fixup", "rezero"):
        raise DeepInitConfigError(f"{flags} add norms that --init-scheme {args.init_scheme} removes; drop one")


def describe_normformer(args) -> str:
    on = [n for n in NORMFORMER_FLAGS if getattr(args, n)]
    return "normformer=" + "+".join(on) if on else ""


METHOD = Method(
    name="normformer",
    title="NormFormer (both stacks)",
    paper="Shleifer et al. 2021, sec. 2, Fig. 1",
    summary="Pre-LN plus a norm on each self-attention's output, a norm before fc2, a learned scale per head "
    "(and per-dimension residual scale)",
    code="fairseq 0.12 fairseq/modules/transformer_layer.py:277-325,460-466,508-514",
    options=tuple(
        Option(name, bool, False, what + "; both stacks")
        for name, what in (
            ("scale_attn", "a norm on each self-attention's output (NormFormer)"),
            ("scale_fc", "a norm on each FFN's hidden layer, before fc2 (NormFormer)"),
            ("scale_heads", "a learned scale per attention head (NormFormer's HeadScale, fairseq's layout)"),
            ("scale_resids", "a learned per-dimension scale on each FFN's residual (NormFormer's ResScale)"),
        )
    ),
    validate=validate_normformer_args,
    describe=describe_normformer,
    layer_setup=setup_normformer_layer,
    families={
        # NormFormer's paper configuration: the three extra operations (ResScale is its small-model option)
        "normformer": dict(
            init_scheme="xavier",
            scale_attn=True,
            scale_fc=True,
            scale_heads=True,
            encoder_normalize_before=True,
            decoder_normalize_before=True,
        ),
    },
)
