"""Training-time diagnostics and a divergence guard: ``--criterion label_smoothed_cross_entropy_diagnostics``.

fairseq's label-smoothed cross-entropy (plus the loss terms of the model's methods, ``--z-loss``:
:mod:`fairseq_deepinit.training.loss_terms`), and two things for any ``deepinit`` architecture:

1. every ``--diagnostics-interval`` updates, per-sub-layer statistics go into fairseq's metrics, so
   they appear in the training log and under ``--tensorboard-logdir``:

   - ``diag_var/<sub-layer>``: variance of the residual-branch output f_i(x_{i-1}) (Admin, Liu et
     al. 2020, eq. 6; DS-Init, Zhang et al. 2019, Table 1);
   - ``diag_norm_in/<norm>``: mean l2 norm of the input vectors of every normalisation layer
     (T-Fixup, Huang et al. 2020, Fig. 3);
   - ``diag_<param>/<sub-layer>``: the mean of every parameter a residual module owns (Admin's
     ``omega``, ReZero's ``alpha``);
   - ``diag_scalenorm_g/<norm>``: ScaleNorm's learned g (Nguyen & Salazar 2019, Fig. 3);
   - ``diag_gnorm/<layer>``: the l2 norm of the gradient of each layer's parameters (DS-Init Fig. 1),
     taken before clipping, with fairseq's own ``gnorm`` as the total.
   - over depth (:mod:`.depth_stats` has the formulas, :mod:`.depth_hooks` the hooks):
     ``diag_stream_norm|var|max/<stack>.<layer>``, the residual stream after every layer;
     ``diag_angle/`` and ``diag_angle_last/``, the angular distance each layer moves it;
     ``diag_max_logit/<attention>`` and ``diag_max_logit/all``, the maximum attention logit;
   - counters since the last such update (:mod:`.training_counters`): ``diag_loss_spikes``,
     ``diag_gnorm_spikes``, ``diag_loss_scale_drops``.

   Moments travel in the logging outputs and are combined in :meth:`reduce_metrics`, so gradient
   accumulation and data parallelism give exact statistics. On other updates nothing is computed.
   Everything stays on the device until :meth:`reduce_metrics` reads all of an update's statistics,
   the per-layer gradient norms included, in one device-to-host copy.

2. a divergence guard: when the loss or the gradients go non-finite in a way fairseq's fp16/AMP loss
   scaling does not absorb (fp32 training, or the minimum loss scale reached), training stops with a
   :class:`DivergenceError` naming the update and the first layer, in forward order, whose output went
   non-finite (found by replaying the update's batches with hooks, under the autocast state the
   update's forward ran in, so that a bf16- or fp16-only overflow overflows again; ``--fp16`` weights
   are half already), the non-finite weights, and the first layer with non-finite gradients. A
   checkpoint save of a non-finite model is refused, so ``checkpoint_last.pt`` keeps the last good state.
   The guard reads nothing from the device on a
   healthy update: fairseq's trainer itself checks the gradient norm after clipping
   (``trainer.py:963-970``) and, when it is not finite and no loss scaler absorbs it, saves
   ``crash.pt`` and replays the update; the guard steps in there (:meth:`DiagnosticsCriterion.check_unfinished_update`).

Gradients exist only after the backward pass, which fairseq's task runs; the criterion therefore
gives the task a small mixin that tells it the update number, and wraps the optimizer's
``clip_grad_norm`` — the one point where the gradients of an update are complete and where fairseq
decides that they are non-finite: both in :mod:`fairseq_deepinit.patches`, with the fairseq lines they attach to. The
guard's state and report are :mod:`.guard`.
"""

import logging
import math
from collections import OrderedDict
from contextlib import ExitStack
from typing import Dict, List

import torch
import torch.nn as nn
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq.logging import metrics

from ..errors import DeepInitConfigError, DivergenceError
from ..modules.autocast_state import AutocastState
from ..patches import install_task_mixin, wrap_optimizer
from ..training.loss_terms import LossTermsMixin
from . import depth_hooks, hooks, training_counters
from .criterion_config import DEFAULT_STATS, STATS, DiagnosticsCriterionConfig
from .depth_criterion import DepthDiagnostics
from .guard import RunState, _parse_inject, check_inject_target, divergence_report, unwrap_model
from .stats import _grad_squares, nonfinite_parameters

logger = logging.getLogger(__name__)

_KEY = "_diag|"  # logging-output keys that carry raw moments
PRIORITY = 2000  # after fairseq's own metrics in a log line


