"""fairseq's Transformer layers with the plugin's axes plugged into fairseq's own hooks.

Nothing here re-implements a forward pass: the layers keep fairseq's ``forward`` and change
only what fairseq exposes for extension:

- the sub-layer norms (``self_attn_layer_norm``, ``encoder_attn_layer_norm``,
  ``final_layer_norm``) are swapped for ``--norm-type`` after construction; their position
  (Post-LN "v1" / Pre-LN "v2", Xu et al. 2020 eq. 1-2) is fairseq's ``--*-normalize-before``;
- ``residual_connection(x, residual)`` dispatches to one :mod:`~fairseq_deepinit.residual`
  module per sub-layer (DeepNorm, ReZero, Admin);
- ``build_fc2`` / attention builders drop biases for the bias-free Lipschitz variant.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Type

import torch
import torch.nn as nn
from fairseq.modules.transformer_layer import (
    TransformerDecoderLayerBase,
    TransformerEncoderLayerBase,
)

from .attention import build_attention
from .norms import build_norm
from .residual import LayerInputResidual, build_residuals


def drop_bias(linear: nn.Module) -> None:
    """Make ``linear`` bias-free without breaking fairseq's fused attention call.

    fairseq's MultiheadAttention concatenates ``q/k/v_proj.bias`` for
    ``F.multi_head_attention_forward`` and fails on ``None``; a zero *buffer* keeps that call
    working while leaving no trainable (and no unused) bias parameter.
    """
    inner = getattr(linear, "module", linear)  # quant-noise wraps nothing here, but be safe
    bias = inner.bias
    if bias is None or not isinstance(bias, nn.Parameter):
        return
    del inner.bias
    inner.register_buffer("bias", torch.zeros_like(bias.data), persistent=False)


# run at the end of every layer's setup, in registration order: fn(layer, cfg); features that add
# modules to fairseq's layers (Sub-LN, NormFormer) register here
LayerSetupHook = Callable[[nn.Module, object], None]
LAYER_SETUP_HOOKS: List[LayerSetupHook] = []


def register_layer_setup_hook(hook: LayerSetupHook) -> None:
    LAYER_SETUP_HOOKS.append(hook)


class DeepInitLayerMixin:
    """Shared post-construction setup and residual dispatch of encoder and decoder layers."""

    stack: str = ""
    residuals: nn.ModuleDict
    _sublayer_names: List[str]
    _norm_attrs: tuple = ()

    def _setup_axes(self, cfg, layer_idx: int, sublayers: tuple) -> None:
        self.layer_idx = layer_idx  # 1-based depth within the stack (DS-Init's l)
        for attr in self._norm_attrs:
            if getattr(self, attr, None) is not None:
                setattr(self, attr, build_norm(cfg.norm_type, self.embed_dim, cfg.norm_eps, cfg.export))
        self.residuals = build_residuals(cfg, self.stack, sublayers, layer_idx)
        self._sublayer_names = list(sublayers)
        self._next_sublayer = 0
        if getattr(cfg, "lipschitz_bias_free", None):
            # Xu et al. 2020, released code ("ease_optimization"): no bias in q/k/v/out and fc2
            for attn_name in ("self_attn", "encoder_attn"):
                attn = getattr(self, attn_name, None)
                if attn is not None:
                    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                        drop_bias(getattr(attn, proj))
            drop_bias(self.fc2)
        for hook in LAYER_SETUP_HOOKS:
            hook(self, cfg)

    # fairseq's layer __init__ builds its attentions through these hooks; --attention-impl picks the forward
    def build_self_attention(self, embed_dim, cfg, **kwargs):
        return build_attention(super().build_self_attention(embed_dim, cfg, **kwargs), cfg)

    def build_encoder_attention(self, embed_dim, cfg):
        return build_attention(super().build_encoder_attention(embed_dim, cfg), cfg)

    def _start_forward(self, names: List[str]) -> None:
        self._sublayer_names = names
        self._next_sublayer = 0

    def residual_connection(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        index = self._next_sublayer
        name = self._sublayer_names[index]
        self._next_sublayer += 1
        module = self.residuals[name]
        if index == 0:
            self._layer_input = residual  # the first sub-layer's skip input is the layer's input
        if isinstance(module, LayerInputResidual):
            out = module(x, residual, self._layer_input)
        else:
            out = module(x, residual)
        if self._next_sublayer == len(self._sublayer_names):
            self._layer_input = None  # no reference to a finished forward's tensor
        return out


class DeepInitEncoderLayer(DeepInitLayerMixin, TransformerEncoderLayerBase):
    """fairseq's encoder layer; sub-layers ``self_attn`` and ``ffn``."""

    stack = "encoder"
    SUBLAYERS = ("self_attn", "ffn")
    _norm_attrs = ("self_attn_layer_norm", "final_layer_norm")

    def __init__(self, cfg, layer_idx: int, return_fc: bool = False) -> None:
        super().__init__(cfg, return_fc=return_fc)
        self._setup_axes(cfg, layer_idx, self.SUBLAYERS)

    def forward(self, x, encoder_padding_mask: torch.Tensor | None, attn_mask=None):
        self._start_forward(list(self.SUBLAYERS))
        return super().forward(x, encoder_padding_mask, attn_mask=attn_mask)

    def residual_connection(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        w_resid = getattr(self, "w_resid", None)
        if w_resid is not None and self._sublayer_names[self._next_sublayer] == "ffn":
            residual = w_resid * residual  # NormFormer's ResScale, as fairseq's decoder layer applies it
        return super().residual_connection(x, residual)


class DeepInitDecoderLayer(DeepInitLayerMixin, TransformerDecoderLayerBase):
    """fairseq's decoder layer; sub-layers ``self_attn``, ``encoder_attn`` and ``ffn``."""

    stack = "decoder"
    SUBLAYERS = ("self_attn", "encoder_attn", "ffn")
    _norm_attrs = ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")

    def __init__(self, cfg, layer_idx: int, no_encoder_attn: bool = False) -> None:
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)
        subs = tuple(s for s in self.SUBLAYERS if not (no_encoder_attn and s == "encoder_attn"))
        self._setup_axes(cfg, layer_idx, subs)

    def forward(self, x, encoder_out=None, encoder_padding_mask=None, incremental_state=None, *args, **kwargs):
        # fairseq skips cross-attention when there is no encoder output
        skip_cross = self.encoder_attn is None or encoder_out is None
        self._start_forward([s for s in self.residuals.keys() if not (skip_cross and s == "encoder_attn")])
        return super().forward(x, encoder_out, encoder_padding_mask, incremental_state, *args, **kwargs)


# ``--decoder-layer-type`` registry: name -> layer class taking (cfg, layer_idx, no_encoder_attn)
DECODER_LAYER_TYPES: Dict[str, Type[nn.Module]] = {"standard": DeepInitDecoderLayer}


def register_decoder_layer_type(name: str, cls: Type[nn.Module]) -> None:
    if name in DECODER_LAYER_TYPES:
        raise ValueError(f"decoder layer type {name!r} is already registered")
    DECODER_LAYER_TYPES[name] = cls
