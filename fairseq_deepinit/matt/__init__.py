"""Merged attention (MAtt), Zhang, Titov & Sennrich 2019: the ``matt`` decoder layer type.

- :mod:`.layer`: the layer (SAAN + cross-attention through one shared W_o, then the FFN) and its
  average branch with O(1) incremental state;
- :mod:`.options`: ``--matt-self-branch``, ``--matt-share-v`` and their validation;
- :mod:`.params`: parameter counts in closed form and the paper's 72.3M -> 66.0M;
- :mod:`.architectures`: ``dsinit_matt_<size>``, ``matt_<size>``, ``dsinit_matt_iwslt_de_en_12l``.

Importing the package registers the layer type, its options and the architectures.
"""

from . import architectures, options  # noqa: F401  (registration)
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
