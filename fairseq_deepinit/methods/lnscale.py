"""LayerNorm Scaling, LNS (Sun et al. 2025, "The Curse of Depth in Large Language Models"):
``--layernorm-scaling``, Pre-LN only; and the released runs' initialisation, ``--init-scheme normal`` /
``normal-scaled``.

Each Pre-LN sub-layer's norm output is multiplied by ``1/sqrt(l)``, l the layer's depth counted from 1;
the stack's final norm is not scaled::

    h = x + Attn(N1(x) / sqrt(l));   out = h + FFN(N2(h) / sqrt(l))

Released code: lmsdss/LayerNorm-Scaling @ 3ac54dd ``peft_pretraining/modeling_llama.py:427-454``
(``scale_factor = 1 / math.sqrt(self.layer_index + 1)`` at 432 and 449, ``layer_index`` from
``range(num_hidden_layers)`` at 967; the final ``self.norm``, 968 and 1116, unscaled); OLMo-core's
``LayerNormScaledTransformerBlock`` (``src/olmo_core/nn/transformer/block.py:232-290``) is the same rule.
The factor is the layer's ``input_scale`` (a plain float, set by :func:`setup_lns_layer` from
``layer.layer_idx``), applied in :func:`~fairseq_deepinit.modules.sublayer.sublayer_input` as one
multiplication of the norm's output by a Python float, as the released line ``scale_factor *
hidden_states`` does (layer 1's factor is 1: nothing is computed). Folding the factor into the norm's
affine (``N_{s w, s b}``) would give the same function in exact arithmetic but other roundings and
another parametrisation (gradients of the norm's gain), so it is not done.

The snapshot's string test does not reach its LNS branch: both ``__init__`` (265, 292) and ``forward``
(403, 427) lower-case ``NORM_TYPE`` and then compare with ``'LNS'``; the README's ``bash run_130m.sh LNS``
therefore builds layers without norms whose forward returns its input (no branch matches). The plugin
implements the branch's lines (the paper's rule, and OLMo-core's), not that fall-through.

Encoder-decoder translation is this project's extension: l counts from 1 in each stack, every pre-norm
of a decoder layer (self-attention, cross-attention, FFN) takes the layer's factor, the stacks' final
norms none.

Initialisation of the released runs (``_init_weights``, modeling_llama.py:857-878): every ``nn.Linear``
and ``nn.Embedding`` N(0, 0.02) (``initializer_range`` of every config, 9M to 7B), biases zero, the
padding row zero, no depth scaling: ``--init-scheme normal``. ``NORM_TYPE=scale_pre`` marks o_proj and
down_proj (``is_scaled_layer``, 159-160, 191-192) for N(0, 0.02 / sqrt(2 L)), the "Scaled Initialization"
the README ("A Quick Word Before You Start", line 41) and the paper's footnote 1 say diminishes LNS:
``--init-scheme normal-scaled`` (self-attention and cross-attention out_proj and fc2, L the layers of the
stack). LNS with a depth-scaled init is allowed and logged as a warning (the record's ``cautions``, as with
Sub-LN's or NormFormer's norms inside the branches, which renormalise what the scaled norm output produced).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..modules.stacks import iter_layers
from .exporting import folds
from .record import DEPTH_SCALED, INIT, TAG, InitScheme, Method, Option, Rule, a_norm, pre_ln

INIT_STD = 0.02  # configs/llama_*.json "initializer_range"


def lns_factor(index: int) -> float:
    """``1/sqrt(l)`` for the layer of depth ``index`` (from 1); modeling_llama.py:432 with l = layer_index + 1."""
    return 1 / math.sqrt(index)


def setup_lns_layer(layer: nn.Module, p, spec) -> None:
    """Layer set-up: the layer's ``input_scale`` (every Pre-LN norm output of the layer times it)."""
    layer.input_scale = lns_factor(layer.layer_idx)


