"""Point-wise functions in place of a norm: DyT and Derf, and the learnable embedding scale that goes with them.

- :class:`DyT`: Dynamic Tanh (Zhu, Chen, He, LeCun, Liu 2025, eq. 1): ``weight * tanh(alpha * x) + bias``,
  scalar ``alpha`` (init 0.5): jiachenzhu/DyT @ aab5dde ``dynamic_tanh.py:6-23``; ``bias=False`` is the
  LLaMA variant (``other_tasks/LLaMA/fms_fsdp/models/llama.py:32-46``), alpha per position
  (:data:`RELEASED_ALPHA_INIT`).
- :class:`Derf`: Dynamic erf (Chen, Lu, Zhu, Sun, Liu 2025): ``weight * erf(alpha * x + shift) + bias``:
  zlab-princeton/Derf @ 8dd9ea3 ``ViT/dynamic_erf.py:6-26``.
- :func:`learnable_embed_scale`: the learnable embedding multiplier (``llama.py:208-209,383``).

Released parameter names and shapes (``alpha``, ``shift`` of shape ``(1,)``), computed in the dtype type
promotion gives (as released), each an autograd function with its backward written out. Precision and
kernel counts: docs/schemes.md, "DyT and Derf".
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

DYT_ALPHA_INIT = 0.5  # dynamic_tanh.py:7
DERF_ALPHA_INIT = 0.5  # ViT/dynamic_erf.py:7
DERF_SHIFT_INIT = 0.0  # ViT/dynamic_erf.py:7

# erf'(z) = (2 / sqrt(pi)) exp(-z^2) = exp(LOG_ERF_SLOPE - z^2): the constant rides in the exponent
LOG_ERF_SLOPE = math.log(2.0 / math.sqrt(math.pi))

#: Norm positions with their own alpha init in the released LLaMA / GPT-2 code: ``attn`` (the norm
#: before attention, ``llama.py:85-88``), ``ffn`` (before the FFN, ``89-92``), ``final`` (the stack's last
#: norm, ``dec_norm``, ``245-248``).
NORM_POSITIONS = ("attn", "ffn", "final")


@dataclasses.dataclass(frozen=True)
class AlphaInit:
    """Initial ``alpha`` of DyT/Derf per norm position (:data:`NORM_POSITIONS`)."""

    attn: float
    ffn: float
    final: float

    def at(self, position: str) -> float:
        if position not in NORM_POSITIONS:
            raise ValueError(f"unknown norm position {position!r}; choose from {', '.join(NORM_POSITIONS)}")
        return getattr(self, position)


#: Released alpha inits. ``dyt`` / ``derf``: one value for every norm (``dynamic_tanh.py:7``,
#: ``ViT/dynamic_erf.py:7``; ViT, ConvNeXt, wav2vec 2.0, DiT ...). ``llama-config``: the defaults of
#: ``LLaMAConfig`` (``llama.py:73-75``) and of the Derf GPT-2 patch's ``GPTConfig``, which its README
#: leaves to the user. ``llama2_*``: the DyT LLaMA README's values (attn, ffn, final = dec) per model;
#: widths and depths in :data:`LLAMA_SIZES`. None is released for widths below 4096.
RELEASED_ALPHA_INIT = {
    "dyt": AlphaInit(DYT_ALPHA_INIT, DYT_ALPHA_INIT, DYT_ALPHA_INIT),
    "derf": AlphaInit(DERF_ALPHA_INIT, DERF_ALPHA_INIT, DERF_ALPHA_INIT),
    "llama-config": AlphaInit(1.0, 1.0, 1.0),
    "llama2_7b": AlphaInit(0.8, 0.2, 0.2),
    "llama2_13b": AlphaInit(0.6, 0.15, 0.15),
    "llama2_34b": AlphaInit(0.2, 0.05, 0.05),
    "llama2_70b": AlphaInit(0.2, 0.05, 0.05),
}

#: (width, layers) of the released LLaMA 2 runs (fms_fsdp ``utils/config_utils.py``).
LLAMA_SIZES = {"llama2_7b": (4096, 32), "llama2_13b": (5120, 40), "llama2_34b": (8192, 48), "llama2_70b": (8192, 80)}


def _contiguous_like(x: torch.Tensor, scalar: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``x``'s shape in the dtype of ``x * scalar``.

    (``torch.result_type`` would stop ``torch.compile``'s graph; a one-element tensor promotes like a
    dimensioned one, so ``promote_types`` of the two dtypes is the product's dtype.)
    """
    dtype = x.dtype if x.dtype == scalar.dtype else torch.promote_types(x.dtype, scalar.dtype)
    return torch.empty(x.shape, dtype=dtype, device=x.device)


