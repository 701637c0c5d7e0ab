"""z-loss (PaLM, Chowdhery et al. 2022, arXiv 2204.02311, sec. 5 "Training setup": an auxiliary
``1e-4 * log^2 Z`` keeps the softmax normaliser near 1): ``--z-loss``, ``--z-loss-multiplier``.

Per target token with logits ``x`` (``Z = sum_v exp(x_v)``), the criterion adds ``c * log^2 Z``:
OLMo-core @ fa6c501 ``src/olmo_core/nn/functional/cross_entropy_loss.py:35-50`` (float32 logits,
``z_squared = logits.logsumexp(-1).pow(2)``, masked by the labels, ``z_loss = z_loss_multiplier *
z_squared``, default ``1e-4``) and ``nn/lm_head.py:255-266`` (``loss = ce_loss + z_loss``). OLMo 2 and
OLMo 3's official scripts pass ``1e-5`` (``src/scripts/official/OLMo2/OLMo-2-0325-32B-train.py:90``).

Nothing of the model changes: the record holds the options (so they reach ``fairseq-train`` and the
``model`` node of ``fairseq-hydra-train`` like every other), its refusal and its ``loss_term`` hook
(:func:`fairseq_deepinit.training.z_loss.loss_term`), which the plugin's criteria add while it is on
(:mod:`fairseq_deepinit.training.loss_terms`, which also refuses any other criterion).
"""

from __future__ import annotations

import math

from ..training.z_loss import loss_term
from .exporting import EXPORT_NEUTRAL
from .record import FLAG, Method, Option, Rule

DEFAULT_MULTIPLIER = 1e-4  # PaLM; OLMo-core cross_entropy_loss(z_loss_multiplier=1e-4)
# the term is an auxiliary loss beside the cross-entropy (PaLM 1e-4, OLMo 2/3 1e-5); at c = 1 it already weighs as
# much as the cross-entropy per unit of log^2 Z, and a larger c (1e308) makes the loss or its gradient overflow in
# the first update (fairseq: "gradients are Nan/Inf", with a traceback)
MAX_MULTIPLIER = 1.0


def _multiplier_problem(c) -> str | None:
    if isinstance(c, (int, float)) and math.isfinite(c) and 0 < c <= MAX_MULTIPLIER:
        return None
    return (
        f"--z-loss-multiplier must be a number greater than 0 and at most {MAX_MULTIPLIER:g}, got {c}: the term is "
        f"an auxiliary loss beside the cross-entropy (PaLM {DEFAULT_MULTIPLIER:g}, the default; OLMo 2 1e-05)"
    )


METHOD = Method(
    name="z_loss",
    title="z-loss",
    paper="Chowdhery et al. 2022 (PaLM), sec. 5; OLMo, OLMo 2",
    summary="the criterion adds c * log^2 Z of the output softmax per target token (c 1e-4), against logit drift; "
    "logged as z_loss and z_loss_unscaled",
    code="allenai/OLMo-core @ fa6c501 src/olmo_core/nn/functional/cross_entropy_loss.py:35-50, "
    "src/olmo_core/nn/lm_head.py:255-266",
    enabled_by="z_loss",
    options=(
        Option(
            "z_loss",
            bool,
            False,
            "z-loss: the criterion adds c * logsumexp(logits)^2 per target token (PaLM; OLMo-core); needs one of "
            "the plugin's criteria (docs/usage.md)",
            resume=False,
        ),
        Option(
            "z_loss_multiplier",
            float,
            DEFAULT_MULTIPLIER,
            f"with --z-loss: the multiplier c, above 0 and at most {MAX_MULTIPLIER:g} (default {DEFAULT_MULTIPLIER}: "
            "PaLM, OLMo-core's default; OLMo 2 and OLMo 3 trained with 1e-5)",
            check=_multiplier_problem,
            resume=False,
        ),
    ),
    excludes=(
        Rule(
            FLAG,
            ("adaptive_softmax_cutoff",),
            "adaptive softmax never forms the full logits whose log Z the term penalises",
        ),
    ),
    describe=lambda p: f"z-loss={p.z_loss_multiplier:g}",
    export=EXPORT_NEUTRAL,  # a training loss term
    loss_term=loss_term,
)
