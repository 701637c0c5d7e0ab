"""One residual sub-layer: where the norm sits relative to the branch and the residual sum.

Every sub-layer of every layer (self-attention, cross-attention, FFN, MAtt's merged attention) is::

    h   = branch(sublayer_input(placement, x, norm))      # the sub-layer's computation f
    h   = dropout(h)
    out = sublayer_output(placement, h, skip, norm, residual, layer_input)

with ``placement`` the layer's norm placement (Xu et al. 2020, eq. 1-2):

- ``"post"`` (Post-LN, fairseq's default, "v1"): ``norm(residual(dropout(f(x)), x))``;
- ``"pre"`` (Pre-LN, tensor2tensor, "v2"): ``residual(dropout(f(norm(x))), x)``.

``skip`` is the sub-layer's input ``x`` (NormFormer's ResScale multiplies it first), ``residual`` the
sub-layer's residual module (:mod:`.residual`: the plain sum or its scaled forms). The placement is a
value per layer (``layer.placement``), so that a stack may mix them.
"""

from __future__ import annotations

import torch
import torch.nn as nn

PLACEMENTS = ("post", "pre")


def check_placement(placement: str) -> str:
    """``placement`` if it is one this module computes."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown norm placement {placement!r}; choose from {', '.join(PLACEMENTS)}")
    return placement


def sublayer_input(placement: str, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """What the branch reads: ``norm(x)`` under Pre-LN, ``x`` itself under Post-LN."""
    return norm(x) if placement == "pre" else x


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
