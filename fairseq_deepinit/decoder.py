"""The ``deepinit`` decoder: fairseq's ``TransformerDecoderBase`` with the plugin's layers, norms and output
projection, and its stack forward (the one place the decoder loops over its layers); the translation model's
and the language model's.

fairseq's ``extract_features_scriptable`` reads ``prev_output_tokens.eq(pad).any()`` on every call
(``transformer_decoder.py:327-329``): :meth:`DeepInitDecoder.extract_features_scriptable` decides from the
padding side of the targets, a build-time property (:mod:`.modules.padding`). The values every real (non-pad)
position gets, the loss and the gradients are fairseq's. A second stream (``dual_stream``, ResiDual:
:mod:`.modules.dual_stream`) starts at the embedding output, goes through every layer call and the final
``layer_norm``. Under hyper-connections (``streams``, :mod:`.modules.hyper`) the embedding output becomes ``n``
streams ``(T, B, n, d)`` through the layers, contracted to one before the final norm (so ``encoder_out`` keeps
fairseq's ``(S, B, d)``); the hidden states returned beside the output are contracted too.
"""

from __future__ import annotations

from typing import Dict, List

import torch
from fairseq.models.transformer import TransformerDecoderBase
from torch import Tensor

from . import plan
from .modules.attention import declare_target_padding
from .modules.attn_res import DepthSources
from .modules.dual_stream import DualStream
from .modules.fixnorm import FixNormOutputProjection
from .modules.hyper import Streams
from .modules.masks import future_mask
from .modules.stacks import decoder_kind
from .stack_build import begin_streams, end_streams, hidden, keep_version, replace_stack_norms, wrap_layer


