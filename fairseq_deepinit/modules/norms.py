"""Normalisation layers, one axis of the model (``--norm-type``).

- ``layernorm``: fairseq's LayerNorm (Ba et al. 2016), eps from ``--norm-eps``.
- ``scalenorm``: ScaleNorm, Nguyen & Salazar 2019 ("Transformers without Tears"), eq. (3), with one learned
  scalar ``g`` initialised to sqrt(d); eps as in :class:`ScaleNorm` (one fused kernel on a GPU).
- ``rmsnorm``: RMSNorm, Zhang & Sennrich 2019 (TwT Table 7 variant):
  ``x / sqrt(mean(x^2) + eps) * gain`` with a learned per-dimension gain initialised to 1.
- ``zc-rmsnorm``: zero-centred RMSNorm (Qwen3-Next; Gemma's ``1 + scale``): ``x / sqrt(mean(x^2) + eps) * (1 + w)``
  with ``w`` initialised at 0 (:class:`ZeroCentredRMSNorm`); weight decay pulls ``w`` (and so the gain) towards
  the identity rather than towards 0.
- ``dyt`` / ``derf``: no normalisation either, a point-wise function in its place (Zhu et al. 2025, DyT:
  ``weight * tanh(alpha x) + bias``; Chen et al. 2025, Derf: ``weight * erf(alpha x + shift) + bias``;
  :mod:`.dyt`). No statistics, so no eps; ``alpha`` (and Derf's ``shift``) per norm, their inits and the
  bias are the builder's keyword arguments (``alpha_init``, ``bias``, ``shift_init``), which the model
  gives each norm by its position (``attn``, ``ffn``, ``final``: :data:`.dyt.NORM_POSITIONS`).
- ``none``: no normalisation at all (T-Fixup, ReZero). Sub-layer norms become parameter-free
  identities and stack-level norms are removed, so no unused parameter is left behind.

Kernels: torch runs ``F.rms_norm`` as one fused kernel forward and one backward on CUDA when the gain
has the input's dtype (``aten::_fused_rms_norm``; it accumulates in fp32 for fp16/bf16 input and
rounds the output once), like LayerNorm's ``native_layer_norm``. On the CPU torch decomposes it, and
for 16-bit input rounds the normalised value to the input's dtype before the gain multiply; the
modules here therefore take the fused call where it computes in fp32 with one rounding and cast to
fp32 around it elsewhere (mixed dtypes under autocast; 16-bit input on the CPU). Mixed dtypes off the
CPU (CUDA autocast: fp32 weights, 16-bit activations) return the fp32 result as it is, as autocast
returns LayerNorm's there (``layer_norm`` is on its fp32 list, and ``rms_norm`` from torch 2.12): the
consumer's own cast (a Linear under autocast) rounds it as the norm's cast would have, and a residual
add takes it unrounded, as it takes LayerNorm's; a cast each way fewer (:func:`_from_fp32`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.modules import LayerNorm
from torch.autograd.function import once_differentiable

from .dyt import Derf, DyT

NORM_TYPES = ("layernorm", "scalenorm", "rmsnorm", "zc-rmsnorm", "dyt", "derf", "none")
#: the norm types that compute no statistics and divide by nothing (so take no eps): a point-wise function
#: in the place of each norm, with its own learnable scalars
POINTWISE_NORMS = ("dyt", "derf")


def _fused_rms_norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.rms_norm(x, ..., weight)`` computes in fp32 (or wider) and rounds its output once.

    torch fuses only when the dtypes agree; on the CPU its decomposition rounds a 16-bit input's
    normalised value before the gain multiply, so there only fp32 / fp64 input qualifies.
    """
    return weight.dtype == x.dtype and (x.device.type != "cpu" or x.dtype in (torch.float32, torch.float64))


