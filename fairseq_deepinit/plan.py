"""What the selected methods make of a model being built, read from the records (:mod:`fairseq_deepinit.methods`).

The models (:mod:`fairseq_deepinit.model`, :mod:`fairseq_deepinit.lm.model`) ask here, at each of
fairseq's build hooks, what the resolved options (:func:`fairseq_deepinit.options.resolve_and_validate`)
select:

- :func:`layer_plan`: for each layer, its norm placement, norm builder, residual modules, attention
  implementation and the methods' layer set-ups (:class:`~fairseq_deepinit.modules.layers.LayerPlan`);
- :func:`norm_builder` / :func:`build_stack_norm`: the norms of ``--norm-type`` with the methods' norm
  arguments by position (DyT/Derf's alpha), in the layers and on the stacks;
- :func:`decoder_layer_class`: the ``--decoder-layer-type`` class;
- :func:`setup_stack`: the methods' set-up of a built encoder or decoder (ResiDual's second stream);
- :func:`build_embedding` / :func:`build_output_projection`: a method's replacement of the word embedding
  or the output layer (FixNorm), or None for fairseq's own;
- :func:`apply_init`: the init scheme, then every method's post-init, once the model is built.
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from .methods import INIT_SCHEMES, LAYER_TYPES, METHODS, RESIDUAL_SCALES
from .modules.attention import DEFAULT_IMPL
from .modules.layers import LayerPlan
from .modules.norms import build_norm
from .modules.stacks import StackKind


def stack_placement(cfg, kind: StackKind) -> str:
    """A stack's placement: ``--norm-placement`` where given, else what fairseq's flags give it,
    ``--encoder-/--decoder-normalize-before`` (Pre-LN) or not."""
    placement = getattr(cfg, "norm_placement", None)
    if placement not in (None, "auto"):
        return placement
    section = cfg.encoder if kind.stack == "encoder" else cfg.decoder
    return "pre" if section.normalize_before else "post"


def norm_builder(cfg) -> Callable[..., nn.Module]:
    """``build(dim, position=None)``: a norm of ``--norm-type`` over ``dim`` with the keyword arguments the
    selected methods give a norm at ``position`` (``attn``, ``ffn``, ``final`` or None)."""
    methods = [m for m in METHODS.values() if m.norm_args is not None and m.selected(cfg)]

    def build(dim: int, position: str | None = None) -> nn.Module:
        kwargs: dict = {}
        for method in methods:
            kwargs.update(method.norm_args(cfg, position))
        return build_norm(cfg.norm_type, dim, cfg.norm_eps, cfg.export, **kwargs)

    return build


def build_stack_norm(cfg, dim: int, position: str | None) -> nn.Module | None:
    """A stack-level norm (the final Pre-LN norm, position ``final``; the embedding norm, None), or None
    under ``--norm-type none``."""
    return None if cfg.norm_type == "none" else norm_builder(cfg)(dim, position)


def layer_plan(cfg, kind: StackKind, index: int) -> LayerPlan:
    """The plan of layer ``index`` (from 1) of a stack of ``kind``; ``cfg``: fairseq's TransformerConfig
    of the resolved options."""
    methods = [m for m in METHODS.values() if m.selected(cfg)]
    placement = next(
        (p for p in (m.placement(cfg, kind, index) for m in methods if m.placement) if p is not None),
        stack_placement(cfg, kind),
    )
    residual = RESIDUAL_SCALES[getattr(cfg, "residual_scale", None) or "none"]
    return LayerPlan(
        kind=kind,
        index=index,
        placement=placement,
        norm=norm_builder(cfg),
        residual=lambda sublayer: residual.build(cfg, kind, sublayer, index),
        attention_impl=getattr(cfg, "attention_impl", None) or DEFAULT_IMPL,
        setup=tuple(m.layer_setup for m in methods if m.layer_setup is not None),
    )


def setup_stack(stack: nn.Module, cfg, kind: StackKind) -> None:
    """Every selected method's ``stack_setup`` of a freshly built encoder or decoder, in method order."""
    for method in METHODS.values():
        if method.stack_setup is not None and method.selected(cfg):
            method.stack_setup(stack, cfg, kind)


def decoder_layer_class(cfg) -> type:
    """The class of ``--decoder-layer-type`` (fairseq's decoder layer by default)."""
    return LAYER_TYPES[getattr(cfg, "decoder_layer_type", None) or "standard"].cls


def build_embedding(args, dictionary, embed_dim: int, path: str | None = None) -> nn.Module | None:
    """A method's word embedding (FixNorm's), or None for fairseq's."""
    for method in METHODS.values():
        if method.embedding is not None and method.selected(args):
            embedding = method.embedding(args, dictionary, embed_dim, path)
            if embedding is not None:
                return embedding
    return None


def build_output_projection(cfg, embed_tokens: nn.Module) -> nn.Module | None:
    """A method's output layer (FixNorm's tied one over the normalised embeddings), or None for fairseq's."""
    for method in METHODS.values():
        if method.output_projection is not None and method.selected(cfg):
            projection = method.output_projection(cfg, embed_tokens)
            if projection is not None:
                return projection
    return None


def apply_init(model: nn.Module, cfg) -> None:
    """``--init-scheme`` on the freshly built model, then every selected method's post-init, in method order."""
    INIT_SCHEMES[cfg.init_scheme].apply(model, cfg)
    for method in METHODS.values():
        if method.post_init is not None and method.selected(cfg):
            method.post_init(model, cfg)


def embedding_schemes() -> tuple:
    """The init schemes that re-initialise the word-embedding matrix itself."""
    return tuple(name for name, scheme in INIT_SCHEMES.items() if scheme.embeddings)


def cross_attention_layer_types() -> tuple:
    """The decoder layer types that need an encoder (refused for a decoder-only model)."""
    return tuple(name for name, layer_type in LAYER_TYPES.items() if layer_type.needs_cross_attention)
