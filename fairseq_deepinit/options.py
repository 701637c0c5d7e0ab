"""Command-line options of the ``deepinit`` models: their parser, their table, and the resolution at fairseq's boundary.

Every option is declared once: the axes' by :mod:`fairseq_deepinit.axes`, every other by its method's
record (:mod:`fairseq_deepinit.methods`). This module adds them to fairseq's parser
(:func:`add_model_args`), lists them for the resume check and the generated hydra configs
(:func:`all_options`, :func:`option_table`), and resolves a Namespace in place where fairseq needs it
(:func:`resolve_and_validate`: :func:`fairseq_deepinit.resolve.resolve`, then
:func:`~fairseq_deepinit.resolve.store`).

Every incompatible combination stops before the model is built, with a message that says what to
change; nothing is silently overridden. ``auto`` values are resolved from the init scheme's needs and
the resolved values are what the checkpoint stores. An option of a method that is off is stored as
its ``off`` value (None for an option of a selector value), so that re-resolving the arguments stored
in a checkpoint (generate, resume) gives the same answer.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Tuple

from . import resolve as resolution
from .axes import all_options
from .errors import DeepInitConfigError
from .methods.record import Method, Option
from .spec import ModelSpec

__all__ = ["ARCH_BOOL_FLAGS", "DeepInitConfigError", "add_model_args", "all_options", "describe", "option_table",
           "resolve_and_validate", "spec_of"]  # fmt: skip

# fairseq store_true flags that named architectures set: their default becomes None so that an
# architecture can tell "not given" from "given" (fairseq's own t2t arch cannot, see README)
ARCH_BOOL_FLAGS = ("encoder_normalize_before", "decoder_normalize_before", "share_decoder_input_output_embed")


def option_table() -> List[Dict[str, Any]]:
    """One row per option, enough to generate a config dataclass: name, type, default, help, choices, the
    flag of a bool option's ``store_false`` twin, the owning ``(selector, value)`` (None: the option applies
    to every configuration), the method (None: an axis), and whether a resumed run must keep it."""
    return [
        {
            "name": o.name,
            "type": o.type,
            "default": o.default,
            "help": o.help,
            "choices": o.choices,
            "negative": o.negative,
            "owner": _owner(o, m),
            "method": m.name if m is not None else None,
            "resume": o.resume,
        }
        for o, m in all_options()
    ]


def _owner(option: Option, method: Method | None) -> Tuple[str, Any] | None:
    if method is None or not method.selector_owned or option.name in dict(method.switches):
        return None
    return method.switches[0]


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(**{name: None for name in ARCH_BOOL_FLAGS})
    g = parser.add_argument_group("deepinit: normalisation, residual scaling and initialisation")
    for option, _method in all_options():
        option.add_to(g)


def resolve_and_validate(args: argparse.Namespace) -> ModelSpec:
    """Resolve ``args`` (refusing what cannot be built), log the resolution's warnings, and store the resolved
    values in ``args``, as the model build does; returns the spec."""
    spec = resolution.resolve(args)
    resolution.log_notes(spec)
    resolution.store(spec, args)
    return spec


def spec_of(args: Any) -> ModelSpec:
    """The spec of arguments already resolved (a checkpoint's, an export's): only read, nothing logged or
    stored; where the export and Admin's fold read each :class:`~fairseq_deepinit.spec.Stack`'s ``placement``."""
    return resolution.resolve(args)


def describe(args: Any) -> str:
    """The model's log line for resolved arguments (:func:`fairseq_deepinit.resolve.describe` of their spec)."""
    return resolution.describe(resolution.resolve(args))
