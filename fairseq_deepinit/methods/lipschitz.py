"""Lipschitz-constrained initialisation (Xu et al. 2020, "Lipschitz Constrained Parameter
Initialization for Deep Transformers", sec. 4): ``--init-scheme lipschitz [--lipschitz-bias-free]``.

Every weight with more than one dimension ~ U(-1/sqrt(fan_in), +1/sqrt(fan_in)) (fan_in only,
independent of depth); embeddings ~ U(-sqrt(2/(V+d)), +sqrt(2/(V+d))) with a zero padding row;
biases 0; norms at their identity start. ``--lipschitz-bias-free`` also drops the biases of the
q/k/v/out projections and of fc2, as the released code does ("ease_optimization"): the layer set-up
below, on every attention projection the layer lists
(:meth:`~fairseq_deepinit.modules.layer_base.DeepInitLayer.attention_projections`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..modules.init import zero_bias
from ..modules.linear import drop_bias
from .exporting import Export
from .record import InitScheme, Method, Option


def lipschitz_bound(fan_in: int) -> float:
    return 1.0 / math.sqrt(fan_in)


def embedding_bound(num_embeddings: int, dim: int) -> float:
    return math.sqrt(2.0 / (num_embeddings + dim))


@torch.no_grad()
def apply_lipschitz(model: nn.Module, *_unused) -> None:
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


def setup_bias_free(layer: nn.Module, p, spec) -> None:
    """Xu et al. 2020, released code ("ease_optimization"): no bias in q/k/v/out and fc2."""
    if not p.lipschitz_bias_free:
        return
    for proj in layer.attention_projections():
        drop_bias(proj)
    drop_bias(layer.fc2)


METHOD = Method(
    name="lipschitz",
    title="Lipschitz-constrained init",
    paper="Xu et al. 2020, sec. 4",
    summary="U(+-1/sqrt(fan_in)) weights, U(+-sqrt(2/(V+d))) embeddings; the released code's bias-free projections",
    code='the paper\'s released code ("ease_optimization")',
    enabled_by="init_scheme=lipschitz",
    options=(
        Option(
            "lipschitz_bias_free",
            bool,
            False,
            "lipschitz: drop the biases of q/k/v/out projections and fc2 (released code)",
        ),
    ),
    init_schemes=(
        InitScheme(
            "lipschitz",
            apply_lipschitz,
            "Lipschitz-constrained init (Xu et al. 2020): U(+-1/sqrt(fan_in)); "
            "--lipschitz-bias-free for the released variant",
            embeddings=True,
            two_matrix_ffn="the Lipschitz bound of Xu et al. 2020 (sec. 4) holds for fc2(ReLU(fc1 x)); a gated FFN "
            "multiplies two projections of x, which no bound from the weights alone makes Lipschitz",
        ),
    ),
    tags={"bias-free-projections": ("lipschitz_bias_free",)},
    describe=lambda p: "bias-free" if p.lipschitz_bias_free else "",
    layer_setup=setup_bias_free,
    # the bias-free variant keeps zero biases as buffers outside the state dict: written back, nothing to fold
    export=Export(steps=("zero-biases",)),
    families={"lipschitz": dict(init_scheme="lipschitz")},
)
