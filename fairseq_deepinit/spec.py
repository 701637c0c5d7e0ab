"""What a ``deepinit`` model is: the :class:`ModelSpec`, resolved once from its options.

:func:`fairseq_deepinit.resolve.resolve` turns the options (fairseq's Namespace, a hydra config, a
checkpoint's stored arguments) into one frozen spec; it is the only representation of the model's
axes inside the plugin. The model build reads it (:mod:`fairseq_deepinit.plan`), each layer's forward
reads the fields it was built from (``layer.placement``, the residual modules), the resume check
compares what it resolves to, and fairseq's own booleans (``--encoder-/--decoder-normalize-before``)
are written from it at the fairseq boundary (:func:`fairseq_deepinit.resolve.store`) and never read back:
every reader of the placement reads ``Stack.placement`` (the families set ``--norm-placement``).

Per stack (:class:`Stack`): its kind, depth and width, its placement and each layer's (Mix-LN makes a
Pre-LN stack's first layers Post-LN), the residual scaling's constant. For the model: the init scheme,
the norm (:class:`Norm`), the residual scaling, the decoder layer type, the attention implementation,
and every method that is on with its options (``features``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Tuple

from .modules.stacks import StackKind


class Params(Mapping):
    """Resolved option values, read as attributes (``p.qk_norm_scope``) or by name; frozen."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Params are frozen")

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __reduce__(self):  # copy, deepcopy and pickle (a model holding its spec is deep-copied by fairseq's EMA)
        return Params, (self._values,)

    def __repr__(self) -> str:
        return f"Params({self._values})"


@dataclass(frozen=True)
class Norm:
    """``--norm-type`` and ``--norm-eps`` (None for a point-wise norm, which divides by nothing);
    ``export``: fairseq's ``--export`` (its TorchScript-friendly LayerNorm)."""

    type: str
    eps: float | None
    export: bool = False


@dataclass(frozen=True)
class Stack:
    """One stack of layers. ``placement``: where its norms sit (post, pre, peri, reordered: what
    ``--norm-placement`` or ``--*-normalize-before`` give it); ``placements``: each layer's, ``placement``
    unless a method places layers one by one; ``residual_constant``: the residual scaling's constant
    for this stack (DeepNorm's alpha, depth-muP's multiplier), None for a scaling without one."""

    kind: StackKind
    layers: int
    dim: int
    placement: str
    placements: Tuple[str, ...]
    residual_constant: float | None = None

    @property
    def final_norm(self) -> bool:
        """The stack ends with a final norm (every placement but Post-LN): fairseq's ``--*-normalize-before``
        for it, written by :func:`fairseq_deepinit.resolve.fairseq_flags` only."""
        return self.placement != "post"


@dataclass(frozen=True)
class ModelSpec:
    """The resolved model (see the module docstring). ``options``: every option's resolved value, what a
    checkpoint stores; ``task``: fairseq's ``--task`` the model is built under; ``fp16``: ``--fp16`` or
    ``--memory-efficient-fp16`` given; ``notes``: ``(logger, warning)`` pairs the build logs once."""

    init: str
    norm: Norm
    residual: str
    layer_type: str
    attention: str
    encoder: Stack | None
    decoder: Stack
    features: Params
    options: Params
    # what the run around the model gives that a method's validate reads (Admin's profiling options need a
    # profiling task; ResiDual warns for fp16), so that validate gets the spec and never fairseq's arguments
    task: str | None = None
    fp16: bool = False
    notes: Tuple[Tuple[str, str], ...] = ()

    @property
    def stacks(self) -> Tuple[Stack, ...]:
        return tuple(s for s in (self.encoder, self.decoder) if s is not None)

    def stack(self, kind: StackKind) -> Stack:
        """The stack that layers of ``kind`` belong to."""
        return self.encoder if kind.stack == "encoder" else self.decoder

    def layers(self, stack: str) -> int:
        """The layers of ``stack`` (``encoder`` / ``decoder``), 0 for a stack the model does not have."""
        found = getattr(self, stack)
        return found.layers if found is not None else 0
