"""Hyper-connections (Zhu et al., ICLR 2025, arXiv 2409.19606): n residual streams, static and dynamic.

Port of lucidrains/hyper-connections ``hyper_connections/hyper_connections.py`` (commit 47751035), the
implementation the mHC paper and Megatron-LM's mHC build on; the paper's Algorithm 2 (Appendix J) is
the same computation. Streams are a separate axis here, ``h`` of shape ``(B, T, n, d)`` (the release
folds them into the batch, ``(b s) t d``).

For one sub-layer (attention, cross-attention or FFN, its own pre-norm inside ``branch``):

- ``hbar = RMSNorm(h)`` per stream (``86-93``: ``F.normalize(x) * sqrt(d) * (gamma + 1)``, gamma zeros;
  the paper used LayerNorm, the release comments that RMSNorm "is fine");
- ``alpha = static_alpha + s_alpha * tanh(hbar @ W_alpha)`` of shape ``(n, 1 + n)`` per token (``288-295``:
  one scale ``s_alpha`` for the input column and the residual block); column 0 is ``A_m`` (the branch
  input weights), columns ``1..n`` are ``A_r`` (the residual mixing);
- ``beta = static_beta + s_beta * tanh(hbar @ w_beta)``, one value per stream (``303-313``);
- branch input ``sum_s alpha[s, 0] h_s``; new residual stream ``t``: ``sum_s alpha[s, 1 + t] h_s``
  (``315-320``, ``einsum('... s t, ... s d -> ... t d')``);
- output stream ``s``: ``beta_s * F(branch input) + residual_s`` (``357-372``).

Init (``215``, ``229-247``): ``static_alpha[:, 0]`` one-hot at ``layer_index % n``, ``static_alpha[:, 1:]``
the identity, ``static_beta`` ones, ``W_alpha``, ``w_beta`` zeros, ``s_alpha = s_beta = 0.01``. Static
HC (the paper's SHC) is the same with no dynamic term. Stack ends: ``expand`` repeats the embedding
``n`` times (optionally plus a learned per-stream embedding, ``StreamEmbed``, ``423-455``); ``reduce``
sums the streams (``59-61``) before the final norm (x-transformers ``x_transformers.py:3560-3565``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

SCALE_INIT = 1e-2  # dynamic_alpha_scale, dynamic_beta_scale (hyper_connections.py:235, 247)


def hc_rms_norm(x: Tensor, gamma: Tensor | None = None) -> Tensor:
    """lucidrains' ``RMSNorm`` (``hyper_connections.py:86-93``): ``F.normalize(x) * sqrt(d) * (gamma + 1)``."""
    y = F.normalize(x, dim=-1) * x.shape[-1] ** 0.5
    return y if gamma is None else y * (gamma + 1)


@dataclass
class HCParams:
    """One hyper-connection's parameters; ``w_alpha``/``w_beta`` None is the static variant (SHC)."""

    static_alpha: Tensor  # (n, 1 + n)
    static_beta: Tensor  # (n,)
    w_alpha: Tensor | None = None  # (d, 1 + n)
    w_beta: Tensor | None = None  # (d,)
    s_alpha: float | Tensor = SCALE_INIT
    s_beta: float | Tensor = SCALE_INIT
    gamma: Tensor | None = None  # (d,) the norm's zero-initialised gain offset
    tanh: bool = True

    @property
    def n(self) -> int:
        return self.static_beta.numel()


def init_params(n: int, d: int, layer_index: int, dynamic: bool = True, dtype=torch.float64) -> HCParams:
    """The release's initialisation (``hyper_connections.py:215, 229-247``)."""
    alpha = torch.zeros(n, 1 + n, dtype=dtype)
    alpha[layer_index % n, 0] = 1.0
    alpha[:, 1:] = torch.eye(n, dtype=dtype)
    beta = torch.ones(n, dtype=dtype)
    if not dynamic:
        return HCParams(alpha, beta)
    return HCParams(alpha, beta, torch.zeros(d, 1 + n, dtype=dtype), torch.zeros(d, dtype=dtype))


def mixing(h: Tensor, p: HCParams) -> tuple[Tensor, Tensor]:
    """``(alpha, beta)`` per token: ``(B, T, n, 1 + n)`` and ``(B, T, n)`` (``hyper_connections.py:286-313``)."""
    act = torch.tanh if p.tanh else (lambda t: t)
    alpha = p.static_alpha.expand(*h.shape[:-1], p.n + 1)
    beta = p.static_beta.expand(h.shape[:-1])
    if p.w_alpha is not None:
        hbar = hc_rms_norm(h, p.gamma)
        alpha = alpha + act(hbar @ p.w_alpha) * p.s_alpha
        beta = beta + act(hbar @ p.w_beta) * p.s_beta
    return alpha, beta


def width_connection(h: Tensor, p: HCParams) -> tuple[Tensor, Tensor, Tensor]:
    """``(branch_input (B, T, d), residuals (B, T, n, d), beta (B, T, n))`` (``hyper_connections.py:263-337``)."""
    alpha, beta = mixing(h, p)
    mix = torch.einsum("btsu,btsd->btud", alpha, h)  # mix[u] = sum_s alpha[s, u] h_s
    return mix[..., 0, :], mix[..., 1:, :], beta


def depth_connection(branch_out: Tensor, residuals: Tensor, beta: Tensor) -> Tensor:
    """``h'_s = beta_s * F + residual_s`` (``hyper_connections.py:339-372``; dropout 0)."""
    return beta.unsqueeze(-1) * branch_out.unsqueeze(-2) + residuals


def sublayer(h: Tensor, branch: Callable[[Tensor], Tensor], p: HCParams) -> Tensor:
    """One hyper-connected sub-layer: ``(B, T, n, d) -> (B, T, n, d)``."""
    x, residuals, beta = width_connection(h, p)
    return depth_connection(branch(x), residuals, beta)


def expand(x: Tensor, n: int, stream_embed: Tensor | None = None) -> Tensor:
    """``(B, T, d) -> (B, T, n, d)``: ``n`` copies, plus ``stream_embed`` ``(n, d)`` if given (``StreamEmbed``)."""
    h = x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1])
    return h if stream_embed is None else h + stream_embed


def reduce(h: Tensor) -> Tensor:
    """``(B, T, n, d) -> (B, T, d)``: the sum of the streams (``hyper_connections.py:61``)."""
    return h.sum(-2)


def paper_matrix_form(h: Tensor, branch: Callable[[Tensor], Tensor], a_m: Tensor, a_r: Tensor, b: Tensor) -> Tensor:
    """The paper's matrix form for given per-token ``A_m (B, T, n)``, ``A_r (B, T, n, n)``, ``B (B, T, n)``:
    ``H' = B^T F(A_m^T H) + A_r^T H`` (arXiv 2409.19606, eq. 1-3), written with explicit per-token matmuls."""
    x = torch.matmul(a_m.unsqueeze(-2), h).squeeze(-2)
    return torch.matmul(b.unsqueeze(-1), branch(x).unsqueeze(-2)) + torch.matmul(a_r.transpose(-1, -2), h)
