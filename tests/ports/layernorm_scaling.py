"""LayerNorm Scaling (Sun et al. 2025, "The Curse of Depth in Large Language Models").

Released code: lmsdss/LayerNorm-Scaling (commit 3ac54dd) ``peft_pretraining/modeling_llama.py:427-454``
(``NORM_TYPE=LNS``): a Pre-LN block whose two pre-norm outputs are multiplied by
``scale_factor = 1 / math.sqrt(self.layer_index + 1)`` (``432``, ``449``), ``layer_index`` counted from 0
(``LlamaModel.__init__``: ``LlamaDecoderLayer(config, _idx) for _idx in range(num_hidden_layers)``,
``967``); the final ``self.norm`` (``968``, applied at ``1116``) is not scaled. OLMo-core
``LayerNormScaledTransformerBlock`` (``src/olmo_core/nn/transformer/block.py:232-290``, commit fa6c501)
keeps the factor as a float32 buffer ``1 / sqrt(block_idx + 1)`` cast to the input dtype at every call.

Initialisation in the released training (``_init_weights``, ``857-878``): every ``nn.Linear`` and the
embedding ``normal(0, initializer_range=0.02)`` (``configs/llama_*.json``), no depth scaling. The
depth-scaled variant ``std / sqrt(2 * num_layers)`` for ``o_proj``/``down_proj`` is used only under
``NORM_TYPE=scale_pre`` (``is_scaled_layer``, ``159-160``, ``191-192``): that is the README's
"Scaled Initialization" whose combination with LNS "diminishes the effectiveness of LNS" (README,
"A Quick Word Before You Start", pointing at OLMo's ``mitchell``/``full_megatron`` init).

Encoder-decoder translation (this project's extension): the factor is counted from 1 separately in the
encoder and in the decoder stack, and every pre-norm of a decoder layer (self-attention,
cross-attention, FFN) is scaled by the same ``1/sqrt(l)``; the stacks' final norms are not.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .common import AttnWeights, FFNWeights, Norm, attention, ffn

INIT_STD = 0.02  # configs/llama_*.json: "initializer_range": 0.02


def lns_factor(layer_index: int) -> float:
    """``1 / sqrt(layer_index + 1)`` for a 0-based ``layer_index`` (``modeling_llama.py:432``)."""
    if layer_index < 0:
        raise ValueError("layer_index counts from 0")
    return 1.0 / math.sqrt(layer_index + 1)


def lns_factor_as_olmo_core(layer_index: int, dtype: torch.dtype) -> Tensor:
    """OLMo-core's rounding: a float32 buffer (``block.py:273-274``) cast to the activation dtype (``284``)."""
    return torch.tensor(1.0 / math.sqrt(layer_index + 1), dtype=torch.float32).to(dtype)


def encoder_layer(
    x: Tensor,
    attn_w: AttnWeights,
    ffn_w: FFNWeights,
    norm_attn: Norm,
    norm_ffn: Norm,
    n_heads: int,
    layer_index: int,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """``h = x + Attn(s * N1(x)); out = h + FFN(s * N2(h))`` with ``s = lns_factor(layer_index)``."""
    s = lns_factor(layer_index)
    h = s * norm_attn(x)
    x = x + attention(h, h, attn_w, n_heads, key_padding_mask=key_padding_mask)
    return x + ffn(s * norm_ffn(x), ffn_w)


def decoder_layer(
    x: Tensor,
    encoder_out: Tensor | None,
    self_w: AttnWeights,
    cross_w: AttnWeights | None,
    ffn_w: FFNWeights,
    norm_self: Norm,
    norm_cross: Norm | None,
    norm_ffn: Norm,
    n_heads: int,
    layer_index: int,
    encoder_padding_mask: Tensor | None = None,
) -> Tensor:
    """Decoder-only LM layer (``encoder_out=None``, ``modeling_llama.py:427-454``) or the translation
    decoder layer with a scaled cross-attention pre-norm (project extension)."""
    s = lns_factor(layer_index)
    h = s * norm_self(x)
    x = x + attention(h, h, self_w, n_heads, causal=True)
    if encoder_out is not None:
        x = x + attention(s * norm_cross(x), encoder_out, cross_w, n_heads, key_padding_mask=encoder_padding_mask)
    return x + ffn(s * norm_ffn(x), ffn_w)


def lm_stack(x: Tensor, layers: list[dict], n_heads: int, final_norm: Norm) -> Tensor:
    """Decoder-only stack: layer ``i`` scaled by ``1/sqrt(i+1)``, then the unscaled final norm."""
    for i, p in enumerate(layers):
        x = decoder_layer(x, None, p["attn_w"], None, p["ffn_w"], p["norm_attn"], None, p["norm_ffn"], n_heads, i)
    return final_norm(x)


def init_std(param: str, n_layers: int, scaled_init: bool = False, std: float = INIT_STD) -> float:
    """Std of ``normal(0, std)`` per parameter in the released code (``_init_weights``, ``857-878``).

    ``param`` is ``"embedding"``, ``"q"``, ``"k"``, ``"v"``, ``"o"``, ``"gate"``, ``"up"`` or ``"down"``.
    ``scaled_init=True`` is ``NORM_TYPE=scale_pre`` (the combination the README warns about):
    ``o``/``down`` get ``std / sqrt(2 * n_layers)``.
    """
    if param not in ("embedding", "q", "k", "v", "o", "gate", "up", "down"):
        raise ValueError(f"unknown parameter {param!r}")
    if scaled_init and param in ("o", "down"):
        return std / math.sqrt(2 * n_layers)
    return std


def warns_with(init_scheme_is_depth_scaled: bool) -> bool:
    """The README's rule as a predicate: warn when LNS meets any depth-scaled initialisation."""
    return bool(init_scheme_is_depth_scaled)
