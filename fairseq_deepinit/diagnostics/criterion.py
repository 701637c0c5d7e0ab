"""Training-time diagnostics and a divergence guard: ``--criterion label_smoothed_cross_entropy_diagnostics``.

fairseq's label-smoothed cross-entropy, unchanged, plus two things for any ``deepinit`` architecture:

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
gives the task a small mixin (:class:`DiagnosticsTaskMixin`) that tells it the update number, and
wraps the optimizer's ``clip_grad_norm`` — the one point where the gradients of an update are
complete (summed over accumulation steps and ranks, divided by the sample size) and where fairseq
decides that they are non-finite.
"""

import difflib
import logging
import math
from collections import OrderedDict
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.nn as nn
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)
from fairseq.logging import metrics

from ..errors import DeepInitConfigError, DivergenceError
from ..training.autocast_state import AutocastState
from . import depth_hooks, hooks, training_counters
from .stats import _grad_squares, first_nonfinite_output, grad_norms_per_layer, layer_key, nonfinite_parameters

logger = logging.getLogger(__name__)

STATS = ("var", "norm", "residual", "scalenorm", "grad", *depth_hooks.STATS, "counters")  # depth_hooks: issue 24
DEFAULT_STATS = ",".join(STATS)
_KEY = "_diag|"  # logging-output keys that carry raw moments
PRIORITY = 2000  # after fairseq's own metrics in a log line


@dataclass
class DiagnosticsCriterionConfig(LabelSmoothedCrossEntropyCriterionConfig):
    diagnostics_interval: int = field(
        default=100,
        metadata={
            "help": "log per-sub-layer statistics every N updates, on updates N, 2N, ... (0: never; the "
            "divergence guard stays on). A multiple of --log-interval puts them on a log line."
        },
    )
    diagnostics_stats: str = field(
        default=DEFAULT_STATS,
        metadata={
            "help": "comma-separated statistics to log: var (residual-branch variance), norm (norm-layer "
            "input norm), residual (Admin omega, ReZero alpha), scalenorm (ScaleNorm g), grad (gradient "
            "norm per layer), stream (residual-stream norm, variance, max|x| after every layer), angle (angular "
            "distance between consecutive layers), logit (max attention logit per layer), counters (loss and "
            "gnorm spikes, fp16 loss-scale drops)"
        },
    )
    no_divergence_guard: bool = field(
        default=False, metadata={"help": "do not stop training on non-finite loss, gradients or weights"}
    )
    diagnostics_inject_nan: str = field(
        default="",
        metadata={
            "help": "for testing the divergence guard only: 'UPDATE:PARAM' fills parameter PARAM with NaN "
            "before update UPDATE; 'UPDATE:PARAM:after' does it after that update's optimizer step"
        },
    )
    diagnostics_spike_window: int = field(
        default=training_counters.DEFAULT_WINDOW,
        metadata={
            "help": "counters: a loss (gnorm) spike is a value above mean + T * std of the previous N updates' "
            "values, T = --diagnostics-spike-threshold (OLMo-core's StabilityMonitor rule and default)"
        },
    )
    diagnostics_spike_threshold: float = field(
        default=training_counters.DEFAULT_THRESHOLD,
        metadata={"help": "counters: T of the spike rule, in standard deviations (OLMo-core's default)"},
    )


class _RunState:
    """Per-run state kept outside ``nn.Module`` attributes (a model stored on the criterion would
    become one of its sub-modules, and fairseq would save and all-reduce it as the criterion's)."""

    def __init__(self) -> None:
        self.update_num = -1
        self.collect = False
        self.samples: List[dict] = []
        self.model: nn.Module | None = None
        self.optimizer = None
        self.last_loss: torch.Tensor | None = None
        self.precision: AutocastState | None = None  # autocast state of the update's forward, for the replay
        self.grad_norm: torch.Tensor | float | None = None  # the last clip's total norm, on the device
        self.step_open = False  # clipped, optimizer step not yet taken
        self.grad_stats: Dict[str, torch.Tensor] | None = None  # this update's per-layer norms (device)
        self.diverged = False
        self.injected = False
        self.warned_sharded = False
        self.metrics_dirty = False


