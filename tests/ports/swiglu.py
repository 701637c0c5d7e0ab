"""Gated feed-forward networks: plain SwiGLU (Shazeer 2020, arXiv 2002.05202, eq. 6) and gpt-oss's clamped
variant, ported from the released code.

- gpt-oss: openai/gpt-oss @ 7b58334 ``gpt_oss/torch/model.py:249-255``::

      def swiglu(x, alpha: float = 1.702, limit: float = 7.0):
          x_glu, x_linear = x[..., ::2], x[..., 1::2]
          x_glu = x_glu.clamp(min=None, max=limit)
          x_linear = x_linear.clamp(min=-limit, max=limit)
          out_glu = x_glu * torch.sigmoid(alpha * x_glu)
          return out_glu * (x_linear + 1)

  on ``x = mlp1_weight @ t + mlp1_bias`` (one matrix, the two halves interleaved: model.py:322), then
  ``mlp2_weight @ . + mlp2_bias`` (model.py:328-331); ``swiglu_limit = 7.0`` (model.py:20).
- plain SwiGLU, the paper's ``FFN_SwiGLU(x, W, V, W2) = (Swish_1(xW) * xV) W2`` with ``Swish_1(z) = z sigmoid(z)``
  (HF transformers ``LlamaMLP``: ``down_proj(silu(gate_proj(x)) * up_proj(x))``), with fairseq's biases.
"""

from __future__ import annotations

import torch
from torch import Tensor

LIMIT = 7.0
ALPHA = 1.702


def interleave(gate: Tensor, lin: Tensor) -> Tensor:
    """gpt-oss's fused layout: the gate half at even positions, the linear half at odd ones."""
    return torch.stack([gate, lin], dim=-1).flatten(-2)


def gpt_oss_swiglu(x: Tensor, alpha: float = ALPHA, limit: float = LIMIT, mutate: bool = False) -> Tensor:
    """``swiglu`` of model.py:249-255 on the fused ``x``; ``mutate`` drops the ``+ 1`` (a deliberate mutation)."""
    x_glu, x_linear = x[..., ::2], x[..., 1::2]
    x_glu = x_glu.clamp(min=None, max=limit)
    x_linear = x_linear.clamp(min=-limit, max=limit)
    out_glu = x_glu * torch.sigmoid(alpha * x_glu)
    return out_glu * (x_linear if mutate else x_linear + 1)


def gpt_oss_mlp(x: Tensor, w_gate, b_gate, w_lin, b_lin, w2, b2, **kwargs) -> Tensor:
    """One expert of ``MLPBlock.forward`` (model.py:320-331) with its weights split into the two halves."""
    w1 = interleave(w_gate.T, w_lin.T).T  # (2F, d), rows gate, lin, gate, lin, ...
    b1 = interleave(b_gate, b_lin)
    t = torch.einsum("ck,bk->bc", w1, x.reshape(-1, x.size(-1))) + b1
    t = gpt_oss_swiglu(t, **kwargs)
    t = torch.einsum("ck,bk->bc", w2, t) + b2
    return t.reshape(*x.shape[:-1], -1)


def swiglu_ffn(x: Tensor, w_gate, b_gate, w_lin, b_lin, w2, b2, swish_beta: float = 1.0) -> Tensor:
    """``(Swish_beta(x W) * x V) W2`` (Shazeer 2020, eq. 6, beta 1); ``swish_beta`` != 1 is a mutation."""
    g = x @ w_gate.T + b_gate
    return ((g * torch.sigmoid(swish_beta * g)) * (x @ w_lin.T + b_lin)) @ w2.T + b2
