"""QK-Clip (Kimi K2, arXiv 2507.20534, Algorithm 1 "MuonClip"): after the optimizer step, shrink ``W_q``/``W_k``
of every head whose largest attention logit in that step's forward exceeded ``tau``.

Per head ``h``: ``S_max^h = max`` over the batch, queries and (unmasked) keys of ``scale * q_i . k_j``;
if ``S_max^h > tau``: ``gamma_h = tau / S_max^h`` and the head's query and key projections are scaled so
that the head's logits scale by ``gamma_h``. Moonshot released no code for it (``MoonshotAI/Kimi-K2``
holds the README, deployment scripts and the report); the paper's MHA rule splits the factor evenly,
``W_q^h *= sqrt(gamma_h)``, ``W_k^h *= sqrt(gamma_h)`` (for MLA: ``q^C``, ``k^C`` by ``sqrt(gamma)``, the
per-head rotary ``q^R`` by ``gamma``, the shared rotary ``k^R`` untouched); ``tau = 100`` for Kimi K2.

Maintained implementation: Megatron-LM (commit d98e8a64) ``megatron/core/transformer/attention.py``
``SelfAttention.clip_qk`` ``1975-2022`` and ``_clip_linear_qkv`` ``2024-2070``: the per-head maxima
(``core_attention.current_max_attn_logits``, TransformerEngine's per-head max of the scaled, masked
scores) are reduced per query group by ``max``; only if some group exceeds ``qk_clip_threshold``,
``eta = clamp(threshold / max, max=1)`` per group and, on the fused QKV *weight* (and its fp32
``main_param`` copy; the bias is not touched), the group's query rows ``*= eta ** qk_clip_alpha`` and
its key rows ``*= eta ** (1 - qk_clip_alpha)``; then the maxima are reset. Defaults
(``transformer_config.py:265-272``): ``qk_clip_threshold = 100``, ``qk_clip_alpha = 0.5``.
``megatron/core/optimizer/qk_clip.py:8-52`` ``clip_qk``: all-reduce MAX of the per-head maxima over the
data(+context)-parallel group, then each layer's ``clip_qk``; returns the max over layers for logging.
"""

from __future__ import annotations

import torch
from torch import Tensor

TAU = 100.0  # Kimi K2's threshold; Megatron qk_clip_threshold
ALPHA = 0.5  # Megatron qk_clip_alpha: the query's share of the factor (paper: sqrt, i.e. 0.5)


def per_head_max_logit(q: Tensor, k: Tensor, scale: float, causal: bool = False,
                       key_padding_mask: Tensor | None = None) -> Tensor:  # fmt: skip
    """``(H,)``: the max over batch, queries and unmasked keys of ``scale * q . k``; ``q`` ``(B, H, T, d)``."""
    logits = scale * (q @ k.transpose(-1, -2))
    T, S = logits.shape[-2:]
    masked = torch.zeros(logits.shape[0], 1, T, S, dtype=torch.bool)
    if causal:
        masked = masked | torch.ones(T, S, dtype=torch.bool).triu(1 + S - T)
    if key_padding_mask is not None:
        masked = masked | key_padding_mask[:, None, None, :]
    return logits.masked_fill(masked, float("-inf")).amax(dim=(0, 2, 3))


def eta(max_logits: Tensor, n_groups: int, tau: float = TAU, guarded: bool = False) -> Tensor | None:
    """Per query group ``clamp(tau / max, max=1)`` (``attention.py:2008-2010``), or None when no group exceeds
    ``tau`` (no change; Megatron's ``torch.any`` test, a host read). A group whose max logit is negative gets a
    negative factor there (``tau / max < 0`` passes the clamp), and ``eta ** alpha`` is then NaN;
    ``guarded=True`` gives such groups 1: ``where(max > tau, tau / max, 1)``, which also needs no ``any``."""
    grouped = max_logits.view(n_groups, -1).amax(dim=1)
    if guarded:
        return torch.where(grouped > tau, tau / grouped, torch.ones_like(grouped))
    if not bool((grouped > tau).any()):
        return None
    return torch.clamp(tau / grouped, max=1.0)


def clip_megatron(wq: Tensor, wk: Tensor, max_logits: Tensor, n_heads: int, n_groups: int | None = None,
                  tau: float = TAU, alpha: float = ALPHA) -> tuple[Tensor, Tensor]:  # fmt: skip
    """New ``(wq, wk)`` (``nn.Linear`` layout, rows ``(heads, head_dim)``): ``_clip_linear_qkv`` on separate
    q and k weights. Weights only, as released; with biases the logits do not scale exactly by ``eta``."""
    g = n_heads if n_groups is None else n_groups
    e = eta(max_logits, g, tau)
    if e is None:
        return wq.clone(), wk.clone()
    wq2 = wq.view(g, -1, wq.shape[-1]) * e.pow(alpha).view(g, 1, 1)
    wk2 = wk.view(g, -1, wk.shape[-1]) * e.pow(1 - alpha).view(g, 1, 1)
    return wq2.reshape_as(wq), wk2.reshape_as(wk)


def clip_with_bias(wq: Tensor, bq: Tensor | None, wk: Tensor, bk: Tensor | None, max_logits: Tensor, n_heads: int,
                   tau: float = TAU, alpha: float = ALPHA):  # fmt: skip
    """The exact rule for projections with biases (fairseq's ``q_proj``/``k_proj`` have them): each head's
    weight *and* bias rows scaled, so ``q_h -> eta^alpha q_h`` and ``k_h -> eta^(1-alpha) k_h`` and every
    logit of the head scales by ``eta_h``. Returns ``(wq, bq, wk, bk)``."""
    e = eta(max_logits, n_heads, tau)
    if e is None:
        return wq.clone(), None if bq is None else bq.clone(), wk.clone(), None if bk is None else bk.clone()

    def scaled(t: Tensor | None, p: float) -> Tensor | None:
        if t is None:
            return None
        return (t.view(n_heads, -1, *t.shape[1:]) * e.pow(p).view(n_heads, 1, *([1] * (t.dim() - 1)))).reshape_as(t)

    return scaled(wq, alpha), scaled(bq, alpha), scaled(wk, 1 - alpha), scaled(bk, 1 - alpha)


def kimi_mla_factors(gamma: Tensor) -> dict[str, Tensor]:
    """The paper's MLA split per head: ``q^C``, ``k^C`` by ``sqrt(gamma)``, ``q^R`` by ``gamma``, ``k^R`` by 1."""
    return {"q_c": gamma.sqrt(), "k_c": gamma.sqrt(), "q_r": gamma, "k_r": torch.ones_like(gamma)}
