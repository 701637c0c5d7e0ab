"""Lipschitz-constrained initialisation (Xu et al. 2020, "Lipschitz Constrained Parameter
Initialization for Deep Transformers", sec. 4).

Every weight with more than one dimension ~ U(-1/sqrt(fan_in), +1/sqrt(fan_in)) (fan_in only,
independent of depth); embeddings ~ U(-sqrt(2/(V+d)), +sqrt(2/(V+d))) with a zero padding row;
biases 0; norms at their identity start. ``--lipschitz-bias-free`` also drops the biases of the
q/k/v/out projections and of fc2, as the released code does ("ease_optimization").
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .base import SchemeSpec, register_scheme
from .baseline import zero_bias


def lipschitz_bound(fan_in: int) -> float:
    return 1.0 / math.sqrt(fan_in)


def embedding_bound(num_embeddings: int, dim: int) -> float:
    return math.sqrt(2.0 / (num_embeddings + dim))


@torch.no_grad()
def apply_lipschitz(model: nn.Module, cfg) -> None:
    seen = set()
    # word embeddings (V x d); learned positional embeddings keep fairseq's init, the paper has
    # sinusoidal positions and gives no rule for them
    for stack in ("encoder", "decoder"):
        if getattr(model, stack, None) is None:
            continue  # a decoder-only language model has no encoder
        emb = getattr(model, stack).embed_tokens
        if id(emb.weight) in seen:
            continue  # shared embeddings are initialised once
        seen.add(id(emb.weight))
        b = embedding_bound(emb.num_embeddings, emb.embedding_dim)
        nn.init.uniform_(emb.weight, -b, b)
        if emb.padding_idx is not None:
            emb.weight[emb.padding_idx].zero_()
    for m in model.modules():
        if isinstance(m, nn.Linear):
            if id(m.weight) in seen:
                continue  # a tied output projection is the embedding
            seen.add(id(m.weight))
            b = lipschitz_bound(m.in_features)
            nn.init.uniform_(m.weight, -b, b)
            zero_bias(m)


register_scheme(
    SchemeSpec(
        "lipschitz",
        apply_lipschitz,
        "Lipschitz-constrained init (Xu et al. 2020): U(+-1/sqrt(fan_in)); "
        "--lipschitz-bias-free for the released variant",
    )
)
