"""z-loss (PaLM, Chowdhery et al. 2022, arXiv 2204.02311: ``1e-4 * log^2 Z``): a penalty on the softmax's log Z.

Released code: OLMo-core ``src/olmo_core/nn/functional/cross_entropy_loss.py`` (commit fa6c5014),
``cross_entropy_loss`` ``35-50``: logits upcast to float32; ``z_squared = logits.logsumexp(-1).pow(2)``;
masked by ``labels != ignore_index``; ``"mean"``: ``sum(z^2 * mask) / sum(mask)``; ``"sum"``: the masked
sum; ``z_loss = z_loss_multiplier * z_squared`` with default multiplier ``1e-4``. The LM head adds it to
the cross entropy (``nn/lm_head.py:255-266``); the train module logs ``train/Z loss`` and
``train/Z loss unscaled`` (= ``Z loss / multiplier``, ``train/train_module/transformer/train_module.py:444-457``).
OLMo 2 and OLMo 3's official training scripts pass ``z_loss_multiplier=1e-5``
(``src/scripts/official/OLMo2/OLMo-2-0325-32B-train.py:90``,
``src/scripts/official/OLMo3/OLMo-3-1025-7B-pretrain-1.py:89``).

fairseq's criteria return a *sum* over target tokens and fairseq's trainer divides the gradient by the
sample size (the number of target tokens for ``--sentence-avg`` off): :func:`fairseq_sum` is that form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_MULTIPLIER = 1e-4  # cross_entropy_loss(z_loss_multiplier=1e-4); PaLM's 1e-4
OLMO2_MULTIPLIER = 1e-5  # OLMo 2 / OLMo 3 official scripts


def cross_entropy_with_z_loss(logits: Tensor, labels: Tensor, ignore_index: int = -100, reduction: str = "mean",
                              multiplier: float = DEFAULT_MULTIPLIER) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(ce_loss, z_loss)`` for ``logits`` ``(N, V)`` and ``labels`` ``(N,)`` (``cross_entropy_loss.py:35-50``)."""
    logits = logits.float() if logits.dtype != torch.float64 else logits
    ce = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)
    z_squared = logits.logsumexp(-1).pow(2)
    mask = labels != ignore_index
    if reduction == "mean":
        z_squared = (z_squared * mask).sum() / mask.sum()
    elif reduction == "sum":
        z_squared = (z_squared * mask).sum()
    return ce, multiplier * z_squared


def fairseq_sum(logits: Tensor, target: Tensor, padding_idx: int, multiplier: float = DEFAULT_MULTIPLIER) -> Tensor:
    """``multiplier * sum over non-padding targets of logsumexp(logits)^2``: what a fairseq criterion adds to
    its summed loss; divided by the sample size (non-padding tokens) it equals OLMo-core's ``"mean"``."""
    z = torch.logsumexp(logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32), dim=-1)
    return multiplier * (z.pow(2) * (target != padding_idx)).sum()


def logged(z_loss_mean: Tensor, multiplier: float = DEFAULT_MULTIPLIER) -> dict[str, float]:
    """The two logged values of OLMo-core's train module for one batch's mean z-loss."""
    return {"Z loss": float(z_loss_mean), "Z loss unscaled": float(z_loss_mean / multiplier)}
