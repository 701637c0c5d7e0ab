"""Merged attention (MAtt), Zhang, Titov & Sennrich 2019: the layer and its parameter counts.

- :mod:`.layer`: the layer (SAAN + cross-attention through one shared W_o, then the FFN) and its
  average branch with O(1) incremental state;
- :mod:`.params`: parameter counts in closed form and the paper's 72.3M -> 66.0M.

The method's record (``--decoder-layer-type matt``, ``--matt-*``, the ``matt_<size>`` and
``dsinit_matt_<size>`` architectures) is :mod:`fairseq_deepinit.methods.matt`.
"""

from .layer import SELF_BRANCHES, AverageBranch, MAttDecoderLayer, SharedOutputProjection
from .params import (
    encoder_layer_params,
    matt_decoder_layer_params,
    norm_params,
    paper_param_relation,
    standard_decoder_layer_params,
    transformer_params,
    vocab_for_total,
)

__all__ = [
    "SELF_BRANCHES",
    "AverageBranch",
    "MAttDecoderLayer",
    "SharedOutputProjection",
    "encoder_layer_params",
    "matt_decoder_layer_params",
    "norm_params",
    "paper_param_relation",
    "standard_decoder_layer_params",
    "transformer_params",
    "vocab_for_total",
]
