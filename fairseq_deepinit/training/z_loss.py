"""The z-loss term on fairseq's criteria (``--z-loss``, :mod:`fairseq_deepinit.methods.z_loss`).

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

:class:`ZLossMixin` puts the term on a label-smoothed cross-entropy criterion: the plugin's diagnostics
criteria have it, and ``--criterion label_smoothed_cross_entropy_zloss`` is fairseq's
``label_smoothed_cross_entropy`` with it and nothing else (``--label-smoothing 0``, its default, is fairseq's
``cross_entropy`` for language models). :func:`check_criterion` refuses ``--z-loss`` with any other criterion
before training (fairseq's ``Trainer._build_optimizer``, :func:`fairseq_deepinit.patches.build_optimizer`).

Switching the term on or off at resume changes the criterion's class (``label_smoothed_cross_entropy`` <->
``label_smoothed_cross_entropy_zloss``), whose name fairseq's ``Trainer.load_checkpoint`` compares with the one
saved in the optimizer history (``trainer.py:607-609``, an ``AssertionError``). The two store nothing
(no parameters, no state: ``state["criterion"]`` is loaded only for a criterion with parameters, line 590), so
:func:`accept_criterion_state` lets the pair resume, as :mod:`.adam_foreach` does for adam <-> adam_foreach;
any other pair stays fairseq's refusal, in one line
(:func:`fairseq_deepinit.checkpoints.model_load.trainer_load_checkpoint`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Tuple

import torch
from fairseq import utils
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
    label_smoothed_nll_loss,
)
from fairseq.logging import metrics
from torch import Tensor

from ..errors import DeepInitConfigError

logger = logging.getLogger(__name__)

CRITERION_NAME = "label_smoothed_cross_entropy_zloss"
PLUGIN_CRITERIA = (CRITERION_NAME, "label_smoothed_cross_entropy_diagnostics", "cross_entropy_diagnostics")


def multiplier(model: Any) -> float | None:
    """``--z-loss-multiplier`` of ``model``'s spec (inside DDP wrappers) while ``--z-loss`` is on, else None."""
    while getattr(model, "spec", None) is None and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    spec = getattr(model, "spec", None)
    p = spec.features.get("z_loss") if spec is not None else None
    return None if p is None else float(p.z_loss_multiplier)


def log_z(logits: Tensor, lprobs: Tensor) -> Tensor:
    """``logsumexp(logits, -1)`` in float32 from ``lprobs = log_softmax(logits.float())`` (module docstring);
    ``logits`` and ``lprobs`` ``(N, V)``."""
    top = logits.detach().argmax(-1, keepdim=True)
    return (logits.gather(-1, top).float() - lprobs.gather(-1, top).float()).squeeze(-1)


def z_squared(logits: Tensor, lprobs: Tensor, target: Tensor, padding_idx: int) -> Tensor:
    """``(log Z)^2`` per position ``(N,)``, 0 at padding targets."""
    z = log_z(logits, lprobs)
    return z.pow(2).masked_fill(target.eq(padding_idx), 0.0)


class ZLossMixin:
    """The z-loss term on a :class:`LabelSmoothedCrossEntropyCriterion` (module docstring): ``compute_loss`` adds
    it while the model's spec has ``--z-loss``, ``forward`` logs it, ``reduce_metrics`` reports it."""

    _z_logged: Tuple[Tensor, Tensor] | None = None

    def compute_loss(self, model, net_output, sample, reduce=True):
        c = multiplier(model)
        if c is None:
            return super().compute_loss(model, net_output, sample, reduce=reduce)
        # LabelSmoothedCrossEntropyCriterion.compute_loss, plus the term from the same lprobs
        lprobs, target = self.get_lprobs_and_target(model, net_output, sample)
        loss, nll_loss = label_smoothed_nll_loss(lprobs, target, self.eps, ignore_index=self.padding_idx, reduce=reduce)
        logits = net_output[0][:, self.ignore_prefix_size :, :] if self.ignore_prefix_size > 0 else net_output[0]
        z2 = z_squared(logits.reshape(-1, logits.size(-1)), lprobs, target, self.padding_idx)
        if reduce:
            unscaled = z2.sum()
            loss = loss + c * unscaled
            self._z_logged = ((c * unscaled).detach(), unscaled.detach())
        else:
            loss = loss + c * z2.view_as(loss)
        return loss, nll_loss

    def forward(self, model, sample, reduce=True):
        self._z_logged = None
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        if self._z_logged is not None:
            logging_output["z_loss"], logging_output["z_loss_unscaled"] = self._z_logged
            self._z_logged = None
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        logs = [log for log in logging_outputs if "z_loss" in log]
        if not logs:
            return
        ntokens = sum(log.get("ntokens", 0) for log in logs)
        for key, digits in (("z_loss", 6), ("z_loss_unscaled", 3)):
            metrics.log_scalar(key, sum(log[key] for log in logs) / max(ntokens, 1), ntokens, round=digits)


@dataclass
class ZLossCriterionConfig(LabelSmoothedCrossEntropyCriterionConfig):
    """fairseq's ``label_smoothed_cross_entropy`` options; the term's are the model's ``--z-loss*``."""


@register_criterion(CRITERION_NAME, dataclass=ZLossCriterionConfig)
class LabelSmoothedCrossEntropyZLossCriterion(ZLossMixin, LabelSmoothedCrossEntropyCriterion):
    """fairseq's ``label_smoothed_cross_entropy`` plus the z-loss term of ``--z-loss`` (module docstring)."""


def check_criterion(trainer: Any) -> None:
    """Refuse ``--z-loss`` under a criterion that would leave the term out (called before the optimizer is built)."""
    if multiplier(trainer._model) is None or isinstance(trainer.criterion, ZLossMixin):
        return
    name = getattr(trainer.cfg.criterion, "_name", None) or type(trainer.criterion).__name__
    raise DeepInitConfigError(
        f"--z-loss is a term of the plugin's criteria, and --criterion {name} would leave it out: use --criterion "
        f"{CRITERION_NAME} (fairseq's label_smoothed_cross_entropy plus the term; --label-smoothing 0 is "
        "cross_entropy), label_smoothed_cross_entropy_diagnostics or cross_entropy_diagnostics"
    )


# fairseq's class name of a criterion (what the optimizer history stores) -> the same loss with the z-loss term
_TERM_TWINS = {"LabelSmoothedCrossEntropyCriterion": "LabelSmoothedCrossEntropyZLossCriterion"}


def accept_criterion_state(trainer: Any) -> None:
    """Let a run resume with the z-loss term switched on or off (module docstring).

    Runs where fairseq's ``Trainer.load_checkpoint`` rebuilds the optimizer, before its criterion-name check
    (trainer.py:604-609): for the pair the history's last entry is replaced by a copy naming the new class (the
    saved name kept under ``resumed_from_criterion``); any other pair keeps fairseq's check.
    """
    history = getattr(trainer, "_optim_history", None)
    if not history or not isinstance(history[-1], dict):
        return
    criterion = trainer.get_criterion()
    saved, current = history[-1].get("criterion_name"), type(criterion).__name__
    if (
        saved == current
        or utils.has_parameters(criterion)
        or not any({saved, current} == {a, b} for a, b in _TERM_TWINS.items())
    ):
        return
    logger.info(f"resuming {saved}'s optimizer state with {current}: the z-loss term stores nothing")
    trainer._optim_history = [
        *history[:-1],
        {**history[-1], "criterion_name": current, "resumed_from_criterion": saved},
    ]
