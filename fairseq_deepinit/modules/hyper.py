"""Hyper-connections: ``n`` residual streams per token, read and written by every sub-layer through learned
mixing weights (HC, Zhu et al. ICLR 2025; mHC, Xie et al. 2025).

A stack with hyper-connections carries ``x`` of shape ``(T, B, n, d)`` between its sub-layers
(:class:`Streams`: ``n`` copies of the embedding output in, one ``(T, B, d)`` stream out before the final
norm). Each sub-layer's residual module is a :class:`StreamResidual`: :meth:`StreamResidual.enter` gives the
branch its ``(T, B, d)`` input and the skip, ``(streams, weights)``; the layer's forward runs its pre-norm,
branch and dropout on that input as for any residual, then ``forward(branch, skip)`` writes the branch into
every stream::

    x_in, (R, w) = enter(x)                     # R: (T, B, n, d) the mixed residual streams, w: (T, B, n)
    x'  = w (x) dropout(F(norm(x_in))) + R      # x'_s = w_s F + R_s

- :class:`HyperConnection` (lucidrains/hyper-connections @ 47751035 ``hyper_connections/hyper_connections.py``;
  the paper's Algorithm 2): ``alpha = static_alpha + s_a tanh(hbar W_a)`` (``(n, 1 + n)`` per token, ``286-295``),
  ``beta = static_beta + s_b tanh(hbar w_b)`` (``303-313``), ``hbar = RMSNorm(x)`` per stream (``86-93``);
  ``x_in = sum_s alpha[s, 0] x_s``, ``R_t = sum_s alpha[s, 1 + t] x_s`` (``315-320``), ``w = beta`` (``357-372``).
  Init (``215, 229-247``): ``static_alpha[:, 0]`` one-hot at the connection's index mod ``n``, ``static_alpha[:,
  1:] = I``, ``static_beta = 1``, the dynamic weights 0, ``s_a = s_b = 0.01``. Static HC has no dynamic term.
- :class:`ManifoldHyperConnection` (Megatron-LM @ d98e8a64 ``megatron/core/transformer/hyper_connection.py``):
  from ``x_flat`` (``n d`` per token), ``h = r (x_flat phi^T) alpha + b`` with ``r = 1 / (||x_flat|| / sqrt(n d) +
  eps)`` (``216-259``), ``H_pre = sigmoid(h_pre)``, ``H_post = 2 sigmoid(h_post)``, ``H_res = Sinkhorn(h_res)``
  (:func:`sinkhorn`, ``54-146``); ``x_in = sum_i H_pre_i x_i``, ``R = H_res x``, ``w = H_post`` (``370-418,
  600-642``). Init (``182-214``): ``phi`` xavier-uniform, ``alpha`` 0.01 each, ``b`` 0. The mapping is computed
  in float32 (autocast off; float64 stays float64; this project's choice, where Megatron's runs in the
  activation dtype: docs/schemes.md, "Precision"), the mixing in the activation dtype.

Everything is per token, so incremental decoding and beam reordering need nothing new. Formulas, the paper
equations and the encoder-decoder design: docs/schemes.md, "Hyper-connections and mHC".
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .residual import Residual

REDUCTIONS = ("sum", "mean")
HC_SCALE_INIT = 1e-2  # dynamic_alpha_scale, dynamic_beta_scale (hyper_connections.py:235, 247)
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "hpu", "mps")


@dataclass(frozen=True)
class Streams:
    """A stack's ``n`` streams: :meth:`expand` after the embedding, :meth:`contract` before the final norm.

    ``reduction``: ``sum`` (lucidrains ``hyper_connections.py:61``, x-transformers) or ``mean`` (Megatron's
    ``output_contract``, ``hyper_connection.py:516-535``); under a scale-invariant final norm they differ only
    by the norm's eps.
    """

    n: int
    reduction: str = "sum"

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"unknown reduction {self.reduction!r}; choose from {', '.join(REDUCTIONS)}")

    def expand(self, x: Tensor) -> Tensor:
        """``(T, B, d) -> (T, B, n, d)``: ``n`` copies (a view; no layer writes its input in place)."""
        return x.unsqueeze(-2).expand(*x.shape[:-1], self.n, x.shape[-1])

    def contract(self, x: Tensor) -> Tensor:
        """``(T, B, n, d) -> (T, B, d)``: the sum or the mean of the streams."""
        return x.sum(-2) if self.reduction == "sum" else x.mean(-2)

    def hidden(self, x: Tensor) -> Tensor:
        """A layer's streams as the one ``(T, B, d)`` hidden state a stack returns beside its output: contracted."""
        return self.contract(x)

    def measured(self, x: Tensor) -> Tensor:
        """What the depth diagnostics measure of a layer's streams: a token's ``n`` streams as one ``n d`` vector."""
        return x.flatten(2)