def _from_fp32(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The fp32 result ``y`` of a norm of ``x`` that could not take the fused call in ``x``'s dtype: back in
    ``x``'s dtype on the CPU (as CPU autocast returns LayerNorm's), as it is elsewhere (module docstring)."""
    return y.type_as(x) if x.device.type == "cpu" else y


class _ScaleNormFunction(torch.autograd.Function):
    """``g x / sqrt(||x||^2 + eps^2)`` (:class:`ScaleNorm`) with a hand-written backward, the CPU path.

    With ``c = sqrt(||x||^2 + eps^2)`` and ``s = g / c``: ``y = s x``; ``dx = s dy - (s (dy.x) / c^2) x``;
    ``dg = sum_rows (dy.x) / c`` (the same gradients as autograd through the formula). Two full-size
    passes forward and three backward, about LayerNorm's cost, where torch's CPU decomposition of
    ``F.rms_norm`` runs some twenty (2.6x slower per call, measured). The scale is the multiply's first
    operand, so the output is laid out like the (contiguous) scale, as LayerNorm's is: on fairseq's
    transposed (T, B, C) input the next Linear still runs as one addmm instead of a copy + mm + add.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
        c = torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), x.new_tensor(eps))
        ctx.save_for_backward(x, g, c)
        return (g / c) * x

    @staticmethod
    @once_differentiable  # the saved norm is not re-derived from x: no silent wrong double backward
    def backward(ctx, grad: torch.Tensor):
        x, g, c = ctx.saved_tensors
        inv = c.reciprocal()
        dot = torch.linalg.vecdot(grad, x, dim=-1).unsqueeze(-1)  # dy.x per row
        grad_x = grad_g = None
        if ctx.needs_input_grad[0]:
            scale = g * inv
            grad_x = (scale * grad).addcmul_(x, scale * dot * inv * inv, value=-1.0)
        if ctx.needs_input_grad[1]:
            grad_g = (dot * inv).sum().reshape(g.shape).to(g.dtype)
        return grad_x, grad_g, None


