"""Zero-centred RMSNorm (Qwen3-Next), ported from the released code.

HF transformers @ 7515843 ``src/transformers/models/qwen3_next/modeling_qwen3_next.py``, ``Qwen3NextRMSNorm``::

    self.weight = nn.Parameter(torch.zeros(dim))
    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)

(google-deepmind/gemma @ 7691fd4 ``gemma/gm/nn/_layers.py:46, 57``: the same ``(1 + scale)`` with ``scale`` zeros.)
Float64 stays float64 here (``.float()`` would narrow it): the port computes in the wider of float32 and the input.
"""

from __future__ import annotations

import torch
from torch import Tensor


def zc_rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, mutate: bool = False) -> Tensor:
    """``Qwen3NextRMSNorm.forward``; ``mutate`` uses ``weight`` as the gain itself (plain RMSNorm's), a mutation."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(wide)
    output = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    output = output * (weight.to(wide) if mutate else 1.0 + weight.to(wide))
    return output.type_as(x)
