"""What the observing hooks on a model share: the ``q`` and ``k`` an attention module forms
(:func:`project_qk`), and a hooked call's arguments by name (:func:`bound_arguments`).

The depth diagnostics (:mod:`fairseq_deepinit.diagnostics.depth_hooks`) and QK-Clip
(:mod:`fairseq_deepinit.training.qk_clip`) both recompute an attention's scores from the inputs a forward
pre-hook sees, because neither fairseq's fused path (``F.multi_head_attention_forward``) nor
``F.scaled_dot_product_attention`` exposes them.
"""

from __future__ import annotations

import inspect
from typing import Dict, Tuple

import torch.nn as nn
from fairseq.modules.multihead_attention import MultiheadAttention
from torch import Tensor


def project_qk(attn: MultiheadAttention, query: Tensor, key: Tensor | None) -> Tuple[Tensor, Tensor]:
    """``(q * scaling, k)`` as fairseq's explicit attention path forms them
    (fairseq/modules/multihead_attention.py:575-602): keys from the query for self-attention, else from
    ``key``. A module with its own ``project_qk`` (a method) is asked instead."""
    own = getattr(attn, "project_qk", None)
    if callable(own):
        return own(query, key)
    q = attn.q_proj(query) * attn.scaling
    k = attn.k_proj(query if attn.self_attention or key is None else key)
    return q, k


# one signature per module class: the hooks run on every forward
_SIGNATURES: Dict[type, inspect.Signature] = {}


def bound_arguments(module: nn.Module, args: tuple, kwargs: dict) -> Dict[str, object]:
    """The arguments of a call of ``module.forward`` by name, as a ``with_kwargs`` forward pre-hook gets them
    positionally and by keyword (Python's :meth:`inspect.Signature.bind`)."""
    cls = type(module)
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = inspect.signature(cls.forward)
    bound = _SIGNATURES[cls].bind(module, *args, **kwargs)
    return bound.arguments
