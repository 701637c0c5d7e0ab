"""What the spec makes of a model being built: the answers to fairseq's build hooks.

The models (:mod:`fairseq_deepinit.model`, :mod:`fairseq_deepinit.lm.model`) resolve their options once
(:func:`fairseq_deepinit.resolve.resolve`) and build under :func:`carried`, so that every hook of fairseq's
build finds the spec on the config it is given (:func:`spec_of`) and asks here:

- :func:`layer_plan`: for each layer, its placement (the spec's, per layer), norm builder, residual
  modules, attention implementation, and the set-ups of the methods that are on
  (:class:`~fairseq_deepinit.modules.layer_base.LayerPlan`);
- :func:`norm_builder` / :func:`build_stack_norm`: the norms of the spec's norm type with the methods'
  norm arguments by position (DyT/Derf's alpha), in the layers and on the stacks;
- :func:`decoder_layer_class`, :func:`setup_stack`, :func:`build_embedding`, :func:`build_output_projection`;
- :func:`apply_init`: the init scheme, then each method's post-init, once the model is built.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch.nn as nn

from .methods import INIT_SCHEMES, LAYER_TYPES, METHODS, RESIDUAL_SCALINGS, declaring
from .modules.layer_base import LayerPlan
from .modules.norms import build_norm
from .modules.stacks import StackKind
from .resolve import resolve
from .spec import ModelSpec

CARRIER = "deepinit_spec"


@contextlib.contextmanager
def carried(args: Any, spec: ModelSpec) -> Iterator[None]:
    """``args`` carries ``spec`` while fairseq builds the model from it.

    fairseq copies every attribute of the Namespace into the ``TransformerConfig`` its build hooks receive
    (``TransformerConfig.from_namespace``); the spec rides along, and leaves ``args`` before anything
    stores it (a checkpoint holds plain values only).
    """
    setattr(args, CARRIER, spec)
    try:
        yield
    finally:
        delattr(args, CARRIER)


def spec_of(cfg: Any) -> ModelSpec:
    """The spec of the model ``cfg`` is building (:func:`carried`), or resolved from ``cfg`` outside a build."""
    spec = getattr(cfg, CARRIER, None)
    return spec if spec is not None else resolve(cfg)


def _on(spec: ModelSpec, hook: str):
    """``(method, its options)`` of the methods that are on and have ``hook``, in method order."""
    return [(m, spec.features[m.name]) for m in METHODS.values() if m.name in spec.features and getattr(m, hook)]


def params_of(spec: ModelSpec, value: Any) -> Any:
    """The options of the method that adds the selector ``value``, while it is on (else None)."""
    method = declaring(value)
    return spec.features.get(method.name) if method is not None else None


def layer_options(spec: ModelSpec) -> Any:
    """The decoder layer type's typed options (its :class:`~fairseq_deepinit.methods.record.LayerType`'s
    ``options`` of its method's resolved options), or None."""
    layer_type = LAYER_TYPES[spec.layer_type]
    p = params_of(spec, layer_type)
    return layer_type.options(p) if layer_type.options is not None and p is not None else None


def norm_builder(spec: ModelSpec) -> Callable[..., nn.Module]:
    """``build(dim, position=None)``: a norm of the spec's type over ``dim`` with the keyword arguments the
    methods give a norm at ``position`` (``attn``, ``ffn``, ``final`` or None)."""
    methods = _on(spec, "norm_args")

    def build(dim: int, position: str | None = None) -> nn.Module:
        kwargs: dict = {}
        for method, p in methods:
            kwargs.update(method.norm_args(p, position))
        return build_norm(spec.norm.type, dim, spec.norm.eps, spec.norm.export, **kwargs)

    return build


def build_stack_norm(spec: ModelSpec, dim: int, position: str | None) -> nn.Module | None:
    """A stack-level norm (the final norm, position ``final``; the embedding norm, None), or None without norms."""
    return None if spec.norm.type == "none" else norm_builder(spec)(dim, position)


def layer_plan(spec: ModelSpec, kind: StackKind, index: int) -> LayerPlan:
    """The plan of layer ``index`` (from 1) of a stack of ``kind``."""
    stack = spec.stack(kind)
    residual = RESIDUAL_SCALINGS[spec.residual]
    p = params_of(spec, residual)
    return LayerPlan(
        kind=kind,
        index=index,
        placement=stack.placements[index - 1],
        norm=norm_builder(spec),
        residual=lambda sublayer: residual.module(stack, sublayer, p),
        attention_impl=spec.attention,
        setup=tuple(lambda layer, m=m, q=q: m.layer_setup(layer, q, spec) for m, q in _on(spec, "layer_setup")),
        params=layer_options(spec),
    )


def setup_stack(stack: nn.Module, spec: ModelSpec, kind: StackKind) -> None:
    """The ``stack_setup`` of each method that is on, on a freshly built encoder or decoder."""
    for method, p in _on(spec, "stack_setup"):
        method.stack_setup(stack, p, spec, spec.stack(kind))


def decoder_layer_class(spec: ModelSpec) -> type:
    return LAYER_TYPES[spec.layer_type].cls


def build_embedding(spec: ModelSpec, dictionary, embed_dim: int, path: str | None = None) -> nn.Module | None:
    """A method's word embedding (FixNorm's), or None for fairseq's."""
    for method, p in _on(spec, "embedding"):
        return method.embedding(p, dictionary, embed_dim, path)
    return None


def build_output_projection(spec: ModelSpec, embed_tokens: nn.Module) -> nn.Module | None:
    """A method's output layer (FixNorm's tied one over the normalised embeddings), or None for fairseq's."""
    for method, p in _on(spec, "output_projection"):
        return method.output_projection(p, embed_tokens)
    return None


def apply_init(model: nn.Module, spec: ModelSpec) -> None:
    """The init scheme on the freshly built model, then each method's post-init, in method order."""
    scheme = INIT_SCHEMES[spec.init]
    scheme.apply(model, params_of(spec, scheme), spec)
    for method, p in _on(spec, "post_init"):
        method.post_init(model, p, spec)


def embedding_schemes() -> tuple:
    """The init schemes that re-initialise the word-embedding matrix itself."""
    return tuple(name for name, scheme in INIT_SCHEMES.items() if scheme.embeddings)