def scalenorm_as_rms_norm(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`ScaleNorm` as one ``F.rms_norm`` call (its path off the CPU; any device computes it)."""
    dim = x.size(-1)
    gain = (g / math.sqrt(dim)).expand(dim)
    # eps^2 / d, kept a normal fp32 number: the kernel adds it in fp32, and a flushed 0 would make x = 0 NaN
    rms_eps = max(eps * eps / dim, torch.finfo(torch.float32).tiny)
    if _fused_rms_norm_applies(x, gain):
        return F.rms_norm(x, (dim,), gain, rms_eps)
    return _from_fp32(F.rms_norm(x.float(), (dim,), gain.float(), rms_eps), x)


class ScaleNorm(nn.Module):
    """ScaleNorm (Nguyen & Salazar 2019, eq. 3): ``g * x / sqrt(||x||_2^2 + eps^2)``; g starts at sqrt(d).

    The paper and its released code (tnq177/transformers_without_tears @ c2dfaaa, layers.py:139-141:
    ``scale / torch.norm(x, dim=-1, keepdim=True).clamp(min=eps)``) divide by ``max(||x||, eps)``.
    Dividing by ``hypot(||x||, eps)`` instead makes the norm one fused call on a GPU:
    ``F.rms_norm(x, (d,), (g / sqrt(d)).expand(d), eps^2 / d)``, since
    ``x / sqrt(mean(x^2) + eps^2/d) * g / sqrt(d) = g x / sqrt(||x||^2 + eps^2)``.

    Where the two differ, with ``n = ||x||``: the output is the released one times
    ``max(n, eps) / hypot(n, eps)``, a relative change of ``-eps^2 / (2 n^2)`` at most for ``n >= eps``
    (below fp32 round-off, 2^-24, for ``n > 2^11.5 eps``: ``n > 0.029`` at the default eps 1e-5) and
    ``-n^2 / (2 eps^2)`` at most for ``n < eps``; largest at ``n = eps``: 1/sqrt(2), -29 %. At ``x = 0`` both
    are 0 with the same gradient ``g / eps``. Rows that small are not met in training (the TwT model's
    inputs to a norm have norms of order sqrt(d)); the formula is smooth where the released one has a
    kink at ``n = eps``.

    Computed in fp32 (or wider): on the CPU by :class:`_ScaleNormFunction` on ``x.float()``; elsewhere
    by the fused call, which accumulates in fp32 for fp16/bf16 input; there the gain ``g / sqrt(d)`` is
    rounded to the input's dtype when ``g`` has it (``--fp16`` weights): one more rounding of the output
    scale, at most 2^-11 relative in fp16, the size of the output's own rounding. Mixed dtypes (autocast)
    go through fp32, and back to the input's dtype on the CPU only (module docstring).
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.g = nn.Parameter(torch.tensor(math.sqrt(dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            # torch decomposes rms_norm on the CPU; the hand-written backward is 2.6x faster there
            return _ScaleNormFunction.apply(x.float(), self.g, self.eps).type_as(x)
        return scalenorm_as_rms_norm(x, self.g, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` (Zhang & Sennrich 2019, eq. 4), computed in fp32 or wider.

    One ``F.rms_norm`` call (one fused kernel each way on a GPU) when the weight has the input's dtype
    (``--fp16``: the kernel accumulates in fp32), the same call on fp32 copies otherwise (its fp32 result
    kept off the CPU: module docstring).
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused_rms_norm_applies(x, self.weight):
            return F.rms_norm(x, (self.dim,), self.weight, self.eps)
        return _from_fp32(F.rms_norm(x.float(), (self.dim,), self.weight.float(), self.eps), x)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class ZeroCentredRMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * (1 + w)``, ``w`` initialised at 0 (zero-centred RMSNorm).

    Released code: HF transformers @ 7515843 ``models/qwen3_next/modeling_qwen3_next.py`` ``Qwen3NextRMSNorm``
    (``weight = zeros(dim)``; ``forward``: ``x.float() * rsqrt(x.float().pow(2).mean(-1) + eps) * (1.0 +
    weight.float())``, then ``type_as(x)``); the same gain as google-deepmind/gemma @ 7691fd4
    ``gemma/gm/nn/_layers.py:46,57`` ``RMSNorm`` (``scale`` zeros-initialised, ``normed_inputs * (1 + scale)``).
    The norm, the ``1 + w`` and the product are computed in fp32 (fp64 kept) and rounded once to the input's
    dtype, as released; under mixed dtypes off the CPU (autocast) the fp32 result is returned as
    :class:`RMSNorm` returns its own.
    One ``F.rms_norm`` call with the gain ``1 + w`` (a ``d``-vector add on top of the RMSNorm's cost).
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x if x.dtype == torch.float64 else x.float()
        y = F.rms_norm(wide, (self.dim,), 1.0 + self.weight.to(wide.dtype), self.eps)
        return y.type_as(x) if self.weight.dtype == x.dtype else _from_fp32(y, x)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, gain=1+w"


def build_norm(norm_type: str, dim: int, eps: float | None = 1e-5, export: bool = False, **pointwise) -> nn.Module:
    """The sub-layer normalisation for ``--norm-type``; ``none`` gives a parameter-free identity.

    ``pointwise``: the keyword arguments of :class:`~.dyt.DyT` / :class:`~.dyt.Derf` (``alpha_init``,
    ``bias``; Derf's ``shift_init``), for ``dyt`` / ``derf`` only; ``eps`` is unused there.
    """
    if norm_type in POINTWISE_NORMS:
        return (DyT if norm_type == "dyt" else Derf)(dim, eps, **pointwise)
    if pointwise:
        raise ValueError(f"--norm-type {norm_type} takes no {', '.join(sorted(pointwise))}")
    if norm_type == "layernorm":
        return LayerNorm(dim, eps=eps, export=export)
    if norm_type == "scalenorm":
        return ScaleNorm(dim, eps=eps)
    if norm_type == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    if norm_type == "zc-rmsnorm":
        return ZeroCentredRMSNorm(dim, eps=eps)
    if norm_type == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm type {norm_type!r}; choose from {', '.join(NORM_TYPES)}")


def is_norm(module: nn.Module) -> bool:
    """A norm layer of the model, point-wise ones (DyT, Derf) included."""
    return isinstance(module, (nn.LayerNorm, ScaleNorm, RMSNorm, ZeroCentredRMSNorm, DyT, Derf))