def _drop_printed_meters() -> bool:
    """Remove ``diag_*`` meters that fairseq has printed and reset; True while some still hold data.

    fairseq resets a meter after printing it but keeps it, so a statistic logged every N updates
    would show as ``None`` on every log line in between. ``MetersDict`` keeps a priority list
    beside its keys, which must lose the entry too.
    """
    remaining = False
    for name in ("train_inner", "train"):
        meters = metrics.get_meters(name)
        if meters is None:
            continue
        stale = [k for k, m in meters.items() if k.startswith("diag_") and getattr(m, "count", 1) == 0]
        remaining |= any(k.startswith("diag_") for k in meters if k not in stale)
        if stale:
            meters.priorities[:] = [p for p in meters.priorities if p[2] not in stale]
            for k in stale:
                OrderedDict.__delitem__(meters, k)
    return remaining


@register_criterion("label_smoothed_cross_entropy_diagnostics", dataclass=DiagnosticsCriterionConfig)
class DiagnosticsCriterion(LossTermsMixin, LabelSmoothedCrossEntropyCriterion):
    """Label-smoothed cross-entropy with per-sub-layer diagnostics and a divergence guard (module docstring)."""

    def __init__(
        self,
        task,
        sentence_avg,
        label_smoothing,
        ignore_prefix_size=0,
        report_accuracy=False,
        diagnostics_interval=100,
        diagnostics_stats=DEFAULT_STATS,
        no_divergence_guard=False,
        diagnostics_inject_nan="",
        diagnostics_spike_window=training_counters.DEFAULT_WINDOW,
        diagnostics_spike_threshold=training_counters.DEFAULT_THRESHOLD,
    ):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        if diagnostics_interval < 0:
            raise DeepInitConfigError(
                f"--diagnostics-interval must be >= 0 (0 turns the statistics off, the guard stays on), "
                f"got {diagnostics_interval}"
            )
        stats = tuple(s.strip() for s in str(diagnostics_stats).split(",") if s.strip())
        unknown = sorted(set(stats) - set(STATS))
        if unknown:
            raise DeepInitConfigError(
                f"--diagnostics-stats: unknown {', '.join(unknown)}; give a comma-separated subset of {','.join(STATS)}"
            )
        self.interval = int(diagnostics_interval)
        self.stats = stats
        self.guard = not no_divergence_guard
        self.inject = _parse_inject(diagnostics_inject_nan)
        self._run = RunState()
        # statistics over depth and instability counters
        self._depth = DepthDiagnostics(
            stats, self.interval, diagnostics_spike_window, diagnostics_spike_threshold, _KEY
        )
        install_task_mixin(task, self)

    # ---- called by the task mixin -------------------------------------------------------------

    def begin_update(self, update_num: int, model: nn.Module, optimizer, sample: dict) -> None:
        run = self._run
        self.check_unfinished_update()  # fairseq's trainer replays an update whose gradients were not finite
        run.grad_stats = None
        if update_num != run.update_num:
            run.update_num = update_num
            run.samples = []
        if self.guard:
            run.samples.append(sample)  # a reference only: replayed if this update diverges
        run.model = unwrap_model(model)
        if run.metrics_dirty:
            run.metrics_dirty = _drop_printed_meters()
        run.collect = self.interval > 0 and (update_num + 1) % self.interval == 0 and not run.diverged
        run.metrics_dirty |= run.collect
        if optimizer is not None and run.optimizer is not optimizer:
            run.optimizer = optimizer
            wrap_optimizer(optimizer, self._clip, self._zero_grad)
        self._maybe_inject(update_num, "before")

    def after_step(self, update_num: int) -> None:
        self._run.step_open = False
        self._maybe_inject(update_num, "after")

    def check_model(self, model: nn.Module) -> None:
        """Options that need the model, checked before the first update (outside fairseq's
        ``train_step``, whose ``except`` writes ``crash.pt``)."""
        if self.inject is not None and not self._run.injected:
            check_inject_target(model, self.inject[1])

    def check_unfinished_update(self) -> None:
        """Stop with the guard's report if the last clipped update never reached its optimizer step
        because its gradient norm is not finite.

        fairseq's trainer checks ``torch.isfinite(grad_norm)`` after ``clip_grad_norm`` on every update
        (trainer.py:963-970; one host read that stock training makes too). When it fails outside AMP,
        it raises ``FloatingPointError``, saves ``crash.pt`` (the saving rank asks the task for its
        state), zeroes the gradients (every rank) and replays the update under its NanDetector before
        re-raising; the first of those calls lands here, so the guard reads the norm only on that path,
        never on a healthy update. Under AMP the trainer takes the (skipped) optimizer step and retries
        the batch, which closes the update.
        """
        run = self._run
        if not run.step_open:
            return
        run.step_open = False
        norm = run.grad_norm
        finite = bool(torch.isfinite(norm).all()) if torch.is_tensor(norm) else math.isfinite(norm)
        absorbed = getattr(run.optimizer, "scaler", None) is not None  # --fp16: fairseq lowers the scale
        if finite or not self.guard or absorbed or run.diverged:
            return
        loss = "" if run.last_loss is None else f", last loss {float(run.last_loss.float().sum()):.6g}"
        self._diverge(f"the gradient norm is {float(norm)}{loss}", replay=True)

    def check_before_save(self) -> None:
        """Refuse to let a checkpoint be written from non-finite weights."""
        run = self._run
        self.check_unfinished_update()  # fairseq saves crash.pt first when the gradients are not finite
        if not self.guard or run.diverged or run.model is None:
            return
        if nonfinite_parameters(run.model):
            self._diverge(
                "its optimizer step left non-finite weights, and fairseq was about to save a checkpoint of them "
                "(not written)",
                replay=True,
            )

    # ---- loss and statistics ------------------------------------------------------------------

    def forward(self, model, sample, reduce=True):
        run = self._run
        if model.training:
            # the step's precision (--autocast-bf16, --amp), set by the caller; a replay must run under it
            run.precision = AutocastState.capture(sample["net_input"].values())
        if not (run.collect and model.training):
            loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
            run.last_loss = loss.detach()
            return loss, sample_size, logging_output
        net = unwrap_model(model)
        res = hooks.ResidualStatistics(net) if "var" in self.stats and hooks.residual_modules(net) else None
        nrm = hooks.NormInputStatistics(net) if "norm" in self.stats else None
        depth = self._depth.collector(net, sample["net_input"])
        with ExitStack() as stack:
            for s in (res, nrm, depth):
                if s is not None:
                    stack.enter_context(s)
            loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        run.last_loss = loss.detach()
        logging_output.update(self._statistics(net, res, nrm))
        if depth is not None:
            self._depth.add(run.update_num, depth, logging_output)
        return loss, sample_size, logging_output

    def _statistics(self, net: nn.Module, res, nrm) -> Dict[str, torch.Tensor]:
        """The update's raw moments as logging outputs, left on the device (read in :meth:`reduce_metrics`)."""
        out: Dict[str, torch.Tensor] = {}
        if res is not None:
            for name in res.order:
                out[f"{_KEY}var|{name}"] = res.moments[name].detach()
        if nrm is not None:
            for name in nrm.order:
                out[f"{_KEY}norm|{name}"] = nrm.moments[name].detach()
        # learned scalars as (count, sum) pairs, which sum over logging outputs like the moments
        if "residual" in self.stats:
            for sub, params in hooks.residual_parameters(net).items():
                for p_name, p in params.items():
                    out[f"{_KEY}param|{p_name}|{sub}"] = _count_and_value(p.detach().double().mean())
        if "scalenorm" in self.stats:
            for name, g in hooks.scalenorm_gain_tensors(net).items():
                out[f"{_KEY}g|{name}"] = _count_and_value(g.detach().double())
        return out

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        keys: List[str] = []
        for log in logging_outputs:
            keys += [k for k in log if k.startswith(_KEY) and k not in keys]
        if not keys:
            return
        totals = _read_all([sum(log[key] for log in logging_outputs if key in log) for key in keys])
        grad_norm_finite = True
        for key, total in zip(keys, totals, strict=True):
            _, kind, rest = key.split("|", 2)
            if kind == "var":
                name, value = f"diag_var/{rest}", hooks.residual_variances(total)["branch"]
            elif kind == "norm":
                name, value = f"diag_norm_in/{rest}", hooks.norm_input_statistics(total)["mean_norm"]
            elif kind == "param":
                p_name, sub = rest.split("|", 1)
                name, value = f"diag_{p_name}/{sub}", (total[1] / total[0]).item()
            elif kind == "g":
                name, value = f"diag_scalenorm_g/{rest}", (total[1] / total[0]).item()
            elif kind == "gnorm_total":
                grad_norm_finite = math.isfinite(total.item())
                continue
            elif kind == "gnorm":
                if not grad_norm_finite:  # an AMP update fairseq skipped: no per-layer norms (nor gnorm)
                    continue
                name, value = f"diag_gnorm/{rest}", total.item()
            elif kind in depth_hooks.KINDS:
                for name, value in depth_hooks.metrics(kind, rest, total):
                    metrics.log_scalar(name, value, priority=PRIORITY, round=None)
                continue
            else:
                continue
            metrics.log_scalar(name, value, priority=PRIORITY, round=None)

    # ---- gradients: per-layer norms and the guard ---------------------------------------------

    def _zero_grad(self) -> None:
        # fairseq's trainer discards an update that failed its finiteness check here, on every rank,
        # before its NanDetector replay (whose hooks a replay of the guard's cannot run under)
        self.check_unfinished_update()

    def _clip(self, original, max_norm, aggregate_norm_fn):
        run = self._run
        grad_norm, scale = None, self._depth.loss_scale(run.optimizer)
        try:
            grad_norm = original(max_norm, aggregate_norm_fn)
        except FloatingPointError as e:  # fp16/AMP: the minimum loss scale was reached
            if self.guard and not run.diverged:
                self._diverge(f"fairseq's loss scaling gave up ({e})", replay=True)
            raise
        finally:  # --fp16 lowers its scale and raises OverflowError (the trainer skips the update)
            self._depth.clipped(run.optimizer, scale, grad_norm)
        # no host read here: fairseq's trainer checks the norm next (see check_unfinished_update)
        run.grad_norm, run.step_open = grad_norm, True
        if run.collect and "grad" in self.stats:
            run.grad_stats = self._grad_norm_statistics(grad_norm, sharded=aggregate_norm_fn is not None)
        return grad_norm

    def _grad_norm_statistics(self, grad_norm, sharded: bool) -> Dict[str, torch.Tensor] | None:
        """Per-layer gradient norms as a logging output, on the device (the task reduces them with the
        update's other statistics, :meth:`.task_mixin.DiagnosticsTaskMixin.reduce_metrics`)."""
        run = self._run
        if sharded:  # FSDP: each rank holds a shard of every gradient
            if not run.warned_sharded:
                logger.warning("diagnostics: per-layer gradient norms are not available with sharded gradients (FSDP)")
                run.warned_sharded = True
            return None
        sq = _grad_squares(run.model)
        if not sq:
            return None
        values = torch.stack(list(sq.values()))
        total = values.sum().sqrt()
        norm = grad_norm.to(values) if torch.is_tensor(grad_norm) else torch.full_like(total, grad_norm)
        # the gradients here may still carry a uniform factor (fp16 loss scale, clipping, lazy
        # division by the sample size); fairseq's grad_norm is the true total before clipping
        scale = torch.where(total > 0, norm / total, torch.zeros_like(total))
        out = {f"{_KEY}gnorm_total|": norm}  # first: a non-finite total (AMP, skipped) drops the rest
        out.update({f"{_KEY}gnorm|{key}": v for key, v in zip(sq.keys(), values.sqrt() * scale, strict=True)})
        return out

    def take_grad_statistics(self) -> Dict[str, torch.Tensor] | None:
        """This update's per-layer gradient norms (once), for the task's ``reduce_metrics``."""
        stats, self._run.grad_stats = self._run.grad_stats, None
        return stats

    def take_depth_statistics(self, logging_outputs) -> Dict[str, torch.Tensor] | None:
        """A training update's maxima over depth and counters, for the task's ``reduce_metrics``
        (:meth:`.depth_criterion.DepthDiagnostics.take`)."""
        run = self._run
        return self._depth.take(run.model, run.update_num, run.collect, logging_outputs, run.grad_norm)

    # ---- divergence ---------------------------------------------------------------------------

    def _maybe_inject(self, update_num: int, when: str) -> None:
        run = self._run
        if self.inject is None or run.injected:
            return
        k, p_name, at = self.inject
        if update_num + 1 != k or at != when:
            return
        check_inject_target(run.model, p_name)  # fairseq-train refused it at begin_epoch; a caller may not call that
        params = dict(run.model.named_parameters())
        with torch.no_grad():
            params[p_name].fill_(float("nan"))
        run.injected = True
        logger.warning(f"diagnostics: filled {p_name} with NaN {when} update {k} (--diagnostics-inject-nan)")

    def _diverge(self, reason: str, replay: bool) -> None:
        msg = divergence_report(self._run, reason, replay)
        logger.error(msg)
        raise DivergenceError(msg)


def _count_and_value(value: torch.Tensor) -> torch.Tensor:
    """``[1, value]`` on ``value``'s device (a statistic that sums over logging outputs as a mean)."""
    return torch.stack([torch.ones_like(value), value])


def _read_all(totals: List) -> List[torch.Tensor]:
    """The summed statistics as float64 CPU tensors, read from the device in one copy."""
    flat = [torch.as_tensor(t).reshape(-1) for t in totals]
    device = next((t.device for t in flat if t.device.type != "cpu"), torch.device("cpu"))
    values = torch.cat([t.to(device=device, dtype=torch.float64) for t in flat]).tolist()
    out, start = [], 0
    for t in flat:
        out.append(torch.tensor(values[start : start + t.numel()], dtype=torch.float64))
        start += t.numel()
    return out
