"""The diagnostics criteria's tap into fairseq's task: :class:`DiagnosticsTaskMixin`, which
:func:`fairseq_deepinit.patches.install_task_mixin` puts in front of the task instance's class (fairseq's
``Trainer.train_step``, trainer.py:797-1060, has no hook where a gradient exists): the update number before
fairseq's forward/backward (trainer.py:843-851 and its replay at 1000-1007), ``optimizer_step`` (974-976),
``begin_epoch`` (779), ``reduce_metrics`` (1541) and ``state_dict`` (424: a veto on saving a diverged model).
Each method calls fairseq's, which runs unchanged.
"""

from __future__ import annotations

from typing import Any


class DiagnosticsTaskMixin:
    """Put in front of the task's class by :func:`fairseq_deepinit.patches.install_task_mixin`: reports the update
    number to the criterion before fairseq's forward/backward, hands it the update's gradient statistics in
    ``reduce_metrics``, and lets it veto checkpoints of a diverged model."""

    _deepinit_criterion: Any  # the DiagnosticsCriterion that installed the mixin

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False, **kwargs):
        self._deepinit_criterion.begin_update(update_num, model, optimizer, sample)
        return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad, **kwargs)

    def optimizer_step(self, optimizer, model, update_num):
        super().optimizer_step(optimizer, model, update_num)
        self._deepinit_criterion.after_step(update_num)

    def begin_epoch(self, epoch, model):
        # the first point where the criterion sees the model outside the training step
        self._deepinit_criterion.check_model(model)
        super().begin_epoch(epoch, model)

    def reduce_metrics(self, logging_outputs, criterion):
        # fairseq reduces an update's logging outputs after its optimizer step: the per-layer gradient norms
        # join them there, so one device read serves all statistics; then the maxima over depth and counters
        grad_stats = self._deepinit_criterion.take_grad_statistics()
        if grad_stats:
            logging_outputs = [*logging_outputs, grad_stats]
        depth_stats = self._deepinit_criterion.take_depth_statistics(logging_outputs)
        if depth_stats:
            logging_outputs = [*logging_outputs, depth_stats]
        return super().reduce_metrics(logging_outputs, criterion)

    def state_dict(self):
        self._deepinit_criterion.check_before_save()  # fairseq asks the task for its state on every save
        return super().state_dict()
