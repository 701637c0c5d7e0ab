"""fairseq's Transformer layers, built by fairseq's ``__init__`` and ``build_*`` hooks, with a forward per step.

fairseq builds each layer (its attentions through ``build_self_attention`` / ``build_encoder_attention``,
its FFN through ``build_fc1`` / ``build_fc2``, its norms); the plugin then applies the layer's
:class:`~.layer_base.LayerPlan`, which the model computes from the selected methods
(:mod:`fairseq_deepinit.plan`): the sub-layer norms of ``--norm-type``, one residual module per
sub-layer (``layer.residuals``), the layer's norm placement and each method's layer set-up (modules it
adds or replaces; e.g. Sub-LN's inner norms, NormFormer's encoder scales, Lipschitz's bias-free
projections). Nothing here knows a method by name.

The forwards replace fairseq's (``fairseq/modules/transformer_layer.py:163-227`` encoder,
``384-529`` decoder) with the same computation written out per sub-layer (:mod:`.sublayer`)::

    h, skip = residuals[<sub-layer>].enter(x)       # (x, x); hyper-connections: a mix of the streams, the rest
    h = branch(sublayer_input(placement, h, norm)); h = dropout(branch_output(placement, h, norm, out_norm))
    x = sublayer_output(placement, h, skip, norm, residuals[<sub-layer>], layer_input)

so that the residual module of each sub-layer is called by name (fairseq calls one
``residual_connection`` per sum), the placement is a value per layer (``layer.placement``: ``"post"``,
``"pre"``, or Peri-LN's / OLMo 2's ``"peri"`` / ``"reordered"``, whose output norm
:func:`~.sublayer.branch_output` applies before the dropout), and NormFormer's operations (Shleifer et
al. 2021; fairseq's decoder-layer attributes ``c_attn``, ``attn_ln``, ``ffn_layernorm``, ``w_resid``,
None when off) are steps of both layers' forwards, as fairseq's decoder layer has them (lines 460-466,
508-514). The operations, their order and their operands are fairseq's, so the outputs are fairseq's bit
for bit. A stack with a second stream (ResiDual, :mod:`.dual_stream`) passes it as ``raw`` and gets it
back: each sub-layer adds its dropped-out branch output ``h`` to it, after ``h = dropout(h)`` above.

Every layer carries its :class:`~.stacks.StackKind` (``layer.kind``: encoder, decoder with
cross-attention, decoder-only) and its depth ``layer.layer_idx`` (from 1, per stack), from which the
depth-dependent formulas read their constants.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn as nn
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase
from torch import Tensor

from .attention import attention_class
from .layer_base import DeepInitLayer, LayerPlan
from .stacks import ENCODER
from .sublayer import branch_output, sublayer_input, sublayer_output


class DeepInitEncoderLayer(DeepInitLayer, TransformerEncoderLayerBase):
    """fairseq's encoder layer; sub-layers ``self_attn`` and ``ffn``; NormFormer's operations when set up."""

    SUBLAYERS = ENCODER.sublayers
    NORMS = ("self_attn_layer_norm", "final_layer_norm")
    OUT_NORMS = ("self_attn_out_norm", "ffn_out_norm")

    def __init__(self, cfg, plan: LayerPlan, return_fc: bool = False) -> None:
        self._attention_impl = plan.attention_impl  # read by build_self_attention inside fairseq's __init__
        super().__init__(cfg, return_fc=return_fc)
        # NormFormer's operations under fairseq's decoder-layer names (transformer_layer.py:277-325): None
        # unless a method's set-up builds them
        self.c_attn: nn.Parameter | None = None
        self.attn_ln: nn.Module | None = None
        self.ffn_layernorm: nn.Module | None = None
        self.w_resid: nn.Parameter | None = None
        self.nh, self.head_dim = self.self_attn.num_heads, self.self_attn.head_dim
        self._apply_plan(plan, self.SUBLAYERS)

    def build_self_attention(self, embed_dim, cfg):
        """fairseq's encoder self-attention (transformer_layer.py:135-144) in the ``--attention-impl`` class."""
        return attention_class(self._attention_impl)(
            embed_dim,
            cfg.encoder.attention_heads,
            dropout=cfg.attention_dropout,
            self_attention=True,
            q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size,
            xformers_att_config=cfg.encoder.xformers_att_config,
        )

    def forward(
        self, x: Tensor, encoder_padding_mask: Tensor | None, attn_mask: Tensor | None = None, raw: Tensor | None = None
    ):
        """fairseq's ``TransformerEncoderLayerBase.forward`` (transformer_layer.py:163-227), per sub-layer.

        ``raw``: the stack's second stream (ResiDual, :mod:`.dual_stream`), which every sub-layer's
        dropped-out branch output is added to; given one, the layer returns ``(x, raw, fc_result or None)``.
        """
        if attn_mask is not None:
            # fairseq's masked value (lines 184-192): -inf could give NaN rows for padded queries
            attn_mask = attn_mask.masked_fill(attn_mask.to(torch.bool), -1e8 if x.dtype == torch.float32 else -1e4)
        layer_input = x

        h, skip = self.residuals["self_attn"].enter(x)  # (x, x), or the split of n streams (.hyper)
        h = sublayer_input(self.placement, h, self.self_attn_layer_norm, self.input_scale)
        h, _ = self.self_attn(
            query=h, key=h, value=h, key_padding_mask=encoder_padding_mask, need_weights=False, attn_mask=attn_mask
        )
        h = self._normformer_attention_output(h)
        h = branch_output(self.placement, h, self.self_attn_layer_norm, self.self_attn_out_norm)
        h = self.dropout_module(h)
        if raw is not None:
            raw = self.dual_stream.add(raw, h)
        x = sublayer_output(
            self.placement, h, skip, self.self_attn_layer_norm, self.residuals["self_attn"], layer_input
        )

        x, fc_result, raw = self._ffn_sublayer(x, layer_input, raw)
        if raw is not None:
            return x, raw, fc_result if self.return_fc else None
        if self.return_fc and not torch.jit.is_scripting():
            return x, fc_result
        return x


