"""Counters of training instability, kept on the device every update and read on the updates that log
diagnostics: loss spikes, gradient-norm spikes, fp16 loss-scale drops.

**Spikes** follow OLMo-core's ``StabilityMonitorCallback`` (allenai/OLMo-core @ fa6c501,
``src/olmo_core/train/callbacks/stability_monitor.py:117-135``, defaults ``29-36``): a value is a spike
when it exceeds ``mean + threshold * std`` of the previous ``window`` values (population std), checked
only once ``window`` values have been seen and only when ``std >= 1e-10``; the value then joins the
window (``85-95``: checked first, appended after). OLMo-core's defaults, ``window = 128`` and
``threshold = 6``, are this plugin's defaults too: six standard deviations of the last 128 updates stay
above the batch-to-batch noise of a healthy run (a decreasing loss contributes its trend to the std), so
a count above zero marks an event, not noise. The values are fairseq's per-update loss (the ``loss``
it logs, in natural units: the ratio does not depend on the base) and fairseq's ``gnorm`` before
clipping, taken from the update's reduced logging outputs, so every rank counts the same. OLMo-core
counts a step once when either spikes; here the two are counted separately.

**Loss-scale drops**: fairseq's ``--fp16`` ``DynamicLossScaler`` (fairseq/optim/dynamic_loss_scaler.py:
42-70) divides ``loss_scale`` by ``scale_factor`` in ``check_overflow`` (called from the optimizer's
``clip_grad_norm``, fp16_optimizer.py:191-212 and 421-438) and raises ``OverflowError``, and the trainer
skips the update ("gradient overflow detected, ignoring gradient", trainer.py:1010-1027); a drop is a
``clip_grad_norm`` call after which ``loss_scale`` is lower than before (host floats: fairseq keeps the
scale on the host). Under ``--amp`` torch's ``GradScaler`` multiplies its scale by its backoff factor on
every update whose gradients are not finite (fairseq/optim/amp_optimizer.py:52-70 logs "AMP: overflow
detected"); that scale lives on the device, so a drop is counted as a clipped gradient norm that is not
finite, on the device.

Nothing here reads the device on an update that does not log: the window is a device ring buffer and
the counts are device tensors, read with the other statistics in the criterion's one copy.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Dict, Sequence

import torch
from torch import Tensor

from ..errors import DeepInitConfigError

DEFAULT_WINDOW = 128  # OLMo-core StabilityMonitorCallback.window_size
DEFAULT_THRESHOLD = 6.0  # OLMo-core StabilityMonitorCallback.threshold_std
MIN_STD = 1e-10  # OLMo-core: no spike when the window's std is below this

LOSS_SPIKES, GNORM_SPIKES, SCALE_DROPS = "diag_loss_spikes", "diag_gnorm_spikes", "diag_loss_scale_drops"


def check_options(window: int, threshold: float) -> None:
    if not isinstance(window, int) or window < 2:
        raise DeepInitConfigError(
            f"--diagnostics-spike-window must be an integer >= 2 (a window needs a spread), got {window}"
        )
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold > 0):
        raise DeepInitConfigError(
            f"--diagnostics-spike-threshold must be a finite number of standard deviations > 0, got {threshold}"
        )


class SpikeDetector:
    """OLMo-core's spike rule over a device ring buffer (module docstring); :meth:`observe` reads nothing."""

    def __init__(self, window: int = DEFAULT_WINDOW, threshold: float = DEFAULT_THRESHOLD) -> None:
        check_options(window, threshold)
        self.window, self.threshold = window, float(threshold)
        self.seen = 0  # values observed so far (a host count: known without reading the device)
        self.buffer: Tensor | None = None
        self.count: Tensor | None = None  # spikes since the last :meth:`take`

    def observe(self, value: Tensor) -> None:
        value = value.detach().reshape(()).to(torch.float64)
        if self.buffer is None or self.buffer.device != value.device:
            self.buffer = torch.zeros(self.window, dtype=torch.float64, device=value.device)
            self.count = torch.zeros((), dtype=torch.float64, device=value.device)
            self.seen = 0
        if self.seen >= self.window:
            mean = self.buffer.mean()
            std = (self.buffer - mean).pow(2).mean().sqrt()
            spike = (value > mean + self.threshold * std) & (std >= MIN_STD)
            self.count = self.count + spike.to(torch.float64)
        self.buffer[self.seen % self.window] = value
        self.seen += 1

    def take(self) -> Tensor | None:
        """Spikes since the last call (a device tensor), or None before the first value."""
        count = self.count
        if count is not None:
            self.count = torch.zeros_like(count)
        return count


def _total(logging_outputs: Sequence[dict], key: str):
    return sum(log.get(key, 0) for log in logging_outputs)


class TrainingCounters:
    """Loss spikes, gradient-norm spikes and loss-scale drops between two diagnostic updates."""

    def __init__(self, window: int = DEFAULT_WINDOW, threshold: float = DEFAULT_THRESHOLD) -> None:
        self.loss = SpikeDetector(window, threshold)
        self.gnorm = SpikeDetector(window, threshold)
        self.fp16_drops = 0  # host: fairseq's DynamicLossScaler keeps its scale on the host
        self.amp_drops: Tensor | None = None  # device: GradScaler's scale is a device tensor

    # ---- every update ---------------------------------------------------------------------------

    def observe_update(self, logging_outputs: Sequence[dict], grad_norm) -> None:
        """One completed training update: its reduced logging outputs and fairseq's gradient norm."""
        loss, size = _total(logging_outputs, "loss"), _total(logging_outputs, "sample_size")
        if torch.is_tensor(loss):
            self.loss.observe(loss.detach().to(torch.float64) / (size if torch.is_tensor(size) else max(size, 1)))
        if torch.is_tensor(grad_norm):
            self.gnorm.observe(grad_norm)

    def clipped(self, optimizer, scale_before: float | None, grad_norm) -> None:
        """After fairseq's ``optimizer.clip_grad_norm`` (where its scalers react), also when it raised:
        ``scale_before`` is the ``--fp16`` scaler's ``loss_scale`` before the call (None otherwise),
        ``grad_norm`` its result (None when it raised)."""
        scaler = getattr(optimizer, "scaler", None)
        if scale_before is not None:  # DynamicLossScaler (--fp16): a host float
            if scaler.loss_scale < scale_before:
                self.fp16_drops += 1
        elif scaler is not None and torch.is_tensor(grad_norm):  # GradScaler (--amp)
            dropped = (~torch.isfinite(grad_norm)).to(torch.float64).reshape(())
            self.amp_drops = dropped if self.amp_drops is None else self.amp_drops + dropped

    # ---- diagnostic updates ---------------------------------------------------------------------

    def take(self, device: torch.device | None = None) -> Dict[str, Tensor]:
        """The counts since the last call, by metric name (device tensors), and reset."""
        out: Dict[str, Tensor] = OrderedDict()
        for name, detector in ((LOSS_SPIKES, self.loss), (GNORM_SPIKES, self.gnorm)):
            count = detector.take()
            if count is not None:
                out[name] = count
                device = device or count.device
        drops = self.amp_drops
        self.amp_drops = None
        if self.fp16_drops or drops is not None or device is not None:
            # the host count is filled on the device: a CPU operand would be copied in on every call
            host = torch.full((), float(self.fp16_drops), dtype=torch.float64, device=device or "cpu")
            out[SCALE_DROPS] = host if drops is None else host + drops.to(host.device)
            self.fp16_drops = 0
        return out
