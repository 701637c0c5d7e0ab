"""fairseq's Transformer layers with the plugin's axes plugged into fairseq's own hooks.

Nothing here re-implements a forward pass: the layers keep fairseq's ``forward`` and change
only what fairseq exposes for extension:

- the sub-layer norms (``self_attn_layer_norm``, ``encoder_attn_layer_norm``,
  ``final_layer_norm``) are swapped for ``--norm-type`` after construction; their position
  (Post-LN "v1" / Pre-LN "v2", Xu et al. 2020 eq. 1-2) is fairseq's ``--*-normalize-before``;
- ``residual_connection(x, residual)`` dispatches to one :mod:`~fairseq_deepinit.residual`
  module per sub-layer (DeepNorm, ReZero, Admin);
- ``build_fc2`` / attention builders drop biases for the bias-free Lipschitz variant;
- every layer carries its :class:`~.stacks.StackKind` (``layer.kind``: encoder, decoder with
  cross-attention, decoder-only), set here from what the layer is built with; the depth-dependent
  formulas (DeepNorm, Sub-LN, closed-form Admin) read it from the layer;
- NormFormer's four operations (Shleifer et al. 2021) are attributes of both layers, as fairseq's
  decoder layer has them (``c_attn``, ``attn_ln``, ``ffn_layernorm``, ``w_resid``; None when off).
  fairseq applies them in its decoder layer's ``forward`` only (fairseq/modules/transformer_layer.py:
  460-466 and 508-514); an encoder layer with any of them runs that same forward, without
  cross-attention and without a causal mask, so the encoder's NormFormer computation is fairseq's own
  and its parameters are the layer's (a deep copy computes with its own).
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
from .stacks import ENCODER, StackKind, decoder_kind


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

    kind: StackKind
    residuals: nn.ModuleDict
    _sublayer_names: List[str]
    _norm_attrs: tuple = ()

    @property
    def stack(self) -> str:
        """The model attribute holding this layer's stack (``encoder`` / ``decoder``)."""
        return self.kind.stack

    def _setup_axes(self, cfg, layer_idx: int, kind: StackKind, sublayers: tuple) -> None:
        self.layer_idx = layer_idx  # 1-based depth within the stack (DS-Init's l)
        self.kind = kind
        for attr in self._norm_attrs:
            if getattr(self, attr, None) is not None:
                setattr(self, attr, build_norm(cfg.norm_type, self.embed_dim, cfg.norm_eps, cfg.export))
        self.residuals = build_residuals(cfg, kind, sublayers, layer_idx)
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
    """fairseq's encoder layer; sub-layers ``self_attn`` and ``ffn``; NormFormer as fairseq's decoder has it."""

    SUBLAYERS = ENCODER.sublayers
    _norm_attrs = ("self_attn_layer_norm", "final_layer_norm")

    def __init__(self, cfg, layer_idx: int, return_fc: bool = False) -> None:
        super().__init__(cfg, return_fc=return_fc)
        # NormFormer's operations under fairseq's decoder-layer names (transformer_layer.py:277-325);
        # a layer setup hook (modules/normformer.py) builds those that are switched on
        self.c_attn: nn.Parameter | None = None
        self.attn_ln: nn.Module | None = None
        self.ffn_layernorm: nn.Module | None = None
        self.w_resid: nn.Parameter | None = None
        self.nh, self.head_dim = self.self_attn.num_heads, self.self_attn.head_dim
        # what fairseq's decoder-layer forward reads besides those: no cross-attention, no
        # encoder-prefixed self-attention, no ONNX state
        self.encoder_attn = None
        self.cross_self_attention = False
        self.onnx_trace = False
        self._setup_axes(cfg, layer_idx, ENCODER, self.SUBLAYERS)
        if self.return_fc and self.has_normformer():
            raise ValueError("NormFormer's encoder layer runs fairseq's decoder-layer forward, which has no return_fc")

    def has_normformer(self) -> bool:
        """Whether any of NormFormer's operations is on (then fairseq's decoder-layer forward applies them)."""
        return any(m is not None for m in (self.c_attn, self.attn_ln, self.ffn_layernorm, self.w_resid))

    def forward(self, x, encoder_padding_mask: torch.Tensor | None, attn_mask=None):
        self._start_forward(list(self.SUBLAYERS))
        if not self.has_normformer():
            return super().forward(x, encoder_padding_mask, attn_mask=attn_mask)
        if attn_mask is not None:
            # what fairseq's encoder layer does with a boolean mask before its self-attention
            # (transformer_layer.py:189-192); the decoder-layer forward passes masks through as given
            attn_mask = attn_mask.masked_fill(attn_mask.to(torch.bool), -1e8 if x.dtype == torch.float32 else -1e4)
        # fairseq's NormFormer layer forward (transformer_layer.py:384-529): self-attention, then
        # c_attn and attn_ln on its output, ffn_layernorm before fc2, w_resid on the FFN's residual
        x, _attn, _state = TransformerDecoderLayerBase.forward(
            self, x, self_attn_mask=attn_mask, self_attn_padding_mask=encoder_padding_mask
        )
        return x


class DeepInitDecoderLayer(DeepInitLayerMixin, TransformerDecoderLayerBase):
    """fairseq's decoder layer; sub-layers ``self_attn``, ``encoder_attn`` and ``ffn``."""

    _norm_attrs = ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")

    def __init__(self, cfg, layer_idx: int, no_encoder_attn: bool = False) -> None:
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)
        kind = decoder_kind(cross_attention=not no_encoder_attn)
        self._setup_axes(cfg, layer_idx, kind, kind.sublayers)

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
