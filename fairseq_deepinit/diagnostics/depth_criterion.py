"""What the diagnostics criterion (:mod:`.criterion`) does for the statistics over depth (:mod:`.depth_hooks`)
and the instability counters (:mod:`.training_counters`) at each point of a training update.

- the forward of an update that measures: :meth:`DepthDiagnostics.collector` gives the hooks for the
  batch; :meth:`DepthDiagnostics.add` puts their summable moments into the logging output and keeps
  the maxima aside (fairseq sums logging outputs; a maximum must not be summed);
- ``clip_grad_norm`` (routed through the criterion by :func:`fairseq_deepinit.patches.wrap_optimizer`):
  :meth:`DepthDiagnostics.loss_scale` before fairseq's own, :meth:`DepthDiagnostics.clipped` after it,
  which counts a loss-scale drop;
- ``reduce_metrics`` (:class:`.task_mixin.DiagnosticsTaskMixin`): :meth:`DepthDiagnostics.take` feeds the
  update's reduced loss and gradient norm to the spike counters on every training update, and on an
  update that measures returns the maxima (all-reduced with MAX over the ranks) and the counts.

With ``--diagnostics-interval 0`` or without ``stream``, ``angle``, ``logit`` and ``counters`` in
``--diagnostics-stats`` every method here returns at once. With ``counters``, the per-update work is a
few device operations (the spike windows are device ring buffers); nothing is read to the host
outside the criterion's one copy on the updates that measure.
"""

from __future__ import annotations

from typing import Dict, Mapping, Sequence

import torch
import torch.nn as nn

from . import depth_hooks, training_counters


class DepthDiagnostics:
    """The criterion's state for the statistics over depth and the counters (module docstring).

    ``stats`` is the criterion's ``--diagnostics-stats`` tuple, ``interval`` its ``--diagnostics-interval``;
    ``key`` the prefix of the logging-output keys the criterion reduces (``<key><kind>|<name>``).
    """

    def __init__(self, stats: Sequence[str], interval: int, window: int, threshold: float, key: str) -> None:
        training_counters.check_options(window, threshold)
        self.depth_stats = tuple(s for s in depth_hooks.STATS if s in stats) if interval > 0 else ()
        self.counters = None
        if interval > 0 and "counters" in stats:
            self.counters = training_counters.TrainingCounters(window, threshold)
        self.key = key
        self._max = depth_hooks.MaxAccumulator()

    def collector(self, net: nn.Module, net_input: Mapping) -> depth_hooks.DepthStatistics | None:
        """The hooks for one batch of an update that measures (a context manager), or None."""
        if not self.depth_stats:
            return None
        return depth_hooks.DepthStatistics(net, net_input, self.depth_stats)

    def add(self, update_num: int, depth: depth_hooks.DepthStatistics, logging_output: dict) -> None:
        """One batch's statistics: moments into its logging output, maxima kept for :meth:`take`."""
        logging_output.update({self.key + k: v for k, v in depth.sums().items()})
        self._max.add(update_num, depth.maxima())

    def loss_scale(self, optimizer) -> float | None:
        """fairseq's ``--fp16`` loss scale before ``clip_grad_norm`` (a host float), when counting."""
        if self.counters is None:
            return None
        return getattr(getattr(optimizer, "scaler", None), "loss_scale", None)

    def clipped(self, optimizer, scale_before: float | None, grad_norm) -> None:
        """After fairseq's ``clip_grad_norm`` (also when it raised): count a loss-scale drop."""
        if self.counters is not None:
            self.counters.clipped(optimizer, scale_before, grad_norm)

    def take(self, model: nn.Module | None, update_num: int, collect: bool, logging_outputs, grad_norm):
        """A training update's maxima and counts as one logging output (device tensors), or None.

        Validation (the model in eval mode) is not an update and is neither counted nor measured.
        """
        if model is None or not model.training:
            return None
        if self.counters is not None:
            self.counters.observe_update(logging_outputs, grad_norm)
        if not collect:
            return None
        out: Dict[str, torch.Tensor] = {f"{self.key}{k}": v for k, v in self._max.take(update_num).items()}
        if self.counters is not None:
            out.update({f"{self.key}scalar|{k}": v for k, v in self.counters.take().items()})
        return out or None
