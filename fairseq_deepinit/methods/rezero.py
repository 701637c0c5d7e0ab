"""ReZero (Bachlechner et al. 2020, eq. 5) and ReZero+Post-LN, the Admin paper's Table 3 baselines:
``--init-scheme rezero`` / ``rezero+postln`` with ``--residual-scale rezero``.

``x + a * f(x)`` with one learned scalar ``a`` per sub-layer starting at 0
(:class:`~fairseq_deepinit.modules.residual.ReZeroResidual`); weights from the fairseq 0.8/0.9
baseline. ``rezero`` removes every norm; ``rezero+postln`` keeps Post-LN: ``LN(x + a * f(x))``.
"""

from __future__ import annotations

from ..modules.init import apply_baseline
from ..modules.residual import ReZeroResidual
from .exporting import EXPORT_NEUTRAL, folds
from .record import WITH_NORM, InitScheme, Method, ResidualScaling, post_ln

METHOD = Method(
    name="rezero",
    title="ReZero (and ReZero + Post-LN)",
    paper="Bachlechner et al. 2020, eq. 5; Liu et al. 2020, Table 3",
    summary="`x + a f(x)`, one learned scalar a per sub-layer starting at 0, no norm (`rezero+postln`: "
    "`LN(x + a f(x))`)",
    code="majumderb/rezero",
    init_schemes=(
        InitScheme(
            "rezero",
            apply_baseline,
            "ReZero (Bachlechner et al. 2020): x + a*f(x), a=0 at start, no norm",
            default_norm="none",
            allowed_norms=("none",),
            norm_reason="ReZero replaces normalisation",
            residual="rezero",
        ),
        InitScheme(
            "rezero+postln",
            apply_baseline,
            "ReZero with Post-LN: LN(x + a*f(x)) (Liu et al. 2020, Table 3)",
            allowed_norms=WITH_NORM,
            norm_reason="this variant keeps Post-LN",
            residual="rezero",
            requires=(post_ln(),),
        ),
    ),
    residual_scalings=(
        ResidualScaling(
            "rezero",
            lambda stack, sublayer, p: ReZeroResidual(),
            "x + a * f(x), a learned, from 0",
            export=folds("ReZero's a (into out_proj and fc2)", "branch-scalar"),
        ),
    ),
    export=EXPORT_NEUTRAL,
    families={"rezero": dict(init_scheme="rezero"), "rezero_postln": dict(init_scheme="rezero+postln")},
)
