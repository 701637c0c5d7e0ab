"""The loss terms of the methods that are on (their records' ``loss_term`` hooks) on fairseq's criteria.

:class:`LossTermsMixin` puts them on a label-smoothed cross-entropy criterion: for the ``(N, V)`` logits of the
target positions, their float32 ``lprobs`` and the targets, each method's hook
(:class:`~fairseq_deepinit.methods.record.LossTerm`) gives ``(c, values)``, and the summed loss

    loss = label_smoothed_nll + sum over the terms of c * sum_i values_i

(per position with ``reduce=False``). fairseq divides the summed loss by the sample size, so each term enters
the optimised ``loss`` as ``c * mean``; ``nll_loss`` never includes it. Each term is logged as ``<method>``
(``c * mean``) and ``<method>_unscaled`` (``mean``) over target tokens (z-loss: ``z_loss``, ``z_loss_unscaled``,
:mod:`fairseq_deepinit.training.z_loss`).

The plugin's diagnostics criteria have the mixin, and ``--criterion label_smoothed_cross_entropy_zloss`` is
fairseq's ``label_smoothed_cross_entropy`` with it and nothing else (``--label-smoothing 0``, its default, is
fairseq's ``cross_entropy`` for language models). :func:`check_criterion` refuses a method with a loss term
under any other criterion before training (fairseq's ``Trainer._build_optimizer``,
:func:`fairseq_deepinit.patches.build_optimizer`).

Switching a loss term on or off at resume (``--z-loss``) changes the criterion's class
(``label_smoothed_cross_entropy`` <-> ``label_smoothed_cross_entropy_zloss``), whose name fairseq's
``Trainer.load_checkpoint`` compares with the one saved in the optimizer history (``trainer.py:607-609``, an
``AssertionError``). The two store nothing (no parameters, no state: ``state["criterion"]`` is loaded only for a
criterion with parameters, line 590), so :func:`accepted_history` lets the pair resume, as
:func:`.adam_foreach.accepted_history` does for adam <-> adam_foreach; any other pair stays fairseq's refusal, in
one line (:func:`fairseq_deepinit.checkpoints.model_load.trainer_load_checkpoint`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

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
from ..methods import METHODS, Method, enabled
from ..methods.record import flag

logger = logging.getLogger(__name__)

CRITERION_NAME = "label_smoothed_cross_entropy_zloss"
PLUGIN_CRITERIA = (CRITERION_NAME, "label_smoothed_cross_entropy_diagnostics", "cross_entropy_diagnostics")
DIGITS = (6, 3)  # rounding of the logged term and of its unscaled mean


def model_spec(model: Any) -> Any:
    """The spec of ``model`` (inside DDP wrappers), or None for a model without one (a stock fairseq model)."""
    while getattr(model, "spec", None) is None and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return getattr(model, "spec", None)


def terms_of(model: Any) -> List[Tuple[Method, Any]]:
    """``(method, its options)`` for every method that is on in ``model``'s spec and has a loss term."""
    spec = model_spec(model)
    return [] if spec is None else [(m, p) for m, p in enabled(spec) if m.loss_term is not None]


