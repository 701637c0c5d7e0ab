"""FixNorm word embeddings (Nguyen & Chiang 2018; Nguyen & Salazar 2019, sec. 2.3).

Every word embedding is l2-normalised to unit length before use (then scaled by sqrt(d) as
usual), and the tied output layer scores a decoder state ``h`` against the *normalised*
embeddings: ``logit_w = h . w/||w|| + b_w``. With a ScaleNorm (or any norm) before it, ``h`` has
the norm's learned length ``g``, so the logit is ``g * cos(h, w) + b`` (TwT eq. 5): the learned
scale is the final norm's ``g``. Embeddings start at U(-0.01, 0.01) as in the released code.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class FixNormEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose rows are used l2-normalised (unit length)."""

    # floor of a row's norm (only a row that collapsed to ~0, never the padding row, reaches it): the
    # released code's F.normalize default (TwT model.py:75, 123), raised per dtype by norm_floor
    eps: float = 1e-12

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.weight, -0.01, 0.01)
        self._fill_padding_idx_with_zero()

    def normalized_weight(self) -> torch.Tensor:
        """Rows divided by their l2 norm; the padding row is exactly zero and receives no gradient.

        ``F.normalize`` would divide the all-zero padding row by ``eps``: its gradient there is
        ~1/eps (1e12), and because the tied output layer scores the padding symbol too, the first
        updates of a FixNorm model saw gradient norms around 1e8-1e10. Masking the row with a
        constant 0 (and dividing it by 1) keeps it at zero with a zero gradient.
        """
        w = self.weight
        norm = w.norm(dim=-1, keepdim=True)
        norm = norm.clamp(min=norm_floor(self.eps, norm.dtype))
        if self.padding_idx is None:
            return w / norm
        keep = torch.ones_like(norm)
        keep[self.padding_idx] = 0.0
        return w / torch.where(keep.bool(), norm, torch.ones_like(norm)) * keep

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.normalized_weight(), self.padding_idx)


def norm_floor(eps: float, dtype: torch.dtype) -> float:
    """``eps`` as a floor for a norm computed in ``dtype``: at least the dtype's smallest normal number.

    The released code normalises in fp32 with ``F.normalize``'s ``eps = 1e-12``
    (tnq177/transformers_without_tears ``model.py:75, 123``), which fp16 cannot hold: it rounds to 0,
    and a zero row is divided by 0 (NaN). The floor must be nonzero in the dtype and ``1/floor`` (the
    gradient of ``w / floor``) finite: fp16's smallest normal, ``2**-14`` (``1/floor = 16384``), is both,
    where its subnormals would give an infinite ``1/floor``. fp32 and bf16 (fp32's exponent range)
    keep 1e-12, so fp32 models compute exactly what the released code computes.
    """
    return max(eps, torch.finfo(dtype).tiny)


class FixNormOutputProjection(nn.Module):
    """Tied output layer over normalised embeddings plus a per-word bias (TwT eq. 5)."""

    def __init__(self, embedding: FixNormEmbedding) -> None:
        super().__init__()
        self.embedding = embedding
        self.bias = nn.Parameter(torch.zeros(embedding.num_embeddings))

    @property
    def weight(self) -> torch.Tensor:  # fairseq's generator and adaptive code read .weight
        return self.embedding.weight

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return F.linear(features, self.embedding.normalized_weight(), self.bias)
