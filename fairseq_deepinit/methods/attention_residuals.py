"""Attention Residuals (Kimi Team 2026, "Attention Residuals", arXiv 2603.15031): ``--attention-residuals
full|block``.

A Pre-LN stack whose sub-layers read, in place of the running residual sum, a softmax-weighted mix over depth of
the embedding output and the earlier sub-layers' outputs, weighted by one learned pseudo-query ``w_l`` per
sub-layer against the RMS-normalised sources (the ``attention-residuals`` value of ``--residual-scale``, which the
flag sets)::

    h_l = sum_{i<l} alpha_{i->l} v_i,   alpha_{i->l} = softmax_i(w_l . RMSNorm(v_i)),   v_0 = embedding, v_i = f_i(h_i)

    Full AttnRes:                   every sub-layer output is a source
    Block AttnRes (as released):    layers grouped into blocks of --attn-res-block-layers S; the sources are the
                                    embedding, the completed blocks' sums and the current block's partial sum

Released code: MoonshotAI/Attention-Residuals @ 85e2231 ``README.md:52-91`` (PyTorch-style pseudocode:
``block_attn_res`` and a layer's ``forward``, a block boundary every ``block_size // 2`` layers, the partial sum
committed after the layer's first aggregation). The blocks: :mod:`fairseq_deepinit.modules.attn_res`.

Encoder-decoder (the release is a decoder-only language model; docs/schemes.md gives the reasoning): every
sub-layer aggregates, encoder 2 per layer, decoder 3 (self-attention, cross-attention, FFN); each stack's sources
start from its own embedding output and end in one more aggregation with its own pseudo-query before the final
norm, so the cross-attention reads ``encoder_out = LN(sum_i alpha_{i->out} v_i)``, fairseq's ``(S, B, d)``.

Refused (one line): Post-LN and the other placements, no norm (T-Fixup), any other ``--residual-scale``
(hyper-connections, DeepNorm, Admin, ReZero, ResiDual, B2T), depth-muP and NormFormer's ResScale, Mix-LN, MAtt;
the export (a softmax over depth is no stock model).
"""

from __future__ import annotations

import torch.nn as nn

from ..modules.attn_res import AttnResResidual, DepthAttention, DepthSources
from .exporting import EXPORT_NEUTRAL, never
from .record import TAG, Method, Option, ResidualScaling, Rule, a_norm, positive, pre_ln, standard_layer

NAME = "attention-residuals"  # the --residual-scale value the flag sets
KINDS = ("none", "full", "block")
FULL, BLOCK = "attention_residuals=full", "attention_residuals=block"
# the key norm's eps: the release's RMSNorm does not give it; Kimi Linear's rms_norm_eps and the torchtitan port's
# norm_eps are 1e-5
EPS = 1e-5


def _block_layers(value) -> str | None:
    if isinstance(value, int) and value >= 1:
        return None
    return f"--attn-res-block-layers must be an integer >= 1 (layers per block), got {value}"


def build_residual(stack, sublayer: str, p) -> AttnResResidual:
    """A sub-layer's depth-wise aggregation over the stack's width (whether it opens a block: the layer set-up)."""
    return AttnResResidual(stack.dim, p.attn_res_eps)


def opens_block(p, layer_idx: int, position: int) -> bool:
    """Whether the sub-layer at ``position`` of layer ``layer_idx`` (from 1) starts a new source: every sub-layer
    under Full AttnRes; under Block AttnRes the first sub-layer of layers 1, 1 + S, 1 + 2S, ... (README.md:79-84:
    ``layer_number % (block_size // 2) == 0`` with layers numbered from 0, checked before the attention)."""
    if p.attention_residuals == "full":
        return True
    return position == 0 and (layer_idx - 1) % p.attn_res_block_layers == 0


def mark_blocks(layer: nn.Module, p, spec) -> None:
    """Layer set-up: each sub-layer's aggregation told whether it opens a block."""
    for position, residual in enumerate(layer.residuals.values()):
        if isinstance(residual, AttnResResidual):
            residual.opens_block = opens_block(p, layer.layer_idx, position)


