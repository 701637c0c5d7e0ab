"""A second residual stream beside a Post-LN stack: the un-normalised sum of the sub-layers' branch outputs.

ResiDual (Xie et al. 2023, "ResiDual: Transformer with Dual Residual Connections"), as released in
microsoft/ResiDual @ 8682f75 (a fairseq user-dir plugin). A stack carries two streams: ``x``, the
Post-LN stream of fairseq's layers, and ``raw``, which each sub-layer's dropped-out branch output
``h = dropout(F(x))`` is added to as well (the same ``h``, one dropout mask for both streams)::

    raw_0 = s * x_0                  # the embedding output (resi_dual/resi_dual.py:107, 252)
    raw  <- raw + s * h              # every sub-layer (resi_dual/resi_dual_layers.py:37, 50; 135, 163, 176)
    x    <- LN(x + h)                # every sub-layer, fairseq's Post-LN (resi_dual_layers.py:39, 51; 136, 164, 177)
    y     = alpha * x_L + norm(raw_L)   # the stack's output (resi_dual.py:131, 283)

``norm`` is the stack's final norm (the released code's LayerNorm with eps 1e-7, ``resi_dual.py:24, 157``).
``s`` is ``res_input_norm_scale``: ``norm(s * d) = norm(d)`` up to the norm's eps (a LayerNorm or RMSNorm
of ``s d`` with eps ``e`` is one of ``d`` with eps ``e / s^2``), so ``s`` changes the raw stream's range,
not the function: the released 18+18-layer fp16 configuration sets 0.05 (``hydra_config/opus.yaml:25-26``).
``start="zero"`` starts ``raw`` from zeros instead (the alternative left in a comment at lines 107 and 252).

The layers add to ``raw`` (:meth:`DualStream.add`, in the layer forwards of :mod:`.layers`); the stacks
start and close it (:meth:`DualStream.begin`, :meth:`DualStream.close`, in the stack forwards of
``fairseq_deepinit/encoder.py`` and ``decoder.py``): ``raw`` is an argument and a result of every layer
call, never state kept on a module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

STARTS = ("embedding", "zero")


@dataclass(frozen=True)
class DualStream:
    """The constants of a stack's second stream: ``scale`` (``s``), ``alpha`` and where it ``start``\\ s.

    A factor of exactly 1 is skipped: multiplying by 1.0 is exact, so the values are the released code's
    bit for bit, one elementwise operation fewer per use.
    """

    scale: float = 1.0
    alpha: float = 1.0
    start: str = "embedding"

    def __post_init__(self) -> None:
        if self.start not in STARTS:
            raise ValueError(f"unknown start {self.start!r}; choose from {', '.join(STARTS)}")

    def begin(self, x0: Tensor) -> Tensor:
        """``raw_0``: ``s * x0`` (``x0`` itself when ``s`` is 1; no layer writes its input in place), or zeros."""
        if self.start == "zero":
            return torch.zeros_like(x0)
        return x0 if self.scale == 1.0 else x0 * self.scale

    def add(self, raw: Tensor, h: Tensor) -> Tensor:
        """``raw + s * h``, ``h`` the sub-layer's branch output after dropout (``resi_dual_layers.py:37``)."""
        return raw + (h if self.scale == 1.0 else h * self.scale)

    def close(self, x: Tensor, raw: Tensor, norm: nn.Module) -> Tensor:
        """The stack's output ``alpha * x + norm(raw)`` (``resi_dual.py:131``, ``283``)."""
        return (x if self.alpha == 1.0 else x * self.alpha) + norm(raw)