class DeepInitDecoder(TransformerDecoderBase):
    """fairseq's decoder with the plugin's layers, norms and output projection.

    ``target_padding``: where the task pads the decoder's input (``right``, ``left``, ``unknown``;
    :func:`~fairseq_deepinit.modules.padding.target_padding`, set by the model's ``build_model``):
    right-padded, its causal self-attention needs no key padding mask (:meth:`self_attn_padding_mask`)
    and its SDPA self-attentions pass ``is_causal``
    (:func:`~fairseq_deepinit.modules.attention.declare_target_padding`).
    """

    target_padding = "unknown"
    dual_stream: DualStream | None = None  # a second stream beside the layers' (ResiDual), set up by a method
    # n residual streams (hyper-connections) or the depth-wise sources (Attention Residuals), set up by a method
    streams: Streams | DepthSources | None = None
    final_logit_cap: float | None = None  # c of the output logits' c tanh(z / c), set up by a method

    def set_target_padding(self, side: str) -> None:
        """Record where the task pads the decoder's input (a build-time fact: no forward reads the tokens)."""
        self.target_padding = side
        declare_target_padding(self, side)

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn: bool = False, output_projection=None) -> None:
        self._built_layers, self._spec = 0, plan.spec_of(cfg)
        super().__init__(
            cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn, output_projection=output_projection
        )
        replace_stack_norms(self, self._spec, self.embed_dim)
        plan.setup_stack(self, self._spec, decoder_kind(cross_attention=not no_encoder_attn))

    def build_decoder_layer(self, cfg, no_encoder_attn: bool = False):
        self._built_layers += 1
        layer_plan = plan.layer_plan(self._spec, decoder_kind(cross_attention=not no_encoder_attn), self._built_layers)
        layer_cls = plan.decoder_layer_class(self._spec)
        return wrap_layer(cfg, layer_cls(cfg, layer_plan, no_encoder_attn=no_encoder_attn))

    def output_layer(self, features: Tensor) -> Tensor:
        """fairseq's output layer, then ``c tanh(z / c)`` on the logits where :attr:`final_logit_cap` is set (in
        float32 or wider, rounded once to the logits' dtype): what the criterion and the sequence generator read."""
        logits = super().output_layer(features)
        if self.final_logit_cap is None or self.adaptive_softmax is not None:  # adaptive softmax: features, refused
            return logits
        c = self.final_logit_cap
        wide = logits if logits.dtype == torch.float64 else logits.float()
        return (c * torch.tanh(wide / c)).to(logits.dtype)

    def buffered_future_mask(self, tensor):
        """fairseq's cached ``triu(-inf, 1)`` (transformer_decoder.py, ``buffered_future_mask``), built by
        :func:`~fairseq_deepinit.modules.masks.future_mask` in ``tensor``'s dtype and device, so that
        the SDPA attention knows it is the causal mask without reading it back (a device sync)."""
        dim = tensor.size(0)
        mask = self._future_mask
        if mask.size(0) < dim or mask.device != tensor.device or mask.dtype != tensor.dtype:
            self._future_mask = mask = future_mask(dim, tensor)
        return mask[:dim, :dim]

    def self_attn_padding_mask(self, prev_output_tokens: Tensor, causal: bool, mask_padding: bool) -> Tensor | None:
        """The key padding mask of the self-attention, decided without reading the tokens on the host.

        fairseq (transformer_decoder.py:327-329) passes ``prev_output_tokens.eq(pad)`` when
        ``.any()`` of it is true (a device-to-host read on every call) or under
        ``--cross-self-attention``. Under causal self-attention with right-padded targets no real
        position can see a padded one (every pad comes after it), so no mask is needed: the values
        of real positions, the loss and the gradients are fairseq's; only padded positions, which
        nothing reads, attend to earlier pads too. Otherwise (left padding, full-context
        alignment, cross-self attention, ``mask_padding``) the mask is always passed: an all-false
        one changes no value.
        """
        if self.cross_self_attention or mask_padding or not (causal and self.target_padding == "right"):
            return prev_output_tokens.eq(self.padding_idx)
        return None

    def extract_features(
        self,
        prev_output_tokens: Tensor,
        encoder_out: Dict[str, List[Tensor]] | None,
        incremental_state: Dict[str, Dict[str, Tensor | None]] | None = None,
        full_context_alignment: bool = False,
        alignment_layer: int | None = None,
        alignment_heads: int | None = None,
        mask_padding: bool = False,
    ):
        """fairseq's ``extract_features``; ``mask_padding``: mask padded targets in the self-attention
        even where real positions never see them (so that padded positions get fairseq's values too:
        Admin profiling takes statistics over every position, padding included, as its released code)."""
        return self.extract_features_scriptable(
            prev_output_tokens,
            encoder_out,
            incremental_state,
            full_context_alignment,
            alignment_layer,
            alignment_heads,
            mask_padding,
        )

    def extract_features_scriptable(
        self,
        prev_output_tokens: Tensor,
        encoder_out: Dict[str, List[Tensor]] | None,
        incremental_state: Dict[str, Dict[str, Tensor | None]] | None = None,
        full_context_alignment: bool = False,
        alignment_layer: int | None = None,
        alignment_heads: int | None = None,
        mask_padding: bool = False,
    ):
        """fairseq's ``TransformerDecoderBase.extract_features_scriptable`` (transformer_decoder.py:254-370)
        with its self-attention padding mask from :meth:`self_attn_padding_mask` (lines 327-329 read it
        on the host on every call). Returns ``(features (B x T x C), {"attn": [...], "inner_states": [...]})``.
        ResiDual's second stream (``resi_dual.py:252-283``) starts at this call's embedding output: per position,
        read by no attention, so an incremental step needs nothing of it cached.
        """
        if alignment_layer is None:
            alignment_layer = self.num_layers - 1

        enc: Tensor | None = None
        padding_mask: Tensor | None = None
        if encoder_out is not None and len(encoder_out["encoder_out"]) > 0:
            enc = encoder_out["encoder_out"][0]
        if encoder_out is not None and len(encoder_out["encoder_padding_mask"]) > 0:
            padding_mask = encoder_out["encoder_padding_mask"][0]

        # embed positions
        positions = None
        if self.embed_positions is not None:
            positions = self.embed_positions(prev_output_tokens, incremental_state=incremental_state)
        if incremental_state is not None:
            prev_output_tokens = prev_output_tokens[:, -1:]
            if positions is not None:
                positions = positions[:, -1:]

        # Prevent torchscript exporting issue for dynamic quant embedding
        prev_output_tokens = prev_output_tokens.contiguous()
        # embed tokens and positions
        x = self.embed_scale * self.embed_tokens(prev_output_tokens)
        if self.quant_noise is not None:
            x = self.quant_noise(x)
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        if positions is not None:
            x += positions
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        x = self.dropout_module(x)
        x = x.transpose(0, 1)  # B x T x C -> T x B x C

        # incremental decoding is causal too (each step sees the steps before it)
        causal = incremental_state is not None or not full_context_alignment
        self_attn_padding_mask = self.self_attn_padding_mask(prev_output_tokens, causal, mask_padding)

        # decoder layers
        attn: Tensor | None = None
        inner_states: List[Tensor | None] = [x]
        x, raw = begin_streams(self, x)
        for idx, layer in enumerate(self.layers):
            if incremental_state is None and not full_context_alignment:
                self_attn_mask = self.buffered_future_mask(x)
            else:
                self_attn_mask = None
            masks = dict(self_attn_mask=self_attn_mask, self_attn_padding_mask=self_attn_padding_mask)
            heads = dict(need_attn=bool(idx == alignment_layer), need_head_weights=bool(idx == alignment_layer))
            if raw is not None:
                x, layer_attn, _, raw = layer(x, enc, padding_mask, incremental_state, **masks, **heads, raw=raw)
            else:
                x, layer_attn, _ = layer(x, enc, padding_mask, incremental_state, **masks, **heads)
            inner_states.append(hidden(self, x))
            if layer_attn is not None and idx == alignment_layer:
                attn = layer_attn.float().to(x)

        if attn is not None:
            if alignment_heads is not None:
                attn = attn[:alignment_heads]
            # average probabilities over heads
            attn = attn.mean(dim=0)
        x = end_streams(self, x, raw)
        x = x.transpose(0, 1)  # T x B x C -> B x T x C
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        return x, {"attn": [attn], "inner_states": inner_states}

    def build_output_projection(self, cfg, dictionary, embed_tokens):
        self.output_projection = plan.build_output_projection(self._spec, embed_tokens)
        if self.output_projection is None:
            super().build_output_projection(cfg, dictionary, embed_tokens)

    def upgrade_state_dict_named(self, state_dict, name):
        """fairseq's upgrade, with the version kept (:func:`~fairseq_deepinit.stack_build.keep_version`), minus its
        pre-0.10 fix-up where it does not apply to FixNorm.

        fairseq copies ``embed_tokens.weight`` into ``output_projection.weight`` whenever that key
        is missing, for checkpoints written before the output projection was a module. The FixNorm
        projection has no weight of its own (it scores against the embedding it holds, stored as
        ``output_projection.embedding.weight``), so that copy would be an unexpected key under
        strict loading; it is dropped again here, and only when fairseq itself added it.
        """
        keep_version(self, state_dict, name)
        key = f"{name}.output_projection.weight"
        had_key = key in state_dict
        state_dict = super().upgrade_state_dict_named(state_dict, name)
        if isinstance(self.output_projection, FixNormOutputProjection) and not had_key:
            state_dict.pop(key, None)
        return state_dict
