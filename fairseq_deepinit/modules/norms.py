"""Normalisation layers, one axis of the model (``--norm-type``).

- ``layernorm``: fairseq's LayerNorm (Ba et al. 2016), eps from ``--norm-eps``.
- ``scalenorm``: ScaleNorm, Nguyen & Salazar 2019 ("Transformers without Tears"), eq. (3):
  ``ScaleNorm(x) = g * x / max(||x||_2, eps)`` with one learned scalar ``g`` initialised to sqrt(d).
- ``rmsnorm``: RMSNorm, Zhang & Sennrich 2019 (TwT Table 7 variant):
  ``x / sqrt(mean(x^2) + eps) * gain`` with a learned per-dimension gain initialised to 1.
- ``none``: no normalisation at all (T-Fixup, ReZero). Sub-layer norms become parameter-free
  identities and stack-level norms are removed, so no unused parameter is left behind.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.modules import LayerNorm
from torch.autograd.function import once_differentiable

NORM_TYPES = ("layernorm", "scalenorm", "rmsnorm", "none")


class _ScaleNormFunction(torch.autograd.Function):
    """ScaleNorm's eq. 3 with a hand-written backward (same gradients as autograd through the formula).

    With ``c = max(||x||, eps)`` and ``s = g / c``: ``y = s x``; ``dx = s dy - (s (dy.x) / c^2) x`` on
    rows where the norm is not clamped (``||x|| >= eps``) and ``s dy`` on clamped rows;
    ``dg = sum_rows (dy.x) / c``. Two full-size passes forward and three backward, against about
    eight for autograd through norm / clamp / div / mul, which made ScaleNorm several times slower
    than LayerNorm's fused kernels. The scale is the multiply's first operand, so the output is
    laid out like the (contiguous) scale, as LayerNorm's is: on fairseq's transposed (T, B, C)
    input the next Linear still runs as one addmm instead of a copy + mm + add.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        live = norm >= eps  # clamp's gradient mask: rows whose norm is not replaced by eps
        clamped = norm.clamp(min=eps)
        ctx.save_for_backward(x, g, clamped, live)
        return (g / clamped) * x

    @staticmethod
    @once_differentiable  # the saved norm is not re-derived from x: no silent wrong double backward
    def backward(ctx, grad: torch.Tensor):
        x, g, clamped, live = ctx.saved_tensors
        inv = clamped.reciprocal()
        dot = torch.linalg.vecdot(grad, x, dim=-1).unsqueeze(-1)  # dy.x per row
        grad_x = grad_g = None
        if ctx.needs_input_grad[0]:
            scale = g / clamped
            coef = torch.where(live, scale * dot * inv * inv, 0.0)
            grad_x = (scale * grad).addcmul_(x, coef, value=-1.0)
        if ctx.needs_input_grad[1]:
            grad_g = (dot * inv).sum().reshape(g.shape).to(g.dtype)
        return grad_x, grad_g, None


class ScaleNorm(nn.Module):
    """``g * x / max(||x||_2, eps)`` (Nguyen & Salazar 2019, eq. 3); g starts at sqrt(d)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.g = nn.Parameter(torch.tensor(math.sqrt(dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the norm is taken in fp32: in fp16 ||x||^2 overflows for d >= 256 at moderate scale
        # (.float() is free for fp32 input)
        return _ScaleNormFunction.apply(x.float(), self.g, self.eps).type_as(x)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` (Zhang & Sennrich 2019, eq. 4)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x.float(), (self.dim,), self.weight.float(), self.eps).type_as(x)
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight.float()).type_as(x)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def build_norm(norm_type: str, dim: int, eps: float = 1e-5, export: bool = False) -> nn.Module:
    """The sub-layer normalisation for ``--norm-type``; ``none`` gives a parameter-free identity."""
    if norm_type == "layernorm":
        return LayerNorm(dim, eps=eps, export=export)
    if norm_type == "scalenorm":
        return ScaleNorm(dim, eps=eps)
    if norm_type == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    if norm_type == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm type {norm_type!r}; choose from {', '.join(NORM_TYPES)}")


def build_optional_norm(norm_type: str, dim: int, eps: float = 1e-5, export: bool = False):
    """A stack-level norm (final Pre-LN norm, embedding norm): ``None`` when there is no norm."""
    return None if norm_type == "none" else build_norm(norm_type, dim, eps, export)


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, ScaleNorm, RMSNorm))
