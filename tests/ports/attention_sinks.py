"""Learned attention sinks: one learned logit per head in every softmax row's denominator, with no value.

``p_ij = exp(l_ij) / (exp(s_h) + sum_k exp(l_ik))``, ``o_i = sum_j p_ij v_j``: the row may put weight
``exp(s_h) / (...)`` on "nothing". Released forms, all the same function (tested against each other):

- gpt-oss ``gpt_oss/torch/model.py:153-173`` (commit 7b583341) ``sdpa``: ``QK = cat([QK, S], -1)``,
  ``softmax``, drop the last column (the sink appended *after* the keys); the sinks a bf16 parameter of
  ``num_attention_heads`` (``189-191``, loaded from the checkpoint);
- gpt-oss ``gpt_oss/triton/attention.py:165-203`` ``attention_ref``: the explicit denominator with one
  shared max, ``exp(l - m) / (sum exp(l - m) + exp(s - m))``, ``m = max(s, max_j l)``, in float32;
- x-transformers ``x_transformers/attend.py:292-298, 592-628`` (commit 9252ed78) ``head_learned_sink``:
  the sink *prepended* at column 0, removed after the softmax and before attention dropout; init zeros;
  refused with flash attention (``295``);
- DeepSeek-V4 (HF ``modeling_deepseek_v4.py`` ``DeepseekV4Attention``: ``sinks`` per head, zero init,
  passed as ``s_aux`` to the eager attention; the HF port refuses SDPA: "torch's SDPA kernel doesn't carry
  the per-head learnable sink term").

Three forms through ``torch.nn.functional.scaled_dot_product_attention`` (this project's question: can the
fused kernel carry a sink?), exact in exact arithmetic:

- :func:`sdpa_extra_key_mask`: one extra key of zero key and zero value, its logit put in by an additive
  float mask (``q . 0 = 0``, plus ``s_h``); needs a float mask (no ``is_causal``; the memory-efficient or
  math backend, not flash), gradient to the sink through the mask;
- :func:`sdpa_augmented`: the head dim widened by one: ``q' = [q, 1]``, real keys ``[k, 0]``, sink key
  ``[0, s_h / scale]``, sink value 0; the sink key is prepended, so causal attention needs the
  *lower-right* causal alignment (``torch.nn.attention.bias.causal_lower_right``), a key-padding mask a
  True column for the sink; no float mask, the gradient through an ordinary key;
- :func:`sdpa_lse_rescale`: ``o_sink = o_plain * sigmoid(lse - s_h)`` with ``lse`` the row's log-sum-exp
  of the plain attention (the fused kernels compute it; the public ``F.scaled_dot_product_attention``
  does not return it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right


def _row_sinks(sinks: Tensor, logits: Tensor) -> Tensor:
    B, H, T, _ = logits.shape
    return sinks.to(logits.dtype).view(1, H, 1, 1).expand(B, H, T, 1)


def softmax_concat(logits: Tensor, sinks: Tensor) -> Tensor:
    """gpt-oss ``torch/model.py:169-171``: ``softmax(cat([QK, S]))[..., :-1]``; ``logits`` ``(B, H, T, S)``."""
    return torch.softmax(torch.cat([logits, _row_sinks(sinks, logits)], dim=-1), dim=-1)[..., :-1]


def softmax_explicit(logits: Tensor, sinks: Tensor) -> Tensor:
    """gpt-oss ``triton/attention.py:193-198``: the denominator written out with one shared max."""
    s = _row_sinks(sinks, logits)
    m = torch.maximum(s, logits.amax(dim=-1, keepdim=True))
    e = torch.exp(logits - m)
    return e / (e.sum(dim=-1, keepdim=True) + torch.exp(s - m))


def softmax_first(logits: Tensor, sinks: Tensor) -> Tensor:
    """x-transformers ``attend.py:594-600, 626-628``: the sink at column 0, dropped after the softmax."""
    return torch.softmax(torch.cat([_row_sinks(sinks, logits), logits], dim=-1), dim=-1)[..., 1:]


def _bool_attend(T: int, S: int, causal: bool, key_padding_mask: Tensor | None, B: int) -> Tensor:
    attend = torch.ones(B, 1, T, S, dtype=torch.bool)
    if causal:
        attend = attend & torch.ones(T, S, dtype=torch.bool).tril(S - T)
    if key_padding_mask is not None:
        attend = attend & ~key_padding_mask[:, None, None, :]
    return attend


def sdpa_extra_key_mask(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, scale: float, causal: bool = False,
                        key_padding_mask: Tensor | None = None) -> Tensor:  # fmt: skip
    """``(B, H, T, d)`` queries against keys + one zero key with zero value; its logit ``s_h`` in the mask."""
    B, H, T, d = q.shape
    S = k.shape[2]
    z = torch.zeros(B, H, 1, d, dtype=q.dtype)
    attend = _bool_attend(T, S, causal, key_padding_mask, B)
    mask = torch.zeros(B, 1, T, S, dtype=q.dtype).masked_fill(~attend, float("-inf")).expand(B, H, T, S)
    mask = torch.cat([mask, sinks.to(q.dtype).view(1, H, 1, 1).expand(B, H, T, 1)], dim=-1)
    return F.scaled_dot_product_attention(q, torch.cat([k, z], 2), torch.cat([v, z], 2), attn_mask=mask, scale=scale)


def sdpa_augmented(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, scale: float, causal: bool = False,
                   key_padding_mask: Tensor | None = None) -> Tensor:  # fmt: skip
    """The sink as a prepended key in one extra head dimension: ``[q, 1] . [0, s_h / scale] * scale = s_h``."""
    B, H, T, d = q.shape
    S = k.shape[2]
    q2 = torch.cat([q, torch.ones(B, H, T, 1, dtype=q.dtype)], dim=-1)
    k2 = torch.cat([k, torch.zeros(B, H, S, 1, dtype=q.dtype)], dim=-1)
    sink_key = torch.cat([torch.zeros(B, H, 1, d, dtype=q.dtype), (sinks.to(q.dtype) / scale).view(1, H, 1, 1)
                          .expand(B, H, 1, 1)], dim=-1)  # fmt: skip
    k2 = torch.cat([sink_key, k2], dim=2)
    v2 = torch.cat([torch.zeros(B, H, 1, d, dtype=q.dtype), v], dim=2)
    if key_padding_mask is None:
        mask = causal_lower_right(T, S + 1) if causal else None
    else:
        real = _bool_attend(T, S, causal, key_padding_mask, B)
        mask = torch.cat([torch.ones(B, 1, T, 1, dtype=torch.bool), real], dim=-1)
    return F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask, scale=scale)


def sdpa_lse_rescale(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, scale: float, causal: bool = False,
                     key_padding_mask: Tensor | None = None) -> Tensor:  # fmt: skip
    """Plain SDPA, then ``* sigmoid(lse - s_h)``; ``lse`` computed here from the scores (a kernel returns it)."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    attend = _bool_attend(T, S, causal, key_padding_mask, B)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=scale)
    lse = torch.logsumexp((q @ k.transpose(-1, -2) * scale).masked_fill(~attend, float("-inf")), dim=-1, keepdim=True)
    return out * torch.sigmoid(lse - sinks.to(q.dtype).view(1, H, 1, 1))