class StreamResidual(Residual):
    """The residual of one sub-layer on ``n`` streams: ``enter`` splits the streams into the branch input and
    the skip ``(R, w)``; ``forward(branch, skip)`` is ``w (x) branch + R`` (one ``addcmul``)."""

    def __init__(self, n: int, dim: int) -> None:
        super().__init__()
        self.n, self.dim = n, dim

    def scaled_skip(self, skip: Tuple[Tensor, Tensor]) -> Tensor:
        return skip[0]

    def forward(self, branch: Tensor, skip: Tuple[Tensor, Tensor]) -> Tensor:  # type: ignore[override]
        streams, weights = skip
        return torch.addcmul(streams, weights.unsqueeze(-1), branch.unsqueeze(-2))

    def extra_repr(self) -> str:
        return f"n={self.n}, dim={self.dim}"


class HyperConnection(StreamResidual):
    """Hyper-connections, dynamic (DHC, default) or static (SHC), lucidrains' parameter names."""

    def __init__(self, n: int, dim: int, dynamic: bool = True, index: int = 0) -> None:
        super().__init__(n, dim)
        self.dynamic = dynamic
        self.static_alpha = nn.Parameter(torch.zeros(n, 1 + n))
        self.static_beta = nn.Parameter(torch.ones(n))
        if dynamic:
            self.norm_gamma = nn.Parameter(torch.zeros(dim))  # lucidrains RMSNorm's gamma (output x (gamma + 1))
            self.dynamic_alpha_fn = nn.Parameter(torch.zeros(dim, 1 + n))
            self.dynamic_alpha_scale = nn.Parameter(torch.full((), HC_SCALE_INIT))
            self.dynamic_beta_fn = nn.Parameter(torch.zeros(dim))
            self.dynamic_beta_scale = nn.Parameter(torch.full((), HC_SCALE_INIT))
        self.set_index(index)

    @torch.no_grad()
    def set_index(self, index: int) -> None:
        """The release's init for the connection numbered ``index`` in its stack (``hyper_connections.py:229-236``):
        the branch reads stream ``index mod n``, the residual block is the identity."""
        self.index = index
        self.static_alpha.zero_()
        self.static_alpha[index % self.n, 0] = 1.0
        self.static_alpha[:, 1:] = torch.eye(self.n)

    def mixing(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """``(alpha, beta)``: ``(..., n, 1 + n)`` and ``(..., n)`` per token (static: ``(n, 1 + n)``, ``(n,)``).

        ``RMSNorm(x) W = (x (g + 1) W) sqrt(d) / max(||x||, 1e-12)`` (``F.normalize``'s eps): the gain goes
        into the weights and both projections into one product, so that autograd keeps no normalised copy
        of the ``n d`` streams (only ``x``, which the mixing keeps anyway)."""
        if not self.dynamic:
            return self.static_alpha, self.static_beta
        n = self.n
        weight = torch.cat([self.dynamic_alpha_fn, self.dynamic_beta_fn.unsqueeze(-1)], dim=-1)
        scale = math.sqrt(self.dim) / x.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        proj = torch.tanh((x @ (weight * (self.norm_gamma + 1).unsqueeze(-1))) * scale)
        alpha = torch.addcmul(self.static_alpha, proj[..., : n + 1], self.dynamic_alpha_scale)
        beta = torch.addcmul(self.static_beta, proj[..., n + 1], self.dynamic_beta_scale)
        return alpha, beta

    def enter(self, x: Tensor) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        alpha, beta = self.mixing(x)
        alpha = alpha.to(x.dtype)
        # two products, not one sliced: the branch's pre-norm keeps its input, and a slice would keep all n + 1
        branch_in = torch.einsum("...s,...sd->...d", alpha[..., 0], x)  # sum_s alpha[s, 0] x_s
        streams = torch.einsum("...st,...sd->...td", alpha[..., 1:], x)  # stream t: sum_s alpha[s, 1 + t] x_s
        return branch_in, (streams, beta.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dynamic={self.dynamic}, index={self.index}"


def _sinkhorn_loop(logits: Tensor, iters: int, eps: float, steps: list | None = None) -> Tensor:
    """``M = exp(H - rowmax)``, then ``iters`` row-then-column normalisations, denominators clamped at ``eps``
    (Megatron ``SinkhornKnopp.forward``, ``hyper_connection.py:67-115``: the columns end exactly at 1).
    ``steps`` collects ``(output, sum, clamped sum, dim)`` of every normalisation (for the backward)."""
    m = torch.exp(logits - logits.amax(dim=-1, keepdim=True).detach())  # the row shift changes nothing
    for _ in range(iters):
        for dim in (-1, -2):
            total = m.sum(dim=dim, keepdim=True)
            denominator = total.clamp(min=eps)
            m = m / denominator
            if steps is not None:
                steps.append((m, total, denominator, dim))
    return m


class _RecomputedSinkhorn(torch.autograd.Function):
    """Sinkhorn whose backward recomputes the iterations from the saved logits (``n^2`` values per token)
    instead of keeping every iterate (``2 iters n^2``), as Megatron's custom backward
    (``hyper_connection.py:117-146``), then runs them backwards by hand: for ``y = x / max(sum x, eps)``,
    ``dx = (dy - [sum x >= eps] sum(dy y)) / max(sum x, eps)``; for ``M = exp(H - c)``, ``dH = dM M``
    (the row shift ``c`` changes nothing). Plain tensor operations, so ``torch.compile`` traces it whole."""

    @staticmethod
    def forward(ctx, logits: Tensor, iters: int, eps: float) -> Tensor:
        ctx.iters, ctx.eps = iters, eps
        ctx.save_for_backward(logits)
        return _sinkhorn_loop(logits, iters, eps)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (logits,) = ctx.saved_tensors
        with torch.no_grad():
            steps: list = []
            _sinkhorn_loop(logits, ctx.iters, ctx.eps, steps)
            for out, total, denominator, dim in reversed(steps):
                inner = (grad * out).sum(dim=dim, keepdim=True) * (total >= ctx.eps).to(grad.dtype)
                grad = (grad - inner) / denominator
            grad = grad * torch.exp(logits - logits.amax(dim=-1, keepdim=True))
        return grad, None, None


def sinkhorn(logits: Tensor, iters: int, eps: float, recompute: bool = True) -> Tensor:
    """The projection of ``exp(logits)`` (``(..., n, n)``) towards the doubly stochastic matrices; ``recompute``:
    the backward recomputes the iterations (:class:`_RecomputedSinkhorn`), else autograd keeps them."""
    if recompute and torch.is_grad_enabled() and logits.requires_grad:
        return _RecomputedSinkhorn.apply(logits, iters, eps)
    return _sinkhorn_loop(logits, iters, eps)


def _full_precision(device: torch.device):
    """Autocast off on ``device`` (the mapping runs in float32: docs/schemes.md, "Precision")."""
    if device.type in AUTOCAST_DEVICES:
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


class ManifoldHyperConnection(StreamResidual):
    """mHC with Megatron-LM's rule and parameter names (``mapping_proj``, ``alpha_pre/post/res``, ``bias``)."""

    def __init__(
        self, n: int, dim: int, iters: int = 20, gating_init: float = 0.01, eps: float = 1e-6, recompute: bool = True
    ) -> None:
        super().__init__(n, dim)
        self.iters, self.eps, self.recompute = iters, eps, recompute
        self.mapping_proj = nn.Parameter(torch.empty(n * n + 2 * n, n * dim))
        nn.init.xavier_uniform_(self.mapping_proj)  # hyper_connection.py:203
        self.alpha_pre = nn.Parameter(torch.full((1,), float(gating_init)))
        self.alpha_post = nn.Parameter(torch.full((1,), float(gating_init)))
        self.alpha_res = nn.Parameter(torch.full((1,), float(gating_init)))
        self.bias = nn.Parameter(torch.zeros(n * n + 2 * n))
        self.observers: list = []  # fn(H_res) on each call: the diagnostics' (``diagnostics/depth_hooks.py``)
        # None: the mapping in at least float32 (this project's choice, docs/schemes.md "Precision"); a dtype: in
        # that one, for measuring what the choice costs and buys (benchmarks/mhc_precision.py)
        self.mapping_dtype: torch.dtype | None = None

    def mappings(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``(H_pre (..., n), H_post (..., n), H_res (..., n, n))`` from ``x`` ``(..., n, d)``, in at least float32
        (``mapping_dtype``, where set: in that dtype), autocast off."""
        n = self.n
        dtype = self.mapping_dtype or torch.promote_types(x.dtype, torch.float32)
        with _full_precision(x.device):
            flat = x.reshape(*x.shape[:-2], n * self.dim).to(dtype)
            r = 1.0 / (flat.norm(dim=-1, keepdim=True) / math.sqrt(n * self.dim) + self.eps)
            scale = torch.cat([self.alpha_pre.expand(n), self.alpha_post.expand(n), self.alpha_res.expand(n * n)]).to(
                dtype
            )
            h = torch.addcmul(self.bias.to(dtype), F.linear(flat, self.mapping_proj.to(dtype)) * r, scale)
            h_res = sinkhorn(h[..., 2 * n :].unflatten(-1, (n, n)), self.iters, self.eps, self.recompute)
            return torch.sigmoid(h[..., :n]), 2 * torch.sigmoid(h[..., n : 2 * n]), h_res

    def enter(self, x: Tensor) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        h_pre, h_post, h_res = self.mappings(x)
        for observe in self.observers:
            observe(h_res)
        branch_in = (h_pre.to(x.dtype).unsqueeze(-1) * x).sum(-2)  # aggregate: sum_i H_pre_i x_i
        return branch_in, (torch.matmul(h_res.to(x.dtype), x), h_post.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sinkhorn_iters={self.iters}, eps={self.eps:g}"