def _full_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum(a * b)`` over every element: one ``dot`` where both flatten without a copy (cuBLAS ``dotEx``
    accumulates 16-bit input in fp32, as ``sum`` does; its length is an int32)."""
    if a.dtype == b.dtype and a.is_contiguous() and b.is_contiguous() and a.numel() < 2**31:
        return torch.dot(a.view(-1), b.view(-1))
    return torch.sum(a * b)


def _affine_backward(dy: torch.Tensor, t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, needs: tuple):
    """Gradients of ``weight`` and ``bias`` in ``y = t * weight + bias`` (``needs``: whether each is wanted)."""
    grad_weight = (dy * t).sum_to_size(weight.shape) if needs[0] else None
    grad_bias = dy.sum_to_size(bias.shape) if bias is not None and needs[1] else None
    return grad_weight, grad_bias


class _DyTFunction(torch.autograd.Function):
    """``weight * tanh(alpha * x) + bias`` with ``z = alpha x``, ``t = tanh z``:
    ``dx = alpha dz``, ``dalpha = sum(dz x)``, ``dz = (dy weight)(1 - t^2)``, ``dweight = sum_rows(dy t)``,
    ``dbias = sum_rows(dy)`` (the gradients autograd takes through the released formula)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        t = torch.mul(x, alpha, out=_contiguous_like(x, alpha)).tanh_()
        ctx.save_for_backward(x, alpha, weight, t, bias)
        return t * weight if bias is None else torch.addcmul(bias, t, weight)

    @staticmethod
    @once_differentiable  # the hand-written backward is not itself differentiable
    def backward(ctx, dy: torch.Tensor):
        x, alpha, weight, t, bias = ctx.saved_tensors
        grad_x = grad_alpha = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            # into a contiguous buffer, as LayerNorm's backward returns its input gradient: a gradient in the
            # incoming (T, B, C)-transposed layout would make the view backward upstream copy it
            dz = torch.ops.aten.tanh_backward(torch.mul(dy, weight, out=_contiguous_like(dy, weight)), t)
            if ctx.needs_input_grad[0]:
                grad_x = dz * alpha
            if ctx.needs_input_grad[1]:
                grad_alpha = _full_dot(dz, x).reshape(alpha.shape)
        grad_weight, grad_bias = _affine_backward(dy, t, weight, bias, ctx.needs_input_grad[2:])
        return grad_x, grad_alpha, grad_weight, grad_bias


