"""The methods, one module each, and the one list of them (:data:`METHODS`).

Each module holds one :class:`~.record.Method` record (``METHOD``): its options, validation, the
selector values it adds (init scheme, residual scaling, decoder layer type), its layer set-up and
post-init, its named architectures. :mod:`.core` holds the options no method owns. The order below is
the order of ``--help``, of the model's log line, of the layer set-ups and post-inits, of the
architecture families and of docs/schemes.md's method table (:mod:`.table`). Adding a method is one
module here plus its line in :data:`METHODS` (docs/architecture.md walks through one).
"""

from __future__ import annotations

import dataclasses
from typing import Dict

from . import (
    admin,
    b2t,
    baseline,
    core,
    deepnorm,
    depth_mup,
    derf,
    dsinit,
    dyt,
    lipschitz,
    lnscale,
    matt,
    mixln,
    normformer,
    placement,
    qk_norm,
    resi_dual,
    rezero,
    subln,
    tfixup,
    twt,
)
from .record import InitScheme, LayerType, Method, Option, ResidualScale

METHODS: Dict[str, Method] = {
    m.name: m
    for m in (
        core.METHOD,
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
        dyt.METHOD,
        derf.METHOD,
        depth_mup.METHOD,
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
RESIDUAL_SCALES: Dict[str, ResidualScale] = _by_name("residual_scales")
LAYER_TYPES: Dict[str, LayerType] = _by_name("layer_types")


def selector_choices() -> Dict[str, tuple]:
    """The values of the three selectors the records add (``auto`` resolves ``--residual-scale`` from the scheme)."""
    return {
        "init_scheme": tuple(sorted(INIT_SCHEMES)),
        "residual_scale": ("auto",) + tuple(sorted(RESIDUAL_SCALES)),
        "decoder_layer_type": tuple(sorted(LAYER_TYPES)),
    }


def method_options() -> Dict[str, tuple]:
    """``{option name: (Option, Method)}`` over every record, in method order; the selectors' choices filled in."""
    choices = selector_choices()
    out: Dict[str, tuple] = {}
    for method in METHODS.values():
        for option in method.options:
            if option.name in choices:
                option = dataclasses.replace(option, choices=choices[option.name])
            if option.name in out:
                raise ValueError(f"option {option.name!r} is defined by {out[option.name][1].name} and {method.name}")
            out[option.name] = (option, method)
    return out


__all__ = [
    "INIT_SCHEMES",
    "LAYER_TYPES",
    "METHODS",
    "RESIDUAL_SCALES",
    "Method",
    "Option",
    "method_options",
    "selector_choices",
]
