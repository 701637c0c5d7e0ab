"""Initialisation schemes (``--init-scheme``), one module per method (:mod:`.base` holds the registry).

Each scheme is a :class:`~.base.SchemeSpec`: a function that re-initialises a freshly built model in
place, plus what the scheme needs from the other axes (norm type, residual scaling, Post-LN).
Importing the package registers every scheme; registration order is the order of ``--help``.
"""

from . import baseline, deepnorm, dsinit, lipschitz, rezero, smallinit, tfixup  # noqa: F401  (registration)
from .base import (
    SCHEMES,
    WITH_NORM,
    SchemeSpec,
    apply_init_scheme,
    iter_layers,
    own_value_projections,
    register_post_init_hook,
    register_scheme,
)

__all__ = [
    "SCHEMES",
    "WITH_NORM",
    "SchemeSpec",
    "apply_init_scheme",
    "iter_layers",
    "own_value_projections",
    "register_post_init_hook",
    "register_scheme",
]
