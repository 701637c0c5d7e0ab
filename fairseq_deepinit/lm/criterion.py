"""``--criterion cross_entropy_diagnostics``: fairseq's ``cross_entropy`` with the plugin's diagnostics.

The language-modeling counterpart of ``label_smoothed_cross_entropy_diagnostics``
(:mod:`fairseq_deepinit.diagnostics.criterion`): the same per-sub-layer statistics
(``--diagnostics-interval``, ``--diagnostics-stats``) and the same divergence guard, on the plain
negative log-likelihood that fairseq's ``cross_entropy`` criterion trains language models with.
Label-smoothed cross-entropy with epsilon = 0 is exactly that loss
(``(1 - eps - eps/(V-1)) * nll + eps/(V-1) * smooth`` at eps = 0, fairseq's
criterions/label_smoothed_cross_entropy.py ``label_smoothed_nll_loss``), so the machinery is reused
with epsilon fixed at 0. Under ``--adaptive-softmax-cutoff`` the log-probabilities come from
fairseq's adaptive softmax (``get_normalized_probs``), i.e. the full distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

from fairseq.criterions import register_criterion

from ..diagnostics import training_counters
from ..diagnostics.criterion import DEFAULT_STATS, DiagnosticsCriterion, DiagnosticsCriterionConfig
from ..errors import DeepInitConfigError

CRITERION_NAME = "cross_entropy_diagnostics"


@dataclass
class CrossEntropyDiagnosticsConfig(DiagnosticsCriterionConfig):
    """The diagnostics criterion's options; ``--label-smoothing`` must stay 0 (plain cross-entropy)."""


@register_criterion(CRITERION_NAME, dataclass=CrossEntropyDiagnosticsConfig)
class CrossEntropyDiagnosticsCriterion(DiagnosticsCriterion):
    """Cross-entropy (language models) with per-sub-layer diagnostics and the divergence guard."""

    def __init__(
        self,
        task,
        sentence_avg: bool,
        label_smoothing: float = 0.0,
        ignore_prefix_size: int = 0,
        report_accuracy: bool = False,
        diagnostics_interval: int = 100,
        diagnostics_stats: str = DEFAULT_STATS,
        no_divergence_guard: bool = False,
        diagnostics_inject_nan: str = "",
        diagnostics_spike_window: int = training_counters.DEFAULT_WINDOW,
        diagnostics_spike_threshold: float = training_counters.DEFAULT_THRESHOLD,
    ) -> None:
        if label_smoothing:
            raise DeepInitConfigError(
                f"--criterion {CRITERION_NAME} is plain cross-entropy; drop --label-smoothing {label_smoothing} or use "
                "--criterion label_smoothed_cross_entropy_diagnostics"
            )
        super().__init__(
            task,
            sentence_avg,
            0.0,
            ignore_prefix_size,
            report_accuracy,
            diagnostics_interval,
            diagnostics_stats,
            no_divergence_guard,
            diagnostics_inject_nan,
            diagnostics_spike_window,
            diagnostics_spike_threshold,
        )
