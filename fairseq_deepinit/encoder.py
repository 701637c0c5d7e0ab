"""The ``deepinit`` encoder: fairseq's ``TransformerEncoderBase`` with the plugin's layers and norms, and its
stack forward (the one place the encoder loops over its layers).

fairseq's ``forward_scriptable`` re-reads ``has_pads`` (a device tensor) once per layer
(fairseq ``transformer_encoder.py:205-216, 229-232``): :meth:`DeepInitEncoder.forward_scriptable` gives
every layer the padding mask instead, as fairseq itself does on XLA for the same reason. The values every
real (non-pad) position gets, the loss and the gradients are fairseq's. A second stream (``dual_stream``,
ResiDual: :mod:`.modules.dual_stream`) starts at the embedding output, goes through every layer call and the
final ``layer_norm``. Under hyper-connections (``streams``, :mod:`.modules.hyper`) the embedding output becomes
``n`` streams ``(T, B, n, d)`` through the layers, contracted to one before the final norm; the hidden states
returned beside the output are contracted too (fairseq's ``(T, B, d)``).
"""

from __future__ import annotations

from typing import Dict, List

import torch
from fairseq.models.transformer import TransformerEncoderBase
from torch import Tensor

from . import plan
from .modules.attn_res import DepthSources
from .modules.dual_stream import DualStream
from .modules.hyper import Streams
from .modules.layers import DeepInitEncoderLayer
from .modules.stacks import ENCODER
from .stack_build import begin_streams, end_streams, hidden, keep_version, replace_stack_norms, wrap_layer


class DeepInitEncoder(TransformerEncoderBase):
    dual_stream: DualStream | None = None  # a second stream beside the layers' (ResiDual), set up by a method
    # n residual streams (hyper-connections) or the depth-wise sources (Attention Residuals), set up by a method
    streams: Streams | DepthSources | None = None

    def __init__(self, cfg, dictionary, embed_tokens, return_fc: bool = False) -> None:
        self._built_layers, self._spec = 0, plan.spec_of(cfg)
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)
        replace_stack_norms(self, self._spec, embed_tokens.embedding_dim)
        plan.setup_stack(self, self._spec, ENCODER)

    def build_encoder_layer(self, cfg):
        self._built_layers += 1
        layer_plan = plan.layer_plan(self._spec, ENCODER, self._built_layers)
        return wrap_layer(cfg, DeepInitEncoderLayer(cfg, layer_plan, return_fc=self.return_fc))

    def upgrade_state_dict_named(self, state_dict, name):
        keep_version(self, state_dict, name)
        return super().upgrade_state_dict_named(state_dict, name)

    def forward_scriptable(
        self,
        src_tokens: Tensor,
        src_lengths: Tensor | None = None,
        return_all_hiddens: bool = False,
        token_embeddings: Tensor | None = None,
    ) -> Dict[str, List[Tensor]]:
        """fairseq's ``TransformerEncoderBase.forward_scriptable`` (transformer_encoder.py:173-266) with
        the padding mask given to every layer, without reading ``has_pads`` on the host.

        fairseq computes ``has_pads = encoder_padding_mask.any()`` (lines 205-210), multiplies the
        embeddings by ``1 - mask * has_pads`` (214-217) and passes ``mask if has_pads else None`` to
        each layer (229-232): a device-to-host read per layer, which also cuts ``torch.compile``'s
        graph at every layer. Here every layer gets the mask, as fairseq does on XLA (its
        ``has_pads`` is forced true there, line 206). An all-false mask changes no value: attention
        masks nothing, and ``x * (1 - mask)`` multiplies by one. ResiDual's second stream: microsoft/ResiDual
        @ 8682f75 ``resi_dual/resi_dual.py:107-131`` (``encoder_states`` are the layers' ``x``, as there).
        """
        encoder_padding_mask = src_tokens.eq(self.padding_idx)
        x, encoder_embedding = self.forward_embedding(src_tokens, token_embeddings)
        # account for padding while computing the representation
        x = x * (1 - encoder_padding_mask.unsqueeze(-1).type_as(x))
        x = x.transpose(0, 1)  # B x T x C -> T x B x C

        encoder_states: List[Tensor] = []
        fc_results: List[Tensor | None] = []
        if return_all_hiddens:
            encoder_states.append(x)
        x, raw = begin_streams(self, x)
        for layer in self.layers:
            if raw is not None:
                x, raw, fc_result = layer(x, encoder_padding_mask=encoder_padding_mask, raw=raw)
            else:
                lr = layer(x, encoder_padding_mask=encoder_padding_mask)
                if isinstance(lr, tuple) and len(lr) == 2:
                    x, fc_result = lr
                else:
                    x, fc_result = lr, None
            if return_all_hiddens:
                encoder_states.append(hidden(self, x))
                fc_results.append(fc_result)
        x = end_streams(self, x, raw)

        src_lengths = src_tokens.ne(self.padding_idx).sum(dim=1, dtype=torch.int32).reshape(-1, 1).contiguous()
        return {
            "encoder_out": [x],  # T x B x C
            "encoder_padding_mask": [encoder_padding_mask],  # B x T
            "encoder_embedding": [encoder_embedding],  # B x T x C
            "encoder_states": encoder_states,  # List[T x B x C]
            "fc_results": fc_results,  # List[T x B x C]
            "src_tokens": [],
            "src_lengths": [src_lengths],
        }
