"""Transformers without Tears (Nguyen & Salazar 2019): PreNorm + ScaleNorm + FixNorm + SmallInit.

- SmallInit (sec. 2.1, ``--init-scheme smallinit``): attention weights (q, k, v, out) ~ N(0, sqrt(2/(5d))),
  i.e. Xavier normal as if fan_out were 4d, which keeps the attention sub-layer small at the start;
  FFN weights Xavier normal; biases 0.
- FixNorm (sec. 2.3, after Nguyen & Chiang 2018; ``--fixnorm``): unit-norm word embeddings and a tied
  output layer over them (:mod:`fairseq_deepinit.modules.fixnorm`).
- ScaleNorm (eq. 3) is the norm type ``--norm-type scalenorm`` (:mod:`fairseq_deepinit.modules.norms`);
  PreNorm is Pre-LN. The ``twt_*`` architectures put the four together.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from fairseq.modules import MultiheadAttention

from ..modules.fixnorm import FixNormEmbedding, FixNormOutputProjection
from ..modules.init import apply_baseline, layer_linears
from ..modules.stacks import iter_layers
from .exporting import FAIRSEQ, Export
from .record import FLAG, INIT, InitScheme, Method, Option, Rule


def smallinit_std(d: int) -> float:
    return math.sqrt(2.0 / (5.0 * d))


@torch.no_grad()
def apply_smallinit(model: nn.Module, *_unused) -> None:
    apply_baseline(model)  # zero biases, as the baseline
    for _stack, _l, layer in iter_layers(model):
        for m in layer.modules():
            if isinstance(m, MultiheadAttention):
                for proj in (m.q_proj, m.k_proj, m.v_proj, m.out_proj):
                    nn.init.normal_(proj.weight, 0.0, smallinit_std(m.embed_dim))
        own_v = layer.own_value_projections()
        for lin in layer_linears(layer):
            if lin in own_v:
                nn.init.normal_(lin.weight, 0.0, smallinit_std(lin.in_features))  # MAtt's W_v: an attention weight
            else:
                nn.init.xavier_normal_(lin.weight)


def fixnorm_embedding(p, dictionary, embed_dim: int, path: str | None = None) -> nn.Module:
    """FixNorm's word embedding (U(-0.01, 0.01), rows used at unit norm)."""
    if path:
        raise ValueError("--fixnorm learns its own normalised embeddings; drop --*-embed-path")
    return FixNormEmbedding(len(dictionary), embed_dim, padding_idx=dictionary.pad())


def fixnorm_output_projection(p, embed_tokens: nn.Module) -> nn.Module:
    """The tied output layer over the normalised embeddings (TwT eq. 5)."""
    return FixNormOutputProjection(embed_tokens)


METHOD = Method(
    name="twt",
    title="Transformers without Tears",
    paper="Nguyen & Salazar 2019, sec. 2.1-2.3",
    summary="PreNorm + ScaleNorm (`--norm-type scalenorm`) + FixNorm (`--fixnorm`) + SmallInit (`smallinit`: "
    "attention N(0, sqrt(2/5d)), FFN Xavier normal)",
    code="tnq177/transformers_without_tears",
    enabled_by="fixnorm",
    options=(
        Option(
            "fixnorm",
            bool,
            False,
            "FixNorm: unit-norm word embeddings and a tied output layer over them "
            "(needs --share-decoder-input-output-embed or --share-all-embeddings)",
        ),
    ),
    init_schemes=(
        InitScheme(
            "smallinit",
            apply_smallinit,
            "SmallInit (Nguyen & Salazar 2019): attention N(0, sqrt(2/5d)), FFN Xavier normal",
        ),
    ),
    requires=(
        Rule(
            FLAG,
            ("share_decoder_input_output_embed", "share_all_embeddings"),
            "scores outputs against the normalised input embeddings",
        ),
    ),
    excludes=(
        Rule(FLAG, ("adaptive_softmax_cutoff", "adaptive_input"), "adaptive input/softmax replace what it normalises"),
        # FixNorm divides every embedding row by its norm: T-Fixup's (9N)^(-1/4) embedding scale (sec. 3.2) would go
        Rule(INIT, ("t-fixup",), "it normalises the embeddings and would undo T-Fixup's embedding scaling"),
    ),
    describe=lambda p: "fixnorm",
    embedding=fixnorm_embedding,
    output_projection=fixnorm_output_projection,
    export=Export(
        refuses={
            FAIRSEQ: "--fixnorm: its output layer adds a per-word bias, which a stock transformer's output projection "
            "lacks"
        },
        fold="FixNorm's unit-norm embedding rows",
        steps=("unit-rows",),
    ),
    families={
        # PreNorm + ScaleNorm + FixNorm + SmallInit, tied output layer
        "twt": dict(
            init_scheme="smallinit",
            norm_type="scalenorm",
            fixnorm=True,
            norm_placement="pre",
            share_decoder_input_output_embed=True,
        ),
    },
)
