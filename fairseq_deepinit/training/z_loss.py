"""The z-loss term (``--z-loss``, :mod:`fairseq_deepinit.methods.z_loss`): the record's ``loss_term`` hook.

For logits ``x`` of a target position, ``log Z = logsumexp_v x_v`` in float32, and the criterion's summed loss
gains ``c * sum over non-padding targets of (log Z)^2``; fairseq divides the summed loss by the sample size (the
target tokens unless ``--sentence-avg``), which gives OLMo-core's mean, ``c * mean (log Z)^2``
(``cross_entropy_loss.py:35-50``; ``tests/ports/z_loss.py``). The optimised ``loss`` (training and validation, and
so ``--best-checkpoint-metric loss``) includes the term, as OLMo-core's ``loss = ce_loss + z_loss``
(``nn/lm_head.py:255-266``); ``nll_loss``, perplexity and BLEU never do. Logged every update, as OLMo-core's train
module does (``train_module.py:444-457``): ``z_loss`` (``c * mean (log Z)^2``, in nats) and ``z_loss_unscaled``
(``mean (log Z)^2``), means over target tokens.

``log Z`` is read off the log-probabilities fairseq already computed (``lprobs = x - log Z`` in float32,
``fairseq.utils.log_softmax``): ``log Z = x_m - lprobs_m`` at the largest logit ``m``, where the difference
loses least; the same value and gradient (``softmax``) as ``logsumexp`` without a second pass over the
vocabulary that autograd would keep (a float32 copy of the logits under ``--fp16``).

The plugin's criteria add every loss term of the methods that are on, and a criterion that would leave it out
is refused before training (:mod:`fairseq_deepinit.training.loss_terms`).
"""

from __future__ import annotations

from typing import Any, Tuple

from torch import Tensor


def log_z(logits: Tensor, lprobs: Tensor) -> Tensor:
    """``logsumexp(logits, -1)`` in float32 from ``lprobs = log_softmax(logits.float())`` (module docstring);
    ``logits`` and ``lprobs`` ``(N, V)``."""
    top = logits.detach().argmax(-1, keepdim=True)
    return (logits.gather(-1, top).float() - lprobs.gather(-1, top).float()).squeeze(-1)


def z_squared(logits: Tensor, lprobs: Tensor, target: Tensor, padding_idx: int) -> Tensor:
    """``(log Z)^2`` per position ``(N,)``, 0 at padding targets."""
    z = log_z(logits, lprobs)
    return z.pow(2).masked_fill(target.eq(padding_idx), 0.0)


def loss_term(p: Any, logits: Tensor, lprobs: Tensor, target: Tensor, padding_idx: int) -> Tuple[float, Tensor]:
    """z-loss's :class:`~fairseq_deepinit.methods.record.LossTerm`: ``(c, (log Z)^2 per position)``, ``c`` the
    ``--z-loss-multiplier`` of ``p``."""
    return float(p.z_loss_multiplier), z_squared(logits, lprobs, target, padding_idx)
