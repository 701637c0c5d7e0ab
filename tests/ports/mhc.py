"""Manifold-constrained hyper-connections, mHC (Xie et al., DeepSeek, arXiv 2512.24880).

``x_{l+1} = H_res x_l + H_post^T F(H_pre x_l)`` on ``n`` streams ``x_l`` of shape ``(n, C)`` per token, with
``H_res`` projected onto the doubly stochastic matrices by Sinkhorn-Knopp. Two released forms are
ported (streams a separate axis, ``x`` of shape ``(B, T, n, C)``):

**Megatron-LM** ``megatron/core/transformer/hyper_connection.py`` (commit d98e8a64):

- mappings (``216-259``): ``r = 1 / (||x_flat|| / sqrt(n C) + 1e-6)``; ``proj = x_flat @ phi^T`` (``phi``:
  ``(n^2 + 2n, n C)``, no bias, xavier-uniform init); ``h = r * proj * alpha + b`` with ``alpha`` = one
  learned scalar per group (pre, post, res; init ``mhc_init_gating_factor = 0.01``) and ``b`` zeros;
  ``H_pre = sigmoid(h[:n])``, ``H_post = 2 sigmoid(h[n:2n])``, ``H_res = Sinkhorn(h[2n:].view(n, n))``;
- Sinkhorn (``54-146``): ``M = exp(H - rowmax)``, then ``iters`` times a row then a column normalisation,
  each denominator clamped at ``1e-6`` (so the columns end exactly at 1); 20 iterations
  (``transformer_config.py`` ``mhc_sinkhorn_iterations``), 4 streams (``mhc_num_residual_streams``);
- sub-layer (``370-418``, ``600-642``): ``aggregate = sum_i H_pre_i x_i`` -> the layer's own pre-norm and
  branch; ``out = H_res @ x + H_post ⊗ F`` (``torch.bmm(h_res, residual)``: ``out_i = sum_j H_res[i, j] x_j``);
- block ends (``497-535``; ``transformer_block.py:607-612, 749-752``): ``n`` copies in, the *mean* of the
  streams out, before the final norm.

**DeepSeek-V4** as ported to HF transformers (``models/deepseek_v4/modeling_deepseek_v4.py`` at commit
01976081, ``DeepseekV4HyperConnection.forward``, ``DeepseekV4HyperHead``, ``DeepseekV4DecoderLayer``;
config ``hc_mult = 4``, ``hc_sinkhorn_iters = 20``, ``hc_eps = 1e-6``):

- ``flat = RMSNorm_unweighted(x_flat)`` (eps ``rms_norm_eps`` 1e-6), ``mix = flat @ fn^T``;
  ``pre = sigmoid(mix[:n] * scale[0] + base[:n]) + eps``, ``post = 2 sigmoid(mix[n:2n] * scale[1] + base[n:2n])``,
  ``comb = softmax_row(mix[2n:] * scale[2] + base[2n:]) + eps``, one column normalisation, then
  ``iters - 1`` (row, column) normalisations, denominators ``+ eps``;
- ``out = post ⊗ F + comb^T @ x`` (the comb matrix is used transposed: ``H_res = comb^T``);
- the stack ends with a learned collapse (``DeepseekV4HyperHead``: ``sigmoid(...) + eps`` weights over
  the streams) before the final norm.

Also here: lucidrains' ``sinkhorn_knopps`` and log-domain variant
(``hyper_connections/manifold_constrained_hyper_connections.py:49-71``), used as independent
formulations of the same projection, and the ``H_res`` diagnostics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

MEGATRON_EPS = 1e-6  # SinkhornKnopp.eps and the mapping norm's eps (hyper_connection.py:64, 194)
ALPHA_INIT = 0.01  # TransformerConfig.mhc_init_gating_factor
SINKHORN_ITERS = 20  # mhc_sinkhorn_iterations; DeepseekV4Config.hc_sinkhorn_iters
STREAMS = 4  # mhc_num_residual_streams; DeepseekV4Config.hc_mult
V4_EPS = 1e-6  # DeepseekV4Config.hc_eps


def sinkhorn_megatron(logits: Tensor, iters: int = SINKHORN_ITERS, eps: float = MEGATRON_EPS) -> Tensor:
    """Megatron's ``SinkhornKnopp.forward`` (``hyper_connection.py:67-115``): row then column, columns last."""
    m = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    for _ in range(iters):
        m = m / m.sum(dim=-1, keepdim=True).clamp(min=eps)
        m = m / m.sum(dim=-2, keepdim=True).clamp(min=eps)
    return m