class DeepInitDecoderLayer(DeepInitLayer, TransformerDecoderLayerBase):
    """fairseq's decoder layer; sub-layers ``self_attn``, ``encoder_attn`` (with cross-attention) and ``ffn``."""

    NORMS = ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")
    OUT_NORMS = ("self_attn_out_norm", "encoder_attn_out_norm", "ffn_out_norm")

    def __init__(self, cfg, plan: LayerPlan, no_encoder_attn: bool = False) -> None:
        self._attention_impl = plan.attention_impl
        super().__init__(cfg, no_encoder_attn=no_encoder_attn)
        self._apply_plan(plan, plan.kind.sublayers)

    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        """fairseq's decoder self-attention (transformer_layer.py:350-363) in the ``--attention-impl`` class."""
        return attention_class(self._attention_impl)(
            embed_dim,
            cfg.decoder.attention_heads,
            dropout=cfg.attention_dropout,
            add_bias_kv=add_bias_kv,
            add_zero_attn=add_zero_attn,
            self_attention=not cfg.cross_self_attention,
            q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size,
            xformers_att_config=cfg.decoder.xformers_att_config,
        )

    def build_encoder_attention(self, embed_dim, cfg):
        """fairseq's cross-attention (transformer_layer.py:365-376) in the ``--attention-impl`` class."""
        return attention_class(self._attention_impl)(
            embed_dim,
            cfg.decoder.attention_heads,
            kdim=cfg.encoder.embed_dim,
            vdim=cfg.encoder.embed_dim,
            dropout=cfg.attention_dropout,
            encoder_decoder_attention=True,
            q_noise=self.quant_noise,
            qn_block_size=self.quant_noise_block_size,
            xformers_att_config=cfg.encoder.xformers_att_config,
        )

    def forward(
        self,
        x: Tensor,
        encoder_out: Tensor | None = None,
        encoder_padding_mask: Tensor | None = None,
        incremental_state: Dict[str, Dict[str, Tensor | None]] | None = None,
        prev_self_attn_state: List[Tensor] | None = None,
        prev_attn_state: List[Tensor] | None = None,
        self_attn_mask: Tensor | None = None,
        self_attn_padding_mask: Tensor | None = None,
        need_attn: bool = False,
        need_head_weights: bool = False,
        raw: Tensor | None = None,
    ):
        """fairseq's ``TransformerDecoderLayerBase.forward`` (transformer_layer.py:384-529), per sub-layer;
        returns ``(x, cross-attention weights or None, self-attention state under ONNX tracing or None)``,
        and ``raw`` fourth when given one: the stack's second stream (ResiDual, :mod:`.dual_stream`), which
        every sub-layer's dropped-out branch output is added to."""
        if need_head_weights:
            need_attn = True
        layer_input = x

        # self-attention (fairseq lines 407-473)
        h, skip = self.residuals["self_attn"].enter(x)  # (x, x), or the split of n streams (.hyper)
        h = sublayer_input(self.placement, h, self.self_attn_layer_norm, self.input_scale)
        if prev_self_attn_state is not None:
            self.self_attn._set_input_buffer(incremental_state, _saved_state(prev_self_attn_state))
        kv, self_attn_mask, self_attn_padding_mask = self._self_attention_keys(
            h, encoder_out, encoder_padding_mask, incremental_state, self_attn_mask, self_attn_padding_mask
        )
        h, attn = self.self_attn(
            query=h,
            key=kv,
            value=kv,
            key_padding_mask=self_attn_padding_mask,
            incremental_state=incremental_state,
            need_weights=False,
            attn_mask=self_attn_mask,
        )
        h = self._normformer_attention_output(h)
        h = branch_output(self.placement, h, self.self_attn_layer_norm, self.self_attn_out_norm)
        h = self.dropout_module(h)
        if raw is not None:
            raw = self.dual_stream.add(raw, h)
        x = sublayer_output(
            self.placement, h, skip, self.self_attn_layer_norm, self.residuals["self_attn"], layer_input
        )

        # cross-attention (fairseq lines 475-503), skipped without an encoder output
        if self.encoder_attn is not None and encoder_out is not None:
            h, skip = self.residuals["encoder_attn"].enter(x)  # (x, x), or the split of n streams (.hyper)
            h = sublayer_input(self.placement, h, self.encoder_attn_layer_norm, self.input_scale)
            if prev_attn_state is not None:
                self.encoder_attn._set_input_buffer(incremental_state, _saved_state(prev_attn_state))
            h, attn = self.encoder_attn(
                query=h,
                key=encoder_out,
                value=encoder_out,
                key_padding_mask=encoder_padding_mask,
                incremental_state=incremental_state,
                static_kv=True,
                need_weights=need_attn or (not self.training and self.need_attn),
                need_head_weights=need_head_weights,
            )
            h = branch_output(self.placement, h, self.encoder_attn_layer_norm, self.encoder_attn_out_norm)
            h = self.dropout_module(h)
            if raw is not None:
                raw = self.dual_stream.add(raw, h)
            x = sublayer_output(
                self.placement, h, skip, self.encoder_attn_layer_norm, self.residuals["encoder_attn"], layer_input
            )

        x, _, raw = self._ffn_sublayer(x, layer_input, raw)

        self_attn_state = None
        if self.onnx_trace and incremental_state is not None:  # fairseq lines 515-528
            saved_state = self.self_attn._get_input_buffer(incremental_state)
            assert saved_state is not None
            self_attn_state = [saved_state["prev_key"], saved_state["prev_value"]]
            if self_attn_padding_mask is not None:
                self_attn_state.append(saved_state["prev_key_padding_mask"])
        if raw is not None:
            return x, attn, self_attn_state, raw
        return x, attn, self_attn_state

    def _self_attention_keys(
        self, x, encoder_out, encoder_padding_mask, incremental_state, self_attn_mask, self_attn_padding_mask
    ):
        """Keys/values of the self-attention and its masks: ``x`` itself, or under ``--cross-self-attention``
        the encoder output followed by ``x`` (fairseq transformer_layer.py:420-445)."""
        buffer = self.self_attn._get_input_buffer(incremental_state)
        if not self.cross_self_attention or (
            incremental_state is not None and buffer is not None and "prev_key" in buffer
        ):
            return x, self_attn_mask, self_attn_padding_mask
        if self_attn_mask is not None:
            assert encoder_out is not None
            self_attn_mask = torch.cat((x.new_zeros(x.size(0), encoder_out.size(0)), self_attn_mask), dim=1)
        if self_attn_padding_mask is not None:
            if encoder_padding_mask is None:
                assert encoder_out is not None
                encoder_padding_mask = self_attn_padding_mask.new_zeros(encoder_out.size(1), encoder_out.size(0))
            self_attn_padding_mask = torch.cat((encoder_padding_mask, self_attn_padding_mask), dim=1)
        assert encoder_out is not None
        return torch.cat((encoder_out, x), dim=0), self_attn_mask, self_attn_padding_mask


def _saved_state(prev_state: List[Tensor]) -> Dict[str, Tensor | None]:
    """fairseq's ``prev_*_state`` list as an attention's input buffer (transformer_layer.py:410-418, 479-487)."""
    saved: Dict[str, Tensor | None] = {"prev_key": prev_state[0], "prev_value": prev_state[1]}
    if len(prev_state) >= 3:
        saved["prev_key_padding_mask"] = prev_state[2]
    return saved
