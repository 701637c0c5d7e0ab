"""The methods, one module each, the one list of them (:data:`METHODS`) and the selector values they add.

Each module holds one :class:`~.record.Method` record (``METHOD``): its options, the selector values it adds
(init scheme, residual scaling, decoder layer type), what it requires and excludes, its hooks, its named
architectures. The order below is the order of ``--help``, of the model's log line, of the layer set-ups
and post-inits, of the rules' checks, of the architecture families and of docs/schemes.md's method table
(:mod:`deepinit_tools.methods_table`). Adding a method is one module here plus its line in :data:`METHODS`
(docs/architecture.md walks through one).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from ..errors import DeepInitConfigError
from . import (
    admin,
    attention_residuals,
    attention_sinks,
    attention_softcap,
    b2t,
    baseline,
    deepnorm,
    depth_mup,
    derf,
    dsinit,
    dyt,
    gated_attention,
    hyper_connections,
    lipschitz,
    lnscale,
    matt,
    mixln,
    normformer,
    output_softcap,
    placement,
    qk_clip,
    qk_norm,
    resi_dual,
    rezero,
    subln,
    swiglu,
    tfixup,
    twt,
    value_residual,
    z_loss,
)
from .record import InitScheme, LayerType, Method, Option, ResidualScaling

METHODS: Dict[str, Method] = {
    m.name: m
    for m in (
        baseline.METHOD,
        lipschitz.METHOD,
        tfixup.METHOD,
        dsinit.METHOD,
        twt.METHOD,
        deepnorm.METHOD,
        rezero.METHOD,
        admin.METHOD,
        matt.METHOD,
        b2t.METHOD,
        resi_dual.METHOD,
        normformer.METHOD,
        subln.METHOD,
        lnscale.METHOD,
        mixln.METHOD,
        placement.METHOD,
        qk_norm.METHOD,
        gated_attention.METHOD,
        attention_sinks.METHOD,
        attention_softcap.METHOD,
        value_residual.METHOD,
        dyt.METHOD,
        derf.METHOD,
        depth_mup.METHOD,
        hyper_connections.METHOD,
        attention_residuals.METHOD,
        z_loss.METHOD,
        output_softcap.METHOD,
        swiglu.METHOD,
        qk_clip.METHOD,
    )
}


def _by_name(kind: str) -> dict:
    out: dict = {}
    for method in METHODS.values():
        for value in getattr(method, kind):
            if value.name in out:
                raise ValueError(f"{kind} {value.name!r} is defined by two methods")
            out[value.name] = value
    return out


INIT_SCHEMES: Dict[str, InitScheme] = _by_name("init_schemes")
RESIDUAL_SCALINGS: Dict[str, ResidualScaling] = _by_name("residual_scalings")
LAYER_TYPES: Dict[str, LayerType] = _by_name("layer_types")
TRAINING_HOOKS = ("check_training", "param_groups", "after_step", "loss_term")
"""The :class:`Method` hooks fairseq's trainer and criterion run (:mod:`.record`), not the model's build."""


def declaring(value: InitScheme | ResidualScaling | LayerType) -> Method:
    """The method that adds the selector value ``value``."""
    return next(m for m in METHODS.values() if value in (*m.init_schemes, *m.residual_scalings, *m.layer_types))


def enabled(spec: Any) -> List[Tuple[Method, Any]]:
    """``(method, its resolved options)`` for every method that is on in ``spec`` (a
    :class:`~fairseq_deepinit.spec.ModelSpec`: its ``features``), in :data:`METHODS` order: the one list the
    training hooks are looked up in (:func:`fairseq_deepinit.patches.build_optimizer`,
    :mod:`fairseq_deepinit.training.loss_terms`)."""
    return [(METHODS[name], p) for name, p in spec.features.items()]


def training_task(spec: Any) -> str | None:
    """The fairseq ``--task`` the methods on in ``spec`` train under (each record's ``training_task``), None: any."""
    tasks = sorted({t for m, p in enabled(spec) if m.training_task is not None and (t := m.training_task(p, spec))})
    if len(tasks) > 1:
        raise DeepInitConfigError(f"the methods of this model train under different tasks ({', '.join(tasks)})")
    return tasks[0] if tasks else None


__all__ = [
    "INIT_SCHEMES", "LAYER_TYPES", "METHODS", "RESIDUAL_SCALINGS", "TRAINING_HOOKS", "Method", "Option", "declaring",
    "enabled", "training_task",
]  # fmt: skip
