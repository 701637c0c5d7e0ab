"""The two places where the diagnostics criteria reach into fairseq's training loop, both here.

Gradients exist only after the backward pass, which fairseq's task runs, and the criterion is not
called at the points of an update that the guard and the gradient statistics need. fairseq's
``Trainer.train_step`` (fairseq/trainer.py:797-1060) offers no hook there, so:

1. **The task** (:func:`install_task_mixin`): the criterion puts :class:`DiagnosticsTaskMixin` in front
   of the class of the task instance it is built with (any fairseq task: ``translation``,
   ``language_modeling``, the plugin's own), replacing the instance's class by a subclass that adds:

   - ``train_step``: the update number, model, optimizer and batch before fairseq's forward/backward
     (called by the trainer at trainer.py:843-851, and again for its replay at 1000-1007);
   - ``optimizer_step``: the end of the update (trainer.py:974-976);
   - ``begin_epoch``: the model, before the first batch (trainer.py:779);
   - ``reduce_metrics``: the update's gradient statistics, maxima over depth and counters join its
     logging outputs (trainer.py:1541);
   - ``state_dict``: a veto on saving a diverged model (the trainer asks the task for its state on
     every save, trainer.py:424).

2. **The optimizer** (:func:`wrap_optimizer`): the instance's ``clip_grad_norm``, which the trainer
   calls once per update with the complete gradients (summed over accumulation steps and ranks,
   divided by the sample size; trainer.py:953 -> 1295-1297), where it decides whether they are finite
   (963-970); and its ``zero_grad``, where the trainer discards an update that failed that check, on
   every rank, before its NanDetector replay (trainer.py:802, 993-996, 1192-1193).

Both only add calls around fairseq's own methods, which run unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Dict


class DiagnosticsTaskMixin:
    """Put in front of the task's class by :func:`install_task_mixin`: reports the update number to
    the criterion before fairseq's forward/backward, hands it the update's gradient statistics in
    ``reduce_metrics``, and lets it veto checkpoints of a diverged model."""

    _deepinit_criterion: Any  # the DiagnosticsCriterion that installed the mixin (.criterion)

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False, **kwargs):
        self._deepinit_criterion.begin_update(update_num, model, optimizer, sample)
        return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad, **kwargs)

    def optimizer_step(self, optimizer, model, update_num):
        super().optimizer_step(optimizer, model, update_num)
        self._deepinit_criterion.after_step(update_num)

    def begin_epoch(self, epoch, model):
        # fairseq's Trainer.begin_epoch, before the epoch's first batch: the first point where the
        # criterion sees the model outside the training step
        self._deepinit_criterion.check_model(model)
        super().begin_epoch(epoch, model)

    def reduce_metrics(self, logging_outputs, criterion):
        # fairseq's trainer reduces an update's logging outputs after its optimizer step: the
        # per-layer gradient norms join them there, so one device read serves all statistics
        grad_stats = self._deepinit_criterion.take_grad_statistics()
        if grad_stats:
            logging_outputs = [*logging_outputs, grad_stats]
        # the maxima over depth (not summable) and the counters, which see every update's reduced loss
        depth_stats = self._deepinit_criterion.take_depth_statistics(logging_outputs)
        if depth_stats:
            logging_outputs = [*logging_outputs, depth_stats]
        return super().reduce_metrics(logging_outputs, criterion)

    def state_dict(self):
        # fairseq's Trainer.state_dict() asks the task for its state on every checkpoint save
        self._deepinit_criterion.check_before_save()
        return super().state_dict()


_MIXED: Dict[type, type] = {}  # one mixed class per task class


def install_task_mixin(task, criterion) -> None:
    """Give ``task`` (an instance of any fairseq task) the :class:`DiagnosticsTaskMixin` behaviour."""
    cls = task.__class__
    if not issubclass(cls, DiagnosticsTaskMixin):
        if cls not in _MIXED:
            _MIXED[cls] = type(f"Diagnostics{cls.__name__}", (DiagnosticsTaskMixin, cls), {"__module__": __name__})
        task.__class__ = _MIXED[cls]
    task._deepinit_criterion = criterion


def wrap_optimizer(optimizer, on_clip: Callable, before_zero_grad: Callable[[], None]) -> None:
    """Route ``optimizer.clip_grad_norm(max_norm, aggregate_norm_fn)`` through ``on_clip(original, max_norm,
    aggregate_norm_fn)`` and call ``before_zero_grad()`` before ``optimizer.zero_grad()`` (on the instance)."""
    original_clip, original_zero_grad = optimizer.clip_grad_norm, optimizer.zero_grad

    def clip_grad_norm(max_norm, aggregate_norm_fn=None):
        return on_clip(original_clip, max_norm, aggregate_norm_fn)

    def zero_grad():
        before_zero_grad()
        return original_zero_grad()

    optimizer.clip_grad_norm, optimizer.zero_grad = clip_grad_norm, zero_grad