def sinkhorn_deepseek_v4(logits: Tensor, iters: int = SINKHORN_ITERS, eps: float = V4_EPS) -> Tensor:
    """DeepSeek-V4's comb projection: row softmax ``+ eps``, a column step, ``iters - 1`` (row, column) steps."""
    c = torch.softmax(logits, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def sinkhorn_lucidrains(log_alpha: Tensor, iters: int = SINKHORN_ITERS) -> Tensor:
    """lucidrains ``sinkhorn_knopps`` (``manifold_constrained_hyper_connections.py:49-61``): column max
    shift, L1-normalise dim -2 then dim -1 (rows last)."""
    a = torch.exp(log_alpha - log_alpha.amax(dim=-2, keepdim=True))
    for _ in range(iters):
        a = F.normalize(a, p=1, dim=-2)
        a = F.normalize(a, p=1, dim=-1)
    return a


def sinkhorn_log_domain(log_alpha: Tensor, iters: int = SINKHORN_ITERS) -> Tensor:
    """lucidrains ``log_domain_sinkhorn_knopps`` (``63-71``): alternating ``log_softmax`` over dim -2, -1."""
    for _ in range(iters):
        log_alpha = F.log_softmax(log_alpha, dim=-2)
        log_alpha = F.log_softmax(log_alpha, dim=-1)
    return log_alpha.exp()


@dataclass
class MHCParams:
    """Megatron's ``HyperConnectionModule`` parameters (``hyper_connection.py:182-193``)."""

    phi: Tensor  # (n * n + 2 n, n C): mapping_proj.weight
    alpha_pre: float | Tensor = ALPHA_INIT
    alpha_post: float | Tensor = ALPHA_INIT
    alpha_res: float | Tensor = ALPHA_INIT
    bias: Tensor | None = None  # (n * n + 2 n,), zeros at init

    @property
    def n(self) -> int:
        return int(round((self.phi.shape[0] + 1) ** 0.5)) - 1


def init_megatron(n: int, c: int, generator: torch.Generator, dtype=torch.float64) -> MHCParams:
    """``_init_weights`` (``198-214``): ``phi`` xavier-uniform, ``alpha`` 0.01, bias zeros."""
    fan_out, fan_in = n * n + 2 * n, n * c
    bound = (6.0 / (fan_in + fan_out)) ** 0.5
    phi = (torch.rand(fan_out, fan_in, generator=generator, dtype=dtype) * 2 - 1) * bound
    return MHCParams(phi, bias=torch.zeros(fan_out, dtype=dtype))


def mappings_megatron(x: Tensor, p: MHCParams, iters: int = SINKHORN_ITERS, eps: float = MEGATRON_EPS):
    """``(H_pre (B, T, n), H_post (B, T, n), H_res (B, T, n, n))`` from ``x`` ``(B, T, n, C)`` (``216-285``)."""
    n = x.shape[-2]
    flat = x.reshape(*x.shape[:-2], -1)
    r = 1.0 / (flat.norm(dim=-1, keepdim=True) / flat.shape[-1] ** 0.5 + eps)
    scale = torch.cat([torch.as_tensor(a, dtype=x.dtype).reshape(1).expand(k) for a, k in
                       ((p.alpha_pre, n), (p.alpha_post, n), (p.alpha_res, n * n))])  # fmt: skip
    h = r * (flat @ p.phi.T) * scale
    if p.bias is not None:
        h = h + p.bias
    h_res = sinkhorn_megatron(h[..., 2 * n :].reshape(*h.shape[:-1], n, n), iters, eps)
    return torch.sigmoid(h[..., :n]), 2 * torch.sigmoid(h[..., n : 2 * n]), h_res


def mappings_paper(x: Tensor, p: MHCParams, iters: int = 200) -> tuple[Tensor, Tensor, Tensor]:
    """The paper's order, RMSNorm first (no gain, no eps), then the projection; Sinkhorn in the log domain
    to convergence. Equal to :func:`mappings_megatron` up to Megatron's ``+ eps`` and its finite iterations."""
    n = x.shape[-2]
    flat = x.reshape(*x.shape[:-2], -1)
    normed = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True))
    proj = normed @ p.phi.T
    b = torch.zeros(proj.shape[-1], dtype=x.dtype) if p.bias is None else p.bias
    pre = torch.sigmoid(p.alpha_pre * proj[..., :n] + b[:n])
    post = 2 * torch.sigmoid(p.alpha_post * proj[..., n : 2 * n] + b[n : 2 * n])
    res = (p.alpha_res * proj[..., 2 * n :] + b[2 * n :]).reshape(*proj.shape[:-1], n, n)
    return pre, post, sinkhorn_log_domain(res, iters)


