"""Linear layers with a change: a norm on the input (Sub-LN's inner norm) or no trainable bias.

- :class:`NormedLinear`: ``F.linear(norm(x), W, b)``, built from a Linear fairseq made (its very
  parameters) and a norm. Sub-LN (Wang et al. 2022, "Foundation Transformers", Figure 1) puts one
  before a self-attention's output projection and before the FFN's second projection.
- :func:`drop_bias`: the bias of a Linear replaced by a zero buffer (Lipschitz init's bias-free
  variant, MAtt's tied output projection).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class NormedLinear(nn.Linear):
    """``F.linear(self.norm(x), self.weight, self.bias)``: a Linear whose input goes through its own norm.

    Built around an existing ``nn.Linear`` (:meth:`around`), taking over its ``weight`` and ``bias``
    parameters (same tensors, same names: ``<linear>.weight``, ``<linear>.bias``, then
    ``<linear>.norm.*``), so that the init fairseq gave the Linear and its place among the parameters
    stay as they were. A subclass of ``nn.Linear``: the init schemes treat it as the Linear it is.
    """

    norm: nn.Module

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, weight: torch.Tensor, norm):
        nn.Module.__init__(self)  # not nn.Linear's: the parameters are given, nothing is drawn
        self.in_features = in_features
        self.out_features = out_features
        self.weight = weight
        self.register_parameter("bias", bias)
        self.norm = norm

    @classmethod
    def around(cls, linear: nn.Linear, norm: nn.Module) -> NormedLinear:
        """A NormedLinear computing with ``linear``'s parameters (to assign in ``linear``'s place)."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"a norm goes in front of a plain nn.Linear, not {type(linear).__name__}")
        return cls(linear.in_features, linear.out_features, linear.bias, linear.weight, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.weight, self.bias)


def drop_bias(linear: nn.Module) -> None:
    """Make ``linear`` bias-free without breaking fairseq's fused attention call.

    fairseq's MultiheadAttention concatenates ``q/k/v_proj.bias`` for
    ``F.multi_head_attention_forward`` and fails on ``None``; a zero *buffer* keeps that call
    working while leaving no trainable (and no unused) bias parameter.
    """
    inner = getattr(linear, "module", linear)  # quant-noise wraps nothing here, but be safe
    bias = inner.bias
    if bias is None or not isinstance(bias, nn.Parameter):
        return
    del inner.bias
    inner.register_buffer("bias", torch.zeros_like(bias.data), persistent=False)
