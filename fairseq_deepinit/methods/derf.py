"""Derf, Dynamic erf (Chen, Lu, Zhu, Sun, Liu 2025, "Stronger Normalization-Free Transformers"):
``--norm-type derf``, every norm of the model replaced by ``weight * erf(alpha x + shift) + bias``.

The block is :class:`~fairseq_deepinit.modules.dyt.Derf` (zlab-princeton/Derf @ 8dd9ea3
``ViT/dynamic_erf.py:6-26``: scalars ``alpha`` (init 0.5) and ``shift`` (init 0), per-channel ``weight``
and ``bias``). The options are DyT's (:mod:`.dyt`: alpha per position and presets, bias, learnable
embedding scale; the GPT-2 patch ``language model/model_derf.patch`` has the per-position alphas and the
embedding scalar, leaving the values to the user) and ``--derf-shift-init``. The GPT-2 patch scales
``tok + pos``; fairseq's ``embed_scale`` scales the token embedding before positions are added, as the
LLaMA code (no absolute positions there): this model keeps fairseq's order.
"""

from __future__ import annotations

import math

from ..modules.dyt import DERF_ALPHA_INIT, DERF_SHIFT_INIT
from .pointwise import pointwise_hooks, pointwise_options
from .record import Method, Option


def _shift_problem(value) -> str | None:
    if math.isfinite(value):
        return None
    return f"--derf-shift-init must be a finite number (released: {DERF_SHIFT_INIT}), got {value}"


METHOD = Method(
    name="derf",
    title="Derf (Dynamic erf)",
    paper="Chen, Lu, Zhu, Sun, Liu 2025",
    summary="every norm replaced by `weight * erf(alpha x + shift) + bias` (scalars alpha, shift); DyT's options",
    code="zlab-princeton/Derf @ 8dd9ea3 ViT/dynamic_erf.py:6-26; language model/model_derf.patch",
    enabled_by="norm_type=derf",
    options=(
        *pointwise_options("derf", DERF_ALPHA_INIT, "Derf"),
        Option(
            "derf_shift_init",
            float,
            DERF_SHIFT_INIT,
            f"derf: initial shift s of every Derf (default {DERF_SHIFT_INIT}, released)",
            check=_shift_problem,
        ),
    ),
    **pointwise_hooks("derf", lambda p: {"shift_init": float(p.derf_shift_init)}),
    families={"derf": dict(norm_type="derf", norm_placement="pre")},
)