def unwrap_model(model: nn.Module) -> nn.Module:
    """The fairseq model inside DDP / ModuleProxy wrappers."""
    from fairseq.models import BaseFairseqModel

    while not isinstance(model, BaseFairseqModel) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _data_parallel_size() -> int:
    """Number of ranks whose gradients are averaged into this one's (1 outside distributed training)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


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


def _parse_inject(spec: str) -> tuple | None:
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0].isdigit() or int(parts[0]) < 1 or not parts[1]:
        raise DeepInitConfigError(
            f"--diagnostics-inject-nan {spec!r}: expected UPDATE:PARAM or UPDATE:PARAM:after with UPDATE >= 1, "
            "e.g. 5:encoder.layers.0.fc1.weight"
        )
    when = parts[2] if len(parts) == 3 else "before"
    if when not in ("before", "after"):
        raise DeepInitConfigError(
            f"--diagnostics-inject-nan {spec!r}: the third field must be 'after' (or absent), e.g. "
            f"{parts[0]}:{parts[1]}:after"
        )
    return int(parts[0]), parts[1], when


def check_inject_target(model: nn.Module, p_name: str) -> None:
    """Refuse a ``--diagnostics-inject-nan`` parameter the model does not have, naming close matches."""
    names = [n for n, _ in unwrap_model(model).named_parameters()]
    if p_name in names:
        return
    close = difflib.get_close_matches(p_name, names, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}?" if close else f"names look like {', '.join(names[:3])}."
    raise DeepInitConfigError(
        f"--diagnostics-inject-nan: the model has no parameter {p_name!r}; {hint} Give UPDATE:PARAM with a "
        "parameter name of this model (as model.named_parameters() lists them)"
    )


@register_criterion("label_smoothed_cross_entropy_diagnostics", dataclass=DiagnosticsCriterionConfig)
class DiagnosticsCriterion(LabelSmoothedCrossEntropyCriterion):
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
        self._run = _RunState()
        # statistics over depth and instability counters (issue 24): depth_hooks.py, training_counters.py
        self._depth_max = depth_hooks.MaxAccumulator()
        training_counters.check_options(diagnostics_spike_window, diagnostics_spike_threshold)
        self._counters = None
        if self.interval > 0 and "counters" in stats:
            self._counters = training_counters.TrainingCounters(diagnostics_spike_window, diagnostics_spike_threshold)
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
            self._wrap_optimizer(optimizer)
            if self._counters is not None:
                self._counters.wrap_optimizer(optimizer)
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
        depth_stats = [s for s in depth_hooks.STATS if s in self.stats]
        depth = depth_hooks.DepthStatistics(net, sample["net_input"], depth_stats) if depth_stats else None
        with ExitStack() as stack:
            for s in (res, nrm, depth):
                if s is not None:
                    stack.enter_context(s)
            loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        run.last_loss = loss.detach()
        logging_output.update(self._statistics(net, res, nrm))
        if depth is not None:  # moments sum over logging outputs; maxima wait for reduce (take_depth_statistics)
            logging_output.update({_KEY + k: v for k, v in depth.sums().items()})
            self._depth_max.add(run.update_num, depth.maxima())
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

    def _wrap_optimizer(self, optimizer) -> None:
        original_clip, original_zero_grad = optimizer.clip_grad_norm, optimizer.zero_grad

        def clip_grad_norm(max_norm, aggregate_norm_fn=None):
            return self._clip(original_clip, max_norm, aggregate_norm_fn)

        def zero_grad():
            # fairseq's trainer discards an update that failed its finiteness check here, on every rank,
            # before its NanDetector replay (whose hooks a replay of the guard's cannot run under)
            self.check_unfinished_update()
            return original_zero_grad()

        optimizer.clip_grad_norm, optimizer.zero_grad = clip_grad_norm, zero_grad

    def _clip(self, original, max_norm, aggregate_norm_fn):
        run = self._run
        try:
            grad_norm = original(max_norm, aggregate_norm_fn)
        except FloatingPointError as e:  # fp16/AMP: the minimum loss scale was reached
            if self.guard and not run.diverged:
                self._diverge(f"fairseq's loss scaling gave up ({e})", replay=True)
            raise
        # no host read here: fairseq's trainer checks the norm next (see check_unfinished_update)
        run.grad_norm, run.step_open = grad_norm, True
        if run.collect and "grad" in self.stats:
            run.grad_stats = self._grad_norm_statistics(grad_norm, sharded=aggregate_norm_fn is not None)
        return grad_norm

    def _grad_norm_statistics(self, grad_norm, sharded: bool) -> Dict[str, torch.Tensor] | None:
        """Per-layer gradient norms as a logging output, on the device (the task reduces them with the
        update's other statistics, :meth:`DiagnosticsTaskMixin.reduce_metrics`)."""
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
        """A training update's maxima over depth and, on updates that log, the instability counters, for the
        task's ``reduce_metrics`` (validation, with the model in eval mode, is not an update)."""
        run = self._run
        if run.model is None or not run.model.training:
            return None
        if self._counters is not None:
            self._counters.observe_update(logging_outputs, run.grad_norm)
        if not run.collect:
            return None
        out = {f"{_KEY}{k}": v for k, v in self._depth_max.take(run.update_num).items()}
        if self._counters is not None:
            out.update({f"{_KEY}scalar|{k}": v for k, v in self._counters.take().items()})
        return out or None

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
        run = self._run
        run.diverged = True
        run.collect = False
        model = run.model
        lines = [f"divergence guard: training stopped at update {run.update_num + 1}: {reason}."]
        culprit = None
        first_sub = None
        if replay and run.samples and model is not None:
            res = hooks.ResidualStatistics(model) if hooks.residual_modules(model) else None
            with ExitStack() as stack:
                if res is not None:
                    stack.enter_context(res)
                if run.precision is not None:  # a bf16/fp16-only overflow must overflow again
                    stack.enter_context(run.precision.applied())
                culprit = first_nonfinite_output(model, lambda: [model(**s["net_input"]) for s in run.samples])
            if res is not None:
                for sub, v in res.variances().items():
                    if not (math.isfinite(v["branch"]) and math.isfinite(v["skip"])):
                        first_sub = (sub, v)
                        break
        # say so when the replay ran under autocast: the same batch may be finite in fp32
        under = f"replayed under {run.precision.describe()}" if run.precision and run.precision.enabled else ""
        if culprit is not None:
            line = f"First layer whose statistics went non-finite (forward order): {layer_key(culprit + '._')}"
            line += f" (first module with a NaN/Inf output: {culprit}"
            if first_sub is not None:
                sub, v = first_sub
                line += f"; first sub-layer: {sub}, Var(branch)={v['branch']:.4g}, Var(skip)={v['skip']:.4g}"
            lines.append(line + (f"; {under}" if under else "") + ").")
        elif model is not None:
            grads = grad_norms_per_layer(model)
            bad = [k for k, v in grads.items() if not math.isfinite(v)]
            if bad:
                lines.append(
                    f"The forward pass is finite{f' ({under})' if under else ''}; the gradients first go non-finite "
                    f"(forward order) in layer "
                    f"{bad[0]} ({len(bad)} of {len(grads)} layers affected)."
                )
                world = _data_parallel_size()
                if world > 1:
                    # DDP all-reduces gradients, so another rank's batch or weights can be the source
                    lines.append(
                        f"This rank's forward pass is finite, but its gradients are averaged over {world} "
                        "data-parallel ranks: the other ranks' reports name the source."
                    )
        bad_params = nonfinite_parameters(model) if model is not None else []
        if bad_params:
            more = f" and {len(bad_params) - 5} more" if len(bad_params) > 5 else ""
            lines.append(f"Non-finite weights: {', '.join(bad_params[:5])}{more}.")
        lines.append(
            "No checkpoint is written from this state, so checkpoint_last.pt (if any) holds the last good one. "
            "To go on, resume from it with a lower --lr, a longer --warmup-updates, --clip-norm, or a "
            "deep-Transformer scheme (see docs/diagnostics.md)."
        )
        msg = "\n".join(lines)
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


class DiagnosticsTaskMixin:
    """Put in front of the task's class by :func:`install_task_mixin`: reports the update number to
    the criterion before fairseq's forward/backward, hands it the update's gradient statistics in
    ``reduce_metrics``, and lets it veto checkpoints of a diverged model."""

    _deepinit_criterion: DiagnosticsCriterion

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
        depth_stats = self._deepinit_criterion.take_depth_statistics(logging_outputs)
        if depth_stats:
            logging_outputs = [*logging_outputs, depth_stats]
        return super().reduce_metrics(logging_outputs, criterion)

    def state_dict(self):
        # fairseq's Trainer.state_dict() asks the task for its state on every checkpoint save
        self._deepinit_criterion.check_before_save()
        return super().state_dict()


_MIXED: Dict[type, type] = {}


def install_task_mixin(task, criterion: DiagnosticsCriterion) -> None:
    """Give ``task`` (an instance of any fairseq task) the :class:`DiagnosticsTaskMixin` behaviour."""
    cls = task.__class__
    if not issubclass(cls, DiagnosticsTaskMixin):
        if cls not in _MIXED:
            _MIXED[cls] = type(f"Diagnostics{cls.__name__}", (DiagnosticsTaskMixin, cls), {"__module__": __name__})
        task.__class__ = _MIXED[cls]
    task._deepinit_criterion = criterion
