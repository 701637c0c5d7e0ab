"""The options of the diagnostics criteria (``--criterion label_smoothed_cross_entropy_diagnostics`` and
``cross_entropy_diagnostics``): fairseq's label-smoothed cross-entropy options plus the diagnostics'
own; what each statistic is: :mod:`.criterion`, :mod:`.depth_hooks`, :mod:`.training_counters`."""

from dataclasses import dataclass, field

from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterionConfig

from . import depth_hooks, training_counters

STATS = ("var", "norm", "residual", "scalenorm", "grad", *depth_hooks.STATS, "counters")
DEFAULT_STATS = ",".join(STATS)


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