def mappings_deepseek_v4(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int = SINKHORN_ITERS,
                         eps: float = V4_EPS, rms_eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(pre, post, comb)`` of ``DeepseekV4HyperConnection.forward``; ``fn``: ``((2 + n) n, n C)``, ``scale``: 3."""
    n = x.shape[-2]
    flat = x.reshape(*x.shape[:-2], -1)
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + rms_eps)
    mix = flat @ fn.T
    pre = torch.sigmoid(mix[..., :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(mix[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = mix[..., 2 * n :].reshape(*mix.shape[:-1], n, n) * scale[2] + base[2 * n :].reshape(n, n)
    return pre, post, sinkhorn_deepseek_v4(comb_logits, iters, eps)


def sublayer(x: Tensor, branch: Callable[[Tensor], Tensor], h_pre: Tensor, h_post: Tensor, h_res: Tensor) -> Tensor:
    """``H_res @ x + H_post ⊗ F(sum_i H_pre_i x_i)`` (Megatron ``aggregate``, ``apply_h_res``, ``_apply_h_post``).
    DeepSeek-V4's form is this with ``h_res = comb.transpose(-1, -2)``."""
    y = branch((h_pre.unsqueeze(-1) * x).sum(-2))
    return torch.matmul(h_res, x) + h_post.unsqueeze(-1) * y.unsqueeze(-2)


def expand(x: Tensor, n: int) -> Tensor:
    """``input_expand`` (``497-514``): ``n`` copies, ``(B, T, C) -> (B, T, n, C)``."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1])


def contract_mean(x: Tensor) -> Tensor:
    """``output_contract`` (``516-535``): the mean of the streams."""
    return x.mean(-2)


def hyper_head_v4(x: Tensor, fn: Tensor, base: Tensor, scale: Tensor, eps: float = V4_EPS, rms_eps: float = 1e-6):
    """``DeepseekV4HyperHead.forward``: ``sum_i (sigmoid(RMSNorm(x_flat) fn_i * scale + base_i) + eps) x_i``."""
    flat = x.reshape(*x.shape[:-2], -1)
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + rms_eps)
    pre = torch.sigmoid(flat @ fn.T * scale + base) + eps
    return (pre.unsqueeze(-1) * x).sum(-2)


def h_res_diagnostics(h_res: Tensor) -> dict[str, Tensor]:
    """Over all tokens: the largest spectral norm of ``H_res`` and the largest row / column sum drift from 1
    (a doubly stochastic matrix has spectral norm exactly 1 and no drift; the issue's logged statistics)."""
    return {
        "spectral_norm_max": torch.linalg.matrix_norm(h_res, ord=2).max(),
        "row_sum_drift": (h_res.sum(-1) - 1).abs().max(),
        "col_sum_drift": (h_res.sum(-2) - 1).abs().max(),
        "min_entry": h_res.min(),
    }
