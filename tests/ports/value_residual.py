"""Value residual learning, ResFormer (Zhou et al., arXiv 2410.17897): each layer's values mixed with the first's.

Released code: Zcchill/Value-Residual-Learning ``src/modeling/modeling_llama_resformer.py`` (commit
95652f64), ``LlamaAttention.forward`` ``375-381`` (the same in ``LlamaFlashAttention2``, ``479-485``):
``value_states = v_proj(hidden_states)``; layer 0 appends it to ``formal_layer_values``; every later
layer uses ``0.5 * formal_layer_values[0] + 0.5 * value_states``. The mix is on the projected values
*before* the head split, RoPE and the KV-cache update (``400-403``): the cache holds mixed values, and
the model threads the list through the decoder (``876-887``). Fixed 0.5/0.5, no parameter.
SVFormer (``modeling_llama_svformer.py``, same lines): later layers have no ``v_proj`` and use layer 0's
values as they are.

x-transformers ``x_transformers.py`` (commit 9252ed78), ``add_value_residual``: ``v = v1.lerp(v, mix)``,
``mix`` 0.5 or, with ``learned_value_residual_mix`` (default True), per token and head
``sigmoid(Linear(dim, heads)(x))`` (``2079-2085``, ``2296-2302``); the first self-attention's and the first
cross-attention's values feed the later self- and cross-attentions respectively (``3503-3530``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .common import AttnWeights, FFNWeights, Norm, attention, ffn, linear

RESFORMER_LAMBDA = 0.5


def resformer_mix(v: Tensor, v1: Tensor, lam1: float = RESFORMER_LAMBDA, lam2: float = RESFORMER_LAMBDA) -> Tensor:
    """``lam1 * V_1 + lam2 * V_n`` (``modeling_llama_resformer.py:381``)."""
    return lam1 * v1 + lam2 * v


def xtransformers_mix(v: Tensor, v1: Tensor, mix: Tensor | float, n_heads: int) -> Tensor:
    """``v1.lerp(v, mix)`` with ``mix`` a float or ``(B, S, H)`` per head (``x_transformers.py:2300-2302``)."""
    if isinstance(mix, float):
        return v1 + mix * (v - v1)
    B, S, C = v.shape
    m = mix.unsqueeze(-1).expand(B, S, n_heads, C // n_heads).reshape(B, S, C)
    return v1 + m * (v - v1)


def first_values(x_kv: Tensor, w: AttnWeights) -> Tensor:
    """Layer 1's projected values ``v_proj(x)`` ``(B, S, C)``, the ``formal_layer_values[0]`` of the release."""
    return linear(x_kv, w.wv, w.bv)


def lm_stack(x: Tensor, layers: list[dict], n_heads: int, lam: float = RESFORMER_LAMBDA) -> Tensor:
    """A Pre-LN decoder-only stack with value residual: layer ``l > 1`` attends with
    ``(1 - lam) V_l + lam V_1`` (ResFormer: ``lam = 0.5``). ``layers``: ``attn_w``, ``ffn_w``, ``norm_attn``,
    ``norm_ffn`` as in ``ports.common.lm_layers``."""
    v1 = None
    for i, lay in enumerate(layers):
        h = lay["norm_attn"](x)
        if i == 0:
            v1 = first_values(h, lay["attn_w"])
            x = x + attention(h, h, lay["attn_w"], n_heads, causal=True)
        else:
            vfix = v1
            x = x + attention(h, h, lay["attn_w"], n_heads, causal=True,
                              v_fn=lambda v, vfix=vfix: resformer_mix(v, vfix, lam, 1 - lam))  # fmt: skip
        x = x + ffn(lay["norm_ffn"](x), lay["ffn_w"])
    return x


def lm_stack_incremental(x: Tensor, layers: list[dict], n_heads: int, lam: float = RESFORMER_LAMBDA) -> Tensor:
    """The same stack decoded one position at a time with a key/value cache that stores the *mixed* values,
    as the release does (mix before ``past_key_value.update``): step ``t`` needs layer 1's values of
    position ``t`` only, computed in the same step. Written out with explicit ops (no shared attention)."""
    B, T, C = x.shape
    dh = C // n_heads
    cache: list[dict[str, Tensor]] = [{"k": x.new_zeros(B, n_heads, 0, dh), "v": x.new_zeros(B, n_heads, 0, dh)}
                                      for _ in layers]  # fmt: skip
    outs = []
    for t in range(T):
        h_t = x[:, t : t + 1]
        v1_t = None
        for i, lay in enumerate(layers):
            w: AttnWeights = lay["attn_w"]
            n_t = lay["norm_attn"](h_t)
            q = linear(n_t, w.wq, w.bq).view(B, 1, n_heads, dh).transpose(1, 2) * dh**-0.5
            k = linear(n_t, w.wk, w.bk).view(B, 1, n_heads, dh).transpose(1, 2)
            v_raw = linear(n_t, w.wv, w.bv)
            if i == 0:
                v1_t = v_raw
            v = v_raw if i == 0 else lam * v1_t + (1 - lam) * v_raw
            cache[i]["k"] = torch.cat([cache[i]["k"], k], 2)
            cache[i]["v"] = torch.cat([cache[i]["v"], v.view(B, 1, n_heads, dh).transpose(1, 2)], 2)
            p = torch.softmax(q @ cache[i]["k"].transpose(-1, -2), dim=-1)
            ctx = (p @ cache[i]["v"]).transpose(1, 2).reshape(B, 1, C)
            h_t = h_t + linear(ctx, w.wo, w.bo)
            h_t = h_t + ffn(lay["norm_ffn"](h_t), lay["ffn_w"])
        outs.append(h_t)
    return torch.cat(outs, dim=1)


def random_lm_layers(n_layers: int, d: int, d_ff: int, generator: torch.Generator, norm: Norm) -> list[dict]:
    return [
        {
            "attn_w": AttnWeights.random(d, generator),
            "ffn_w": FFNWeights.random(d, d_ff, generator),
            "norm_attn": norm,
            "norm_ffn": norm,
        }  # fmt: skip
        for _ in range(n_layers)
    ]