class _DerfFunction(torch.autograd.Function):
    """``weight * erf(alpha * x + shift) + bias`` with ``z = alpha x + shift``, ``t = erf z``:
    ``dz = (dy weight) (2 / sqrt(pi)) exp(-z^2)``, ``dx = alpha dz``, ``dalpha = sum(dz x)``,
    ``dshift = sum(dz)``, ``dweight = sum_rows(dy t)``, ``dbias = sum_rows(dy)``."""

    @staticmethod
    def forward(ctx, x, alpha, shift, weight, bias):
        # shift and alpha: parameters of one module, one dtype
        z = torch.addcmul(shift, x, alpha, out=_contiguous_like(x, alpha))
        t = torch.erf(z)
        ctx.save_for_backward(x, alpha, shift, weight, z, t, bias)
        return t * weight if bias is None else torch.addcmul(bias, t, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x, alpha, shift, weight, z, t, bias = ctx.saved_tensors
        grad_x = grad_alpha = grad_shift = None
        if any(ctx.needs_input_grad[:3]):
            # exp(log(2/sqrt(pi)) - z^2): erf's slope in three kernels; |z| large gives exp(-inf) = 0, not NaN
            dz = torch.rsub(z * z, LOG_ERF_SLOPE).exp_().mul_(dy * weight)
            if ctx.needs_input_grad[0]:
                grad_x = dz * alpha
            if ctx.needs_input_grad[1]:
                grad_alpha = _full_dot(dz, x).reshape(alpha.shape)
            if ctx.needs_input_grad[2]:
                grad_shift = dz.sum().reshape(shift.shape)
        grad_weight, grad_bias = _affine_backward(dy, t, weight, bias, ctx.needs_input_grad[3:])
        return grad_x, grad_alpha, grad_shift, grad_weight, grad_bias


class DyT(nn.Module):
    """Dynamic Tanh, ``weight * tanh(alpha * x) + bias`` over the last dimension (jiachenzhu/DyT
    ``dynamic_tanh.py:6-23``; ``bias=False``: ``llama.py:32-46``).

    Args:
        dim: size of the last dimension (``weight`` and ``bias`` have one entry per channel).
        eps: accepted so that a norm builder's ``(dim, eps)`` call works; unused (nothing is divided).
        alpha_init: initial value of the scalar ``alpha`` (released: 0.5; per position in the LLaMA
            code: :data:`RELEASED_ALPHA_INIT`).
        bias: a learnable per-channel bias (DyT's default) or none (the LLaMA variant).
    """

    def __init__(self, dim: int, eps: float | None = None, alpha_init: float = DYT_ALPHA_INIT, bias: bool = True):
        super().__init__()
        self.dim = dim
        self.normalized_shape = (dim,)
        self.alpha_init = float(alpha_init)
        self.alpha = nn.Parameter(torch.empty(1))
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.alpha.fill_(self.alpha_init)
            self.weight.fill_(1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DyTFunction.apply(x, self.alpha, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.dim}, alpha_init={self.alpha_init}, bias={self.bias is not None}"


class Derf(nn.Module):
    """Dynamic erf, ``weight * erf(alpha * x + shift) + bias`` over the last dimension
    (zlab-princeton/Derf ``ViT/dynamic_erf.py:6-26``; GPT-2: ``language model/model_derf.patch``).

    Args: as :class:`DyT`, and ``shift_init``, the initial value of the scalar ``shift`` (released: 0).
    """

    def __init__(
        self,
        dim: int,
        eps: float | None = None,
        alpha_init: float = DERF_ALPHA_INIT,
        bias: bool = True,
        shift_init: float = DERF_SHIFT_INIT,
    ):
        super().__init__()
        self.dim = dim
        self.normalized_shape = (dim,)
        self.alpha_init = float(alpha_init)
        self.shift_init = float(shift_init)
        self.alpha = nn.Parameter(torch.empty(1))
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim)) if bias else None
        self.shift = nn.Parameter(torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.alpha.fill_(self.alpha_init)
            self.shift.fill_(self.shift_init)
            self.weight.fill_(1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DerfFunction.apply(x, self.alpha, self.shift, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.dim}, alpha_init={self.alpha_init}, shift_init={self.shift_init}, bias={self.bias is not None}"


def learnable_embed_scale(init: float) -> nn.Parameter:
    """A learnable embedding multiplier, shape ``(1,)`` like ``shared_scale`` (``llama.py:208``).

    Assigned to a fairseq encoder's or decoder's ``embed_scale`` (a float there: ``sqrt(d)``, or 1 with
    ``--no-scale-embedding``), fairseq's own ``self.embed_scale * self.embed_tokens(tokens)`` makes it
    learnable with ``init`` = that float, unchanged at init. fairseq scales the token embedding before
    adding positions, as the LLaMA code does (no absolute positions there, ``383``); the Derf GPT-2
    patch scales ``tok_emb + pos_emb``.
    """
    return nn.Parameter(torch.full((1,), float(init)))