class LossTermsMixin:
    """The loss terms on a :class:`LabelSmoothedCrossEntropyCriterion` (module docstring): ``compute_loss`` adds
    them while the model's spec has a method with one, ``forward`` logs them, ``reduce_metrics`` reports them."""

    _terms_logged: Dict[str, Tensor] | None = None

    def compute_loss(self, model, net_output, sample, reduce=True):
        terms = terms_of(model)
        if not terms:
            return super().compute_loss(model, net_output, sample, reduce=reduce)
        # LabelSmoothedCrossEntropyCriterion.compute_loss, plus the terms from the same lprobs
        lprobs, target = self.get_lprobs_and_target(model, net_output, sample)
        loss, nll_loss = label_smoothed_nll_loss(lprobs, target, self.eps, ignore_index=self.padding_idx, reduce=reduce)
        logits = net_output[0][:, self.ignore_prefix_size :, :] if self.ignore_prefix_size > 0 else net_output[0]
        logits = logits.reshape(-1, logits.size(-1))
        logged: Dict[str, Tensor] = {}
        for method, p in terms:
            c, values = method.loss_term(p, logits, lprobs, target, self.padding_idx)
            if reduce:
                unscaled = values.sum()
                loss = loss + c * unscaled
                logged[method.name], logged[f"{method.name}_unscaled"] = (c * unscaled).detach(), unscaled.detach()
            else:
                loss = loss + c * values.view_as(loss)
        self._terms_logged = logged or None
        return loss, nll_loss

    def forward(self, model, sample, reduce=True):
        self._terms_logged = None
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        if self._terms_logged is not None:
            logging_output.update(self._terms_logged)
            self._terms_logged = None
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        for method in (m for m in METHODS.values() if m.loss_term is not None):
            logs = [log for log in logging_outputs if method.name in log]
            if not logs:
                continue
            ntokens = sum(log.get("ntokens", 0) for log in logs)
            for key, digits in zip((method.name, f"{method.name}_unscaled"), DIGITS, strict=True):
                metrics.log_scalar(key, sum(log[key] for log in logs) / max(ntokens, 1), ntokens, round=digits)


@dataclass
class LossTermsCriterionConfig(LabelSmoothedCrossEntropyCriterionConfig):
    """fairseq's ``label_smoothed_cross_entropy`` options; the terms' are the model's (``--z-loss*``)."""


@register_criterion(CRITERION_NAME, dataclass=LossTermsCriterionConfig)
class LabelSmoothedCrossEntropyZLossCriterion(LossTermsMixin, LabelSmoothedCrossEntropyCriterion):
    """fairseq's ``label_smoothed_cross_entropy`` plus the loss terms of the methods that are on (``--z-loss``)."""


def check_criterion(criterion: Any, cfg: Any, method: Method) -> None:
    """Refuse ``method`` (on, with a loss term) under a criterion that would leave its term out (called before
    the optimizer is built)."""
    if isinstance(criterion, LossTermsMixin):
        return
    name = getattr(cfg.criterion, "_name", None) or type(criterion).__name__
    raise DeepInitConfigError(
        f"{flag(method.switches[0][0])} is a term of the plugin's criteria, and --criterion {name} would leave it "
        f"out: use --criterion {CRITERION_NAME} (fairseq's label_smoothed_cross_entropy plus the term; "
        "--label-smoothing 0 is cross_entropy), label_smoothed_cross_entropy_diagnostics or cross_entropy_diagnostics"
    )


# fairseq's class name of a criterion (what the optimizer history stores) -> the same loss with the loss terms
_TERM_TWINS = {"LabelSmoothedCrossEntropyCriterion": "LabelSmoothedCrossEntropyZLossCriterion"}


def accepted_history(history: Any, criterion: Any) -> List[dict] | None:
    """The optimizer history a run resumes from with its loss terms switched on or off (module docstring), or None
    where nothing changes.

    Read where fairseq's ``Trainer.load_checkpoint`` rebuilds the optimizer, before its criterion-name check
    (trainer.py:604-609): for the pair, the history's last entry names the new class (the saved name kept under
    ``resumed_from_criterion``); any other pair keeps fairseq's check (``Trainer._optim_history`` is replaced by
    :func:`fairseq_deepinit.patches.build_optimizer`).
    """
    if not history or not isinstance(history[-1], dict):
        return None
    saved, current = history[-1].get("criterion_name"), type(criterion).__name__
    if (
        saved == current
        or utils.has_parameters(criterion)
        or not any({saved, current} == {a, b} for a, b in _TERM_TWINS.items())
    ):
        return None
    logger.info(f"resuming {saved}'s optimizer state with {current}: its loss terms store nothing")
    return [*history[:-1], {**history[-1], "criterion_name": current, "resumed_from_criterion": saved}]
