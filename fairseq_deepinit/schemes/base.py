"""The registry of initialisation schemes (``--init-scheme``) and what the schemes share.

Each scheme is a :class:`SchemeSpec`: a function that re-initialises a freshly built model in
place, plus what the scheme needs from the other axes (norm type, residual scaling, Post-LN).
Every scheme except ``fairseq`` starts from the fairseq 0.8/0.9 baseline the papers used
(:func:`~fairseq_deepinit.schemes.baseline.apply_baseline`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Tuple

import torch.nn as nn

from ..modules.norms import NORM_TYPES

WITH_NORM = tuple(n for n in NORM_TYPES if n != "none")


@dataclass(frozen=True)
class SchemeSpec:
    name: str
    apply: Callable[[nn.Module, object], None]
    doc: str
    default_norm: str = "layernorm"
    allowed_norms: Tuple[str, ...] = NORM_TYPES
    norm_reason: str = ""
    residual: str = "none"
    needs_post_ln: bool = False


SCHEMES: Dict[str, SchemeSpec] = {}


def register_scheme(spec: SchemeSpec) -> SchemeSpec:
    if spec.name in SCHEMES:
        raise ValueError(f"init scheme {spec.name!r} is already registered")
    SCHEMES[spec.name] = spec
    return spec


def iter_layers(model: nn.Module) -> Iterator[Tuple[str, int, nn.Module]]:
    """``(stack, l, layer)`` for every layer, l counted from 1 separately per stack.

    A stack the model does not have is skipped (a decoder-only language model has no encoder).
    """
    for stack in ("encoder", "decoder"):
        module = getattr(model, stack, None)
        if module is None:
            continue
        for i, layer in enumerate(module.layers, start=1):
            yield stack, i, layer


def own_value_projections(layer: nn.Module) -> list:
    """Value projections that are not inside a fairseq attention module: MAtt's own W_v.

    MAtt's average branch (Zhang et al. 2019, merged attention) computes ``x W_v`` like an attention's value
    projection, so schemes that treat v_proj specially (T-Fixup, DeepNorm, SmallInit) treat it alike.
    With ``--matt-share-v`` W_v is the cross-attention's v_proj and is reached through it instead.
    """
    branch = getattr(layer, "self_branch", None)
    v = getattr(branch, "v_proj", None)
    return [v] if isinstance(v, nn.Linear) and not hasattr(branch, "q_proj") else []


# run after the init scheme, in registration order: fn(model, cfg), each checking cfg for its own
# option (Sub-LN's init gain, B2T's rescaling: factors on top of whatever the scheme set)
POST_INIT_HOOKS: List[Callable[[nn.Module, object], None]] = []


def register_post_init_hook(hook: Callable[[nn.Module, object], None]) -> None:
    POST_INIT_HOOKS.append(hook)


def apply_init_scheme(model: nn.Module, cfg) -> None:
    SCHEMES[cfg.init_scheme].apply(model, cfg)
    for hook in POST_INIT_HOOKS:
        hook(model, cfg)
