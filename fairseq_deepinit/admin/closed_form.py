"""Profiling-free Admin: omega as a closed form of the depth (admin-torch, the Admin author's package).

``--admin-formula closed-form`` sets every omega of a stack, once, when the model is built::

    O(logn) (default):  omega = sqrt((n + 1) / ln(n + 1) - 1)
    O(n):               omega = 1          (plain Post-LN)
    O(1):               omega = sqrt(n)

with n the number of residual sub-layers of the stack (released code: microsoft/admin-torch @ 08b6605,
``admin_torch/admin.py:54-81``, ``calculate_init``; its docstring, admin.py:64, counts "2n residual
layers" for an n-layer encoder, and the package's example, admin.py:125, passes one count per stack).
The plugin counts as that docstring does, per stack, the residual sub-layers its layers were built
with (``layer.residuals``, one per sub-layer of the layer's kind, :mod:`~fairseq_deepinit.modules.stacks`):
2N for the encoder (self-attention, FFN), 3M for a decoder with cross-attention (self-attention,
cross-attention, FFN), 2M for a decoder-only stack (the language model, or ``--no-cross-attention``)
and for a MAtt decoder (merged attention, FFN). The fairseq integration the package README points
to (LiyuanLucasLiu/fairseq commit 33ad76a) is not in the public snapshot available here, so the
decoder's 3M is the docstring's rule applied to three sub-layers, not read from that commit. omega
is set after the model is built (``admin/residual.py``, ``set_closed_form_omega``) and is the same
per-dimension vector as profiled Admin's (``as_parameter``, trainable
unless ``--admin-freeze-omega``, as admin-torch's example script's ``--encoder-as-parameter``), so
checkpoints, export to plain Post-LN and the diagnostics are unchanged; no profiling pass is needed.
"""

from __future__ import annotations

import math

CLOSED_FORM = "closed-form"
OUTPUT_CHANGE_SCALES = ("O(logn)", "O(n)", "O(1)")
DEFAULT_OUTPUT_CHANGE = "O(logn)"


def closed_form_omega(num_res_layers: int, output_change_scale: str = DEFAULT_OUTPUT_CHANGE) -> float:
    """admin-torch's ``calculate_init`` (admin_torch/admin.py:73-81) for ``num_res_layers`` >= 1."""
    if num_res_layers < 1:
        raise ValueError(f"closed-form Admin needs at least one residual sub-layer, got {num_res_layers}")
    if output_change_scale == "O(logn)":
        value = (num_res_layers + 1) / math.log(num_res_layers + 1) - 1
    elif output_change_scale == "O(n)":
        value = 1.0
    elif output_change_scale == "O(1)":
        value = float(num_res_layers)
    else:
        raise ValueError(f"unknown output change scale {output_change_scale!r}; choose from {OUTPUT_CHANGE_SCALES}")
    return value**0.5
