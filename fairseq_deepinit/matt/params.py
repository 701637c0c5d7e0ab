"""Parameter counts of standard and MAtt decoder layers and whole models, in closed form.

Zhang, Titov & Sennrich 2019 report 72.3M -> 66.0M parameters for WMT14 En-De base (section 5.1,
"9% fewer"); :func:`paper_param_relation` solves the vocabulary from the baseline's count and shows
that the figure needs the released code's shared W_v. docs/matt.md has the derivation.
"""

from __future__ import annotations

import math
from typing import Dict


def norm_params(norm_type: str, d: int) -> int:
    """Parameters of one ``--norm-type`` norm of width d (:mod:`fairseq_deepinit.modules.norms`)."""
    return {"layernorm": 2 * d, "rmsnorm": d, "scalenorm": 1, "none": 0}[norm_type]


def standard_decoder_layer_params(d: int, ffn: int, d_enc: int | None = None, norm_type: str = "layernorm") -> int:
    """fairseq's decoder layer: self-attention 4(d^2+d), cross-attention 2d^2 + 2 d d_enc + 4d,
    FFN 2 d ffn + ffn + d, three norms."""
    d_enc = d if d_enc is None else d_enc
    return (
        (4 * d * d + 4 * d)
        + (2 * d * d + 2 * d * d_enc + 4 * d)
        + (2 * d * ffn + ffn + d)
        + 3 * norm_params(norm_type, d)
    )


def matt_decoder_layer_params(
    d: int,
    ffn: int,
    d_enc: int | None = None,
    self_branch: str = "aan",
    share_v: bool = True,
    norm_type: str = "layernorm",
) -> int:
    """A MAtt decoder layer: cross-attention (whose out_proj is the shared W_o), FFN, two norms, and
    the self branch: W_v (d^2 + d, none when shared); ``gated-aan`` adds the gate 4d^2 + 2d;
    ``self-attn`` has q and k (2d^2 + 2d) and W_v, its output projection being W_o."""
    d_enc = d if d_enc is None else d_enc
    w_v = 0 if share_v else d * d + d
    branch = {"aan": w_v, "gated-aan": w_v + 4 * d * d + 2 * d, "self-attn": 2 * d * d + 2 * d + w_v}[self_branch]
    return branch + (2 * d * d + 2 * d * d_enc + 4 * d) + (2 * d * ffn + ffn + d) + 2 * norm_params(norm_type, d)


def encoder_layer_params(d: int, ffn: int, norm_type: str = "layernorm") -> int:
    return (4 * d * d + 4 * d) + (2 * d * ffn + ffn + d) + 2 * norm_params(norm_type, d)


def transformer_params(
    vocab: int,
    d: int,
    ffn: int,
    layers: int,
    decoder_layer_type: str = "standard",
    embeddings: str = "shared-all",
    final_norms: bool = False,
    norm_type: str = "layernorm",
    **matt_kwargs,
) -> int:
    """Parameters of an encoder-decoder Transformer with sinusoidal positions and a tied output layer.

    ``embeddings``: ``shared-all`` (one V x d matrix for source, target and output layer),
    ``tied-target`` (source and target matrices of V rows each, output tied to the target) or
    ``untied`` (three). ``final_norms``: the Pre-LN stacks' final norms.
    """
    emb = {"shared-all": 1, "tied-target": 2, "untied": 3}[embeddings] * vocab * d
    dec = (
        matt_decoder_layer_params(d, ffn, norm_type=norm_type, **matt_kwargs)
        if decoder_layer_type == "matt"
        else standard_decoder_layer_params(d, ffn, norm_type=norm_type)
    )
    final = 2 * norm_params(norm_type, d) if final_norms else 0
    return emb + layers * (encoder_layer_params(d, ffn, norm_type) + dec) + final


def vocab_for_total(total: float, d: int, ffn: int, layers: int, embeddings: str = "shared-all") -> float:
    """The vocabulary size V at which the standard model has ``total`` parameters."""
    rest = transformer_params(0, d, ffn, layers)
    per_row = {"shared-all": 1, "tied-target": 2, "untied": 3}[embeddings] * d
    return (total - rest) / per_row


def paper_param_relation(total_baseline: float = 72.3e6) -> Dict[str, float]:
    """WMT14 En-De base 6L (d=512, FFN 2048): the baseline's 72.3M and what MAtt gives.

    The vocabulary is not in the paper; it is solved from the baseline's count for each embedding
    layout. The MAtt difference does not depend on it: 6 (3d^2 + 5d) = 4.73M fewer parameters with
    a separate W_v, 6 (4d^2 + 6d) = 6.31M fewer with the released code's shared W_v.
    """
    d, ffn, n = 512, 2048, 6
    out: Dict[str, float] = {}
    for layout in ("shared-all", "tied-target", "untied"):
        out[f"vocab_{layout}"] = vocab_for_total(total_baseline, d, ffn, n, layout)
    v = math.floor(out["vocab_shared-all"])
    out["baseline"] = transformer_params(v, d, ffn, n)
    out["matt"] = transformer_params(v, d, ffn, n, "matt", share_v=False)
    out["matt_shared_v"] = transformer_params(v, d, ffn, n, "matt", share_v=True)
    return out
