"""Gated attention (Qiu et al. 2025, arXiv 2505.06708): a sigmoid gate on each head's attention output.

Released code: qiuzh20/gated_attention ``modeling_qwen3.py`` (commit 49645df6), ``Qwen3Attention``:

- the gate logits come from the query projection, widened (``272-276``): ``q_proj`` has
  ``H * dh + H`` outputs (``headwise_attn_output_gate``) or ``2 * H * dh`` (``elementwise_attn_output_gate``);
  its output is viewed per key/value group and split (``304-313``): for each group, the group's query
  heads first, then the group's gate logits (with one KV head per query head, per head
  ``[q_h (dh), g_h (1 or dh)]``, interleaved);
- after the softmax-weighted sum and the transpose to ``(B, T, H, dh)``, before the head merge and
  ``o_proj`` (``353-360``): ``attn_output * sigmoid(gate_score)``. The gate is computed in the
  activation dtype; the softmax in float32 (``342``). The gate has no init of its own (``q_proj``'s).

OLMo-core ``src/olmo_core/nn/attention/__init__.py`` (commit fa6c5014): a separate ``w_g = Linear(d_model,
n_heads)`` (``GateGranularity.headwise``, the default) or ``Linear(d_model, n_heads * head_dim)``
(``elementwise``), bias as the attention's (``392-405``); applied after ``sdpa`` and before ``w_out``
(``636-654``), ``sigmoid`` in float32 when ``GateConfig.full_precision`` (default True); ``w_g`` initialised
like ``w_q`` (``753-759``). Megatron-LM ``attention_output_gate``: elementwise, the gate split from the
fused QKV projection, ``x * sigmoid(gate.float())`` (``attention.py:1635-1641``).

The gate's input is the attention's query-side input (the layer's normalised stream); for
cross-attention that is the decoder stream, not the encoder output (the gate is "query-dependent").
"""

from __future__ import annotations

import torch
from torch import Tensor

from .common import AttnWeights, attention, linear

KINDS = ("headwise", "elementwise")


def gate_width(kind: str, n_heads: int, head_dim: int) -> int:
    if kind == "headwise":
        return n_heads
    if kind == "elementwise":
        return n_heads * head_dim
    raise ValueError(f"unknown gate kind {kind!r}")


def gated_attention(x_q: Tensor, x_kv: Tensor, w: AttnWeights, n_heads: int, wg: Tensor, bg: Tensor | None = None,
                    **kwargs) -> Tensor:  # fmt: skip
    """OLMo-core's form: ``gate = x_q @ wg^T + bg`` (``(H, C)`` headwise or ``(C, C)`` elementwise), applied per
    head after the attention's weighted sum and before ``out_proj``."""
    return attention(x_q, x_kv, w, n_heads, gate=linear(x_q, wg, bg), **kwargs)


def fused_q_proj(wq: Tensor, bq: Tensor | None, wg: Tensor, bg: Tensor | None, n_heads: int, kind: str):
    """The released ``q_proj`` weight (and bias) holding the gate rows, in the release's layout for one KV
    head per query head: per head ``h``, its ``dh`` query rows then its gate rows (1 or ``dh``)."""
    dh = wq.shape[0] // n_heads
    gw = 1 if kind == "headwise" else dh
    w = torch.cat([wq.view(n_heads, dh, -1), wg.view(n_heads, gw, -1)], dim=1).reshape(n_heads * (dh + gw), -1)
    if bq is None:
        return w, None
    b = torch.cat([bq.view(n_heads, dh), bg.view(n_heads, gw)], dim=1).reshape(-1)
    return w, b


def split_q_and_gate(q_out: Tensor, n_heads: int, n_kv_heads: int, head_dim: int, kind: str) -> tuple[Tensor, Tensor]:
    """``modeling_qwen3.py:304-313``: ``q_proj`` output ``(B, T, ·)`` -> queries ``(B, T, H * dh)`` and gate
    logits ``(B, T, H)`` (headwise) or ``(B, T, H * dh)`` (elementwise)."""
    B, T, _ = q_out.shape
    groups = n_heads // n_kv_heads
    gw = groups if kind == "headwise" else head_dim * groups
    q, g = torch.split(q_out.view(B, T, n_kv_heads, -1), [head_dim * groups, gw], dim=-1)
    return q.reshape(B, T, n_heads * head_dim), g.reshape(B, T, -1)


def released_gated_attention(x_q: Tensor, x_kv: Tensor, w_fused: Tensor, b_fused: Tensor | None, w: AttnWeights,
                             n_heads: int, kind: str, causal: bool = False) -> Tensor:  # fmt: skip
    """The release's forward with its fused ``q_proj`` (``w.wq``/``w.bq`` unused), written out with explicit
    ops in the release's order (``300-360``; no RoPE, no QK-norm, eager softmax in float32)."""
    B, T, C = x_q.shape
    S = x_kv.shape[1]
    dh = C // n_heads
    q, g = split_q_and_gate(linear(x_q, w_fused, b_fused), n_heads, n_heads, dh, kind)
    q = q.view(B, T, n_heads, dh).transpose(1, 2)
    k = linear(x_kv, w.wk, w.bk).view(B, S, n_heads, dh).transpose(1, 2)
    v = linear(x_kv, w.wv, w.bv).view(B, S, n_heads, dh).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(2, 3)) / dh**0.5
    if causal:
        scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(1 + S - T), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2)  # (B, T, H, dh)
    out = out * torch.sigmoid(g.reshape(B, T, n_heads, -1))
    return linear(out.reshape(B, T, C), w.wo, w.bo)
