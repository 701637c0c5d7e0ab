"""The gate of a gated feed-forward network (``--ffn-type``): the FFN ``fc2(act(fc1(x)))`` becomes
``fc2(gate(x, fc1(x)))`` with a third matrix ``W_g`` (:class:`FFNGate`, ``layer.ffn_gate``).

- ``swiglu``, plain SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer", arXiv 2002.05202, eq. 6,
  ``FFN_SwiGLU(x) = (Swish_1(x W) * x V) W_2``, ``Swish_1(z) = z sigmoid(z)``): ``silu(W_g x + b_g) * (W_1 x + b_1)``,
  fairseq's ``fc1`` as the linear half ``V`` and the gate ``W_g`` as ``W``; the form of HF transformers'
  ``LlamaMLP.forward`` (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, ``hidden_act="silu"``);
- ``swiglu-oss``, gpt-oss's clamped variant (openai/gpt-oss @ 7b58334 ``gpt_oss/torch/model.py:249-255``): with
  ``g = W_g x + b_g``, ``u = W_1 x + b_1``, ``L`` = ``--swiglu-limit`` (7.0, ``ModelConfig.swiglu_limit``,
  model.py:20) and ``alpha`` = ``--swiglu-alpha`` (1.702)::

      g = min(g, L);  u = clamp(u, -L, L);  out = g * sigmoid(alpha g) * (u + 1)

  which differs from plain SwiGLU three ways: the clamps, ``alpha`` (``g sigmoid(1.702 g)`` is the sigmoid
  approximation of GELU, not Swish_1) and the ``+ 1`` on the linear half. gpt-oss interleaves the two halves in
  one matrix (``x[..., ::2]`` gate, ``x[..., 1::2]`` linear); here they are two matrices, the same function.

Both halves keep fairseq's biases (the paper has none, gpt-oss has them). The hidden size is ``fc1``'s, as
the user gives it (``--*-ffn-embed-dim``); a gated FFN has three ``d x F`` matrices where the ReLU FFN has
two, so the same parameter count takes ``F = 2/3 * 4d`` (Shazeer 2020, sec. 2; docs/schemes.md).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

GLU_KINDS = ("swiglu", "swiglu-oss")


class FFNGate(nn.Module):
    """``gate(x, u)``: the gated FFN's hidden layer from the FFN input ``x`` and ``u = fc1(x)`` (module
    docstring); ``proj`` is ``W_g``, ``d -> F``. ``limit`` / ``alpha``: ``swiglu-oss``'s only."""

    def __init__(
        self, embed_dim: int, ffn_dim: int, kind: str, limit: float = 7.0, alpha: float = 1.702, bias: bool = True
    ) -> None:
        super().__init__()
        if kind not in GLU_KINDS:
            raise ValueError(f"unknown gated FFN {kind!r}; choose from {', '.join(GLU_KINDS)}")
        self.kind, self.limit, self.alpha = kind, limit, alpha
        self.proj = nn.Linear(embed_dim, ffn_dim, bias=bias)

    def forward(self, x: Tensor, u: Tensor) -> Tensor:
        g = self.proj(x)
        if self.kind == "swiglu":
            return F.silu(g) * u
        g = g.clamp(max=self.limit)
        u = u.clamp(min=-self.limit, max=self.limit)
        return g * torch.sigmoid(self.alpha * g) * (u + 1)

    def extra_repr(self) -> str:
        return self.kind + (f", limit={self.limit}, alpha={self.alpha}" if self.kind == "swiglu-oss" else "")


__all__ = ["GLU_KINDS", "FFNGate"]
