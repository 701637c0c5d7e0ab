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

NORM_TYPES = ("layernorm", "scalenorm", "rmsnorm", "none")


class ScaleNorm(nn.Module):
    """``g * x / max(||x||_2, eps)`` (Nguyen & Salazar 2019, eq. 3); g starts at sqrt(d)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.g = nn.Parameter(torch.tensor(math.sqrt(dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the norm is taken in fp32: in fp16 ||x||^2 overflows for d >= 256 at moderate scale
        # (.float() is free for fp32 input, and done once for fp16)
        xf = x.float()
        # g / max(||x||, eps) per position first, then a single full-size multiply with the scale as
        # first operand: one elementwise pass fewer than g * x / norm, and the output is laid out
        # like the (contiguous) scale, as LayerNorm's is, so that on fairseq's transposed (T, B, C)
        # input the next Linear still runs as one addmm instead of a copy + mm + add
        scale = self.g / xf.norm(dim=-1, keepdim=True).clamp(min=self.eps)
        return (scale * xf).type_as(x)

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
