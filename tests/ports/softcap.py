"""Logit soft-capping (Gemma 2, Gemma Team 2024, arXiv 2408.00118, sec. 2), ported from the released JAX code.

google-deepmind/gemma @ 7691fd4:

- ``gemma/gm/nn/_modules.py:254-256`` (``Attention.__call__``): ``logits = tanh(logits / attn_logits_soft_cap)``,
  ``logits = logits * attn_logits_soft_cap``, on ``einsum('BTNH,BSNH->BTNS', query_scaled, key_proj)`` (the query
  scaled by ``head_dim ** -0.5`` first), then the mask ``where(attn_mask, logits, K_MASK)`` with
  ``K_MASK = -2.3819763e38`` and ``softmax`` over the keys;
- ``gemma/gm/nn/_transformer.py:268-270``: ``logits /= final_logit_softcap``, ``logits = tanh(logits) *
  final_logit_softcap`` on the output logits;
- ``gemma/gm/nn/_gemma.py:59, 68``: Gemma 2's caps, ``final_logit_softcap=30.0``, ``attn_logits_soft_cap=50.0``.

Batch-first ``(B, T, C)``; the projections are fairseq's (``q_proj`` ... ``out_proj``, with biases), which Gemma's
einsums compute without biases. Float64 in, float64 out.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .common import AttnWeights, linear

ATTN_CAP = 50.0
FINAL_CAP = 30.0
K_MASK = -2.3819763e38  # gemma/gm/nn/_modules.py: the masked logit


def softcap(logits: Tensor, cap: float) -> Tensor:
    """``tanh(logits / cap) * cap`` (``_modules.py:255-256``, ``_transformer.py:269-270``)."""
    return torch.tanh(logits / cap) * cap


def attention(
    x_q: Tensor,
    x_kv: Tensor,
    w: AttnWeights,
    heads: int,
    cap: float | None,
    allowed: Tensor | None = None,
    cap_after_mask: bool = False,
) -> Tensor:
    """Gemma's attention core on fairseq's projections: ``allowed`` ``(B, T, S)`` (True: attend), or None for all.

    ``cap_after_mask`` is a deliberate mutation (the cap applied to the masked logits), for the tests to fail.
    """
    b, t, c = x_q.shape
    s, dh = x_kv.size(1), c // heads
    q = linear(x_q, w.wq, w.bq).view(b, t, heads, dh) * dh**-0.5  # query_scaled
    k = linear(x_kv, w.wk, w.bk).view(b, s, heads, dh)
    v = linear(x_kv, w.wv, w.bv).view(b, s, heads, dh)
    logits = torch.einsum("BTNH,BSNH->BTNS", q, k)
    if cap is not None and not cap_after_mask:
        logits = softcap(logits, cap)
    if allowed is not None:
        logits = torch.where(allowed[:, :, None, :], logits, torch.full_like(logits, K_MASK))
    if cap is not None and cap_after_mask:
        logits = softcap(logits, cap)
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("BTNS,BSNH->BTNH", probs, v).reshape(b, t, c)
    return linear(out, w.wo, w.bo)