@torch.no_grad()
def normal_init(model: nn.Module, spec, embed_std: float = INIT_STD, scaled: bool = False) -> None:
    """modeling_llama.py:857-878 (``_init_weights``) on every module of the model, in module order: each
    ``nn.Linear`` N(0, 0.02) with a zero bias (``scaled``: out_proj and fc2 N(0, 0.02 / sqrt(2 L)), L the
    layers of the layer's stack), each ``nn.Embedding`` (words, learned positions) N(0, ``embed_std``) with
    a zero padding row. An output projection tied to the word embedding keeps the embedding's draw. Norms
    keep their ones and zeros."""
    scaled_std = {}
    if scaled:
        for stack, _l, layer in iter_layers(model):
            for linear in [a.out_proj for a in layer.attention_modules()] + [layer.fc2]:
                scaled_std[id(linear)] = INIT_STD / math.sqrt(2 * spec.layers(stack))
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in embedding_weights:
            m.weight.normal_(mean=0.0, std=scaled_std.get(id(m), INIT_STD))
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.Embedding):
            m.weight.normal_(mean=0.0, std=embed_std)
            if m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()


METHOD = Method(
    name="lnscale",
    title="LayerNorm Scaling",
    paper="Sun et al. 2025 (The Curse of Depth in Large Language Models)",
    summary="Pre-LN with each norm output times 1/sqrt(l), l the layer's depth; final norm unscaled; the released "
    "N(0, 0.02) init (`normal`) and its depth-scaled variant (`normal-scaled`)",
    code="lmsdss/LayerNorm-Scaling @ 3ac54dd peft_pretraining/modeling_llama.py:427-454,857-878",
    enabled_by="layernorm_scaling",
    options=(
        Option(
            "layernorm_scaling",
            bool,
            False,
            "LayerNorm Scaling (Sun et al. 2025): every Pre-LN norm output of layer l times 1/sqrt(l), l from 1 per "
            "stack; the final norm unscaled (docs/schemes.md)",
        ),
    ),
    init_schemes=(
        InitScheme(
            "normal",
            lambda model, p, spec: normal_init(model, spec),
            "N(0, 0.02) for every Linear and embedding, zero biases (the LNS and Mix-LN releases, HF LLaMA)",
            embeddings=True,
        ),
        InitScheme(
            "normal-scaled",
            lambda model, p, spec: normal_init(model, spec, scaled=True),
            "normal, with out_proj and fc2 N(0, 0.02/sqrt(2L)) (the LNS release's scale_pre, OLMo-style)",
            embeddings=True,
            depth_scaled="normal-scaled draws out_proj and fc2 with 0.02/sqrt(2L) (the README's Scaled Initialization)",
        ),
    ),
    requires=(
        a_norm("scales each Pre-LN norm's output"),
        pre_ln("under Post-LN it would scale the residual stream itself; OLMo-core scales the pre-norm only"),
    ),
    excludes=(
        Rule(TAG, ("post-ln-layers",), "its 1/sqrt(l) scales the pre-norm of every layer"),
        Rule(TAG, ("branch-depth-scale",), "two depth scalings of every branch"),
    ),
    cautions=(
        Rule(
            INIT,
            (DEPTH_SCALED,),
            "the LNS authors found that depth-scaled initialisation diminishes LNS's effect and recommend plain "
            "normal init (--init-scheme normal, or xavier/fairseq)",
        ),
        Rule(TAG, ("branch-norm",), "its norms inside each branch undo the branch input's scale"),
    ),
    tags={"branch-depth-scale": ()},
    describe=lambda p: "layernorm-scaling=1/sqrt(l)",
    layer_setup=setup_lns_layer,
    export=folds("LayerNorm Scaling's 1/sqrt(l) (into each pre-norm's gain and bias)", "input-scale"),
    families={
        "lnscale": dict(init_scheme="xavier", layernorm_scaling=True, norm_placement="pre"),
    },
)
