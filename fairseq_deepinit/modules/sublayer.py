"""One residual sub-layer: where the norm sits relative to the branch and the residual sum.

Every sub-layer of every layer (self-attention, cross-attention, FFN, MAtt's merged attention) is::

    x_in, skip = residual.enter(x)                        # (x, x); on n streams (.hyper): their mix, the rest
    h   = branch(sublayer_input(placement, x_in, norm))   # the sub-layer's computation f
    h   = dropout(h)
    out = sublayer_output(placement, h, skip, norm, residual, layer_input)

with ``placement`` the layer's norm placement (Xu et al. 2020, eq. 1-2):

- ``"post"`` (Post-LN, fairseq's default, "v1"): ``norm(residual(dropout(f(x)), x))``;
- ``"pre"`` (Pre-LN, tensor2tensor, "v2"): ``residual(dropout(f(norm(x))), x)``;
- ``"peri"`` (Peri-LN, Kim et al. 2025; Sandwich-LN): ``residual(dropout(out_norm(f(norm(x)))), x)``,
  OLMo-core ``PeriNormTransformerBlock`` (``src/olmo_core/nn/transformer/block.py:312-373``, commit fa6c501);
- ``"reordered"`` (OLMo 2): ``residual(dropout(norm(f(x))), x)``, OLMo-core
  ``ReorderedNormTransformerBlock`` (``block.py:293-309``).

Peri-LN's and OLMo 2's output norm sits before the dropout, as OLMo-core's ``ResidualStream`` applies
the dropout to the normalised branch (``src/olmo_core/nn/residual_stream.py:18-19``): the layers call
:func:`branch_output` between the branch and its dropout.

``skip`` is the sub-layer's input ``x`` (NormFormer's ResScale multiplies it first), ``residual`` the
sub-layer's residual module (:mod:`.residual`: the plain sum or its scaled forms). The placement is a
value per layer (``layer.placement``), so that a stack may mix them.
"""

from __future__ import annotations

import torch
import torch.nn as nn

PLACEMENTS = ("post", "pre", "peri", "reordered")


def check_placement(placement: str) -> str:
    """``placement`` if it is one this module computes."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown norm placement {placement!r}; choose from {', '.join(PLACEMENTS)}")
    return placement


def sublayer_input(placement: str, x: torch.Tensor, norm: nn.Module, scale: float = 1.0) -> torch.Tensor:
    """What the branch reads: ``norm(x)`` under Pre-LN and Peri-LN, ``x`` itself otherwise.

    ``scale`` multiplies the input norm's output (the layer's ``input_scale``, a plain float: LayerNorm
    Scaling's ``1/sqrt(l)``); at 1.0 no multiplication is computed (``h * 1.0`` is ``h`` bit for bit).
    """
    if placement not in ("pre", "peri"):
        return x
    h = norm(x)
    return h if scale == 1.0 else h * scale


def branch_output(placement: str, h: torch.Tensor, norm: nn.Module, out_norm: nn.Module | None) -> torch.Tensor:
    """The branch's output before its dropout: ``out_norm(h)`` under Peri-LN (its own output norm),
    ``norm(h)`` under the reordered placement (the sub-layer's one norm), ``h`` under Post-/Pre-LN."""
    if placement == "peri":
        return out_norm(h)
    if placement == "reordered":
        return norm(h)
    return h


def sublayer_output(
    placement: str,
    branch: torch.Tensor,
    skip: torch.Tensor,
    norm: nn.Module,
    residual: nn.Module,
    layer_input: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual(branch, skip)`` (a residual that reads the layer's input gets it too), then ``norm``
    under Post-LN. ``branch`` is the dropped-out branch output."""
    if residual.reads_layer_input:
        out = residual(branch, skip, layer_input)
    else:
        out = residual(branch, skip)
    return norm(out) if placement == "post" else out