def setup_sources(stack: nn.Module, p, spec, stack_spec) -> None:
    """Stack set-up: the embedding output as the first source, the stack's own last aggregation before its final
    norm (``attn_res_output``)."""
    stack.attn_res_output = DepthAttention(stack_spec.dim, p.attn_res_eps)
    stack.streams = DepthSources(stack.attn_res_output)


def other_kind_options(p, layers) -> dict:
    """Full AttnRes has no blocks: ``attn_res_block_layers`` is stored as None."""
    return {"attn_res_block_layers": None} if p.attention_residuals == "full" else {}


def describe(p) -> str:
    if p.attention_residuals == "block":
        return f"attn-res block layers-per-block={p.attn_res_block_layers} eps={p.attn_res_eps:g}"
    return f"attn-res full eps={p.attn_res_eps:g}"


PRE_LN = dict(init_scheme="xavier", norm_placement="pre")

METHOD = Method(
    name="attention_residuals",
    title="Attention Residuals",
    paper="Kimi Team 2026, arXiv 2603.15031 (Full and Block AttnRes; the README's formula and pseudocode)",
    summary="Pre-LN whose sub-layers read a softmax over depth (one zero-initialised pseudo-query each, RMS-normalised "
    "keys) of the embedding and the earlier sub-layers' outputs (Full) or block sums (Block), encoder 2 per layer, "
    "decoder 3 incl. cross-attention, one more aggregation before each stack's final norm",
    code="MoonshotAI/Attention-Residuals @ 85e2231 README.md:52-91",
    enabled_by=(FULL, BLOCK),
    options=(
        Option(
            "attention_residuals",
            str,
            "none",
            "attention residuals: a softmax over depth of the earlier sub-layers' outputs in place of the residual "
            "sum, Pre-LN only: full (every output a source), block (blocks of --attn-res-block-layers layers, as "
            "released), none (default)",
            choices=KINDS,
        ),
        Option(
            "attn_res_block_layers",
            int,
            2,
            "block attention residuals: layers per block S (the release's block_size // 2; default 2; the paper "
            "recommends about 8 blocks per stack)",
            metavar="S",
            check=_block_layers,
            only_with=BLOCK,
        ),
        Option(
            "attn_res_eps",
            float,
            EPS,
            "attention residuals: epsilon of the keys' RMSNorm (default 1e-5, Kimi Linear's rms_norm_eps)",
            metavar="EPS",
            check=positive("attn-res-eps"),
        ),
    ),
    residual_scalings=(
        ResidualScaling(
            NAME,
            build_residual,
            "each sub-layer reads a softmax over depth of the earlier outputs (set by --attention-residuals)",
            export=never(
                lambda p, spec, args: (
                    f"--attention-residuals {p.attention_residuals} feeds every sub-layer a learned softmax over the "
                    "earlier sub-layers' outputs; neither target has more than one residual stream"
                )
            ),
        ),
    ),
    export=EXPORT_NEUTRAL,  # its options shape the sources, which its residual scaling declares
    sets={"residual_scale": NAME},
    requires=(
        a_norm("aggregates over Pre-LN sub-layers, which need their norms"),
        pre_ln("its released form is Pre-LN; Post-LN's LN(x + F(x)) has no residual sum to replace"),
        standard_layer("gives each of the standard layer's sub-layers its own aggregation"),
    ),
    excludes=(
        Rule(TAG, ("post-ln-layers",), "its aggregations replace Pre-LN residuals; those layers are Post-LN"),
        Rule(TAG, ("residual-scale",), "a scale of the residual, which the aggregations replace"),
    ),
    derive=other_kind_options,
    describe=describe,
    layer_setup=mark_blocks,
    stack_setup=setup_sources,
    families={
        "attnres": dict(PRE_LN, attention_residuals="full"),
        "blockattnres": dict(PRE_LN, attention_residuals="block"),
    },
)
