"""ReZero (Bachlechner et al. 2020, eq. 5) and ReZero+Post-LN, the Admin paper's Table 3 baselines.

``x + a * f(x)`` with one learned scalar ``a`` per sub-layer starting at 0 (``--residual-scale
rezero``); weights from the fairseq 0.8/0.9 baseline. ``rezero`` removes every norm;
``rezero+postln`` keeps Post-LN: ``LN(x + a * f(x))``.
"""

from __future__ import annotations

from .base import WITH_NORM, SchemeSpec, register_scheme
from .baseline import apply_baseline

register_scheme(
    SchemeSpec(
        "rezero",
        apply_baseline,
        "ReZero (Bachlechner et al. 2020): x + a*f(x), a=0 at start, no norm",
        default_norm="none",
        allowed_norms=("none",),
        norm_reason="ReZero replaces normalisation",
        residual="rezero",
    )
)
register_scheme(
    SchemeSpec(
        "rezero+postln",
        apply_baseline,
        "ReZero with Post-LN: LN(x + a*f(x)) (Liu et al. 2020, Table 3)",
        allowed_norms=WITH_NORM,
        norm_reason="this variant keeps Post-LN",
        residual="rezero",
        needs_post_ln=True,
    )
)
