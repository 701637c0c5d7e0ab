"""B2T connection (Takase et al. 2022, "B2T Connection: Serving Stability and Performance in Deep
Transformers", Findings of ACL 2023): ``--residual-scale b2t``, Post-LN only.

Each Post-LN layer keeps its residuals and norms and adds one more path, from the layer's input to
its last norm (eq. (5)-(6) of the paper)::

    encoder: h = LN(x + SA(x));                      y = LN(h + FFN(h) + x)
    decoder: h = LN(x + SA(x)); g = LN(h + CA(h));  y = LN(g + FFN(g) + x)

The residual module is :class:`~fairseq_deepinit.modules.residual.B2TResidual` (the layer hands it its
input). The released code (takase/b2t_connection @ c8e2ad4, fairseq/modules/transformer_layer.py:55-57,
215-217, 401-405) also rescales, whenever the connection is on, every weight of a layer that is not a
LayerNorm's by ``L^(-1/2)`` (L = layers of the stack) after the layer is built: ``--b2t-init-rescale
released`` (default) does the same after the init scheme, ``none`` leaves the scheme's init. Its base
init is fairseq's own (nn.Linear's default for fc1/fc2, xavier with gain 1/sqrt(2) on q/k/v): the
``b2t_*`` architectures use ``--init-scheme fairseq`` for that reason.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..modules.residual import B2TResidual
from ..modules.stacks import iter_layers
from .exporting import EXPORT_NEUTRAL, never
from .record import Method, Option, ResidualScaling, a_norm, post_ln


@torch.no_grad()
def rescale_b2t_init(model: nn.Module, p, spec) -> None:
    """transformer_layer.py:401-405: ``p *= L^(-1/2)`` for every layer parameter named ``*weight*``
    whose name has no ``layer_norm`` (the released rule, applied to the plugin's parameter names)."""
    if p.b2t_init_rescale != "released":
        return
    for stack, _l, layer in iter_layers(model):
        scaling = spec.layers(stack) ** -0.5
        for name, weight in layer.named_parameters():
            if "layer_norm" not in name and "weight" in name:
                weight.mul_(scaling)


METHOD = Method(
    name="b2t",
    title="B2T connection",
    paper="Takase et al. 2022, eq. (5)-(6)",
    summary="Post-LN plus the layer's input added before its last norm; the released L^-1/2 weight rescaling",
    code="takase/b2t_connection @ c8e2ad4 fairseq/modules/transformer_layer.py:103-144,277-375,401-405",
    enabled_by="residual_scale=b2t",
    options=(
        Option(
            "b2t_init_rescale",
            str,
            "released",
            "b2t: multiply every non-norm weight of each layer by L^(-1/2) after the init scheme, as the "
            "released code does (released, default), or not (none)",
            choices=("released", "none"),
        ),
    ),
    residual_scalings=(
        # the FFN is the last sub-layer of every encoder and decoder layer
        ResidualScaling(
            "b2t",
            lambda stack, sublayer, p: B2TResidual(top=sublayer == "ffn"),
            "x + f(x), plus the layer's input on its last sub-layer",
            requires=(post_ln(), a_norm("adds the layer input before the layer's last norm and needs that norm")),
            export=never(
                "--residual-scale b2t adds each layer's input before its last norm, a third residual path neither "
                "target has"
            ),
        ),
    ),
    describe=lambda p: f"b2t-init-rescale={p.b2t_init_rescale}",
    post_init=rescale_b2t_init,
    export=EXPORT_NEUTRAL,  # its init rescale; the residual scaling is what no target carries
    families={"b2t": dict(init_scheme="fairseq", residual_scale="b2t")},
)
