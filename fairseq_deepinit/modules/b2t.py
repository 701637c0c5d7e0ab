"""B2T connection (Takase et al. 2022, "B2T Connection: Serving Stability and Performance in Deep
Transformers", Findings of ACL 2023): ``--residual-scale b2t``, Post-LN only.

Each Post-LN layer keeps its residuals and norms and adds one more path, from the layer's input to
its last norm (eq. (5)-(6) of the paper)::

    encoder: h = LN(x + SA(x));                      y = LN(h + FFN(h) + x)
    decoder: h = LN(x + SA(x)); g = LN(h + CA(h));  y = LN(g + FFN(g) + x)

The residual module is :class:`~fairseq_deepinit.modules.residual.B2TResidual`. The released code
(takase/b2t_connection @ c8e2ad4, fairseq/modules/transformer_layer.py:55-57, 215-217, 401-405)
also rescales, whenever the connection is on, every weight of a layer that is not a LayerNorm's by
``L^(-1/2)`` (L = layers of the stack) after the layer is built: ``--b2t-init-rescale released``
(default) does the same after the init scheme, ``none`` leaves the scheme's init. Its base init is
fairseq's own (nn.Linear's default for fc1/fc2, xavier with gain 1/sqrt(2) on q/k/v): the ``b2t_*``
architectures use ``--init-scheme fairseq`` for that reason.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import options
from ..architectures import register_family
from ..errors import DeepInitConfigError
from ..schemes import iter_layers, register_post_init_hook

B2T_RESCALE = ("released", "none")
B2T_OPTIONS = {"b2t_init_rescale": "released"}


def add_b2t_args(g) -> None:
    g.add_argument(
        "--b2t-init-rescale",
        choices=B2T_RESCALE,
        help="b2t: multiply every non-norm weight of each layer by L^(-1/2) after the init scheme, as the "
        "released code does (released, default), or not (none)",
    )


def validate_b2t_args(args) -> None:
    if args.norm_type == "none":
        raise DeepInitConfigError(
            "--residual-scale b2t adds the layer input before the layer's last norm and needs that norm; "
            "--norm-type none removes it. Use --norm-type layernorm (or drop --norm-type)."
        )
    if args.b2t_init_rescale not in B2T_RESCALE:
        raise DeepInitConfigError(
            f"unknown --b2t-init-rescale {args.b2t_init_rescale!r}; choose from {', '.join(B2T_RESCALE)}"
        )


def describe_b2t(args) -> str:
    return f"b2t-init-rescale={args.b2t_init_rescale}"


@torch.no_grad()
def rescale_b2t_init(model: nn.Module, cfg) -> None:
    """transformer_layer.py:401-405: ``p *= L^(-1/2)`` for every layer parameter named ``*weight*``
    whose name has no ``layer_norm`` (the released rule, applied to the plugin's parameter names)."""
    if getattr(cfg, "residual_scale", None) != "b2t" or getattr(cfg, "b2t_init_rescale", None) != "released":
        return
    depth = {"encoder": cfg.encoder.layers, "decoder": cfg.decoder.layers}
    for stack, _l, layer in iter_layers(model):
        scaling = depth[stack] ** -0.5
        for name, p in layer.named_parameters():
            if "layer_norm" not in name and "weight" in name:
                p.mul_(scaling)


options.register_residual_options("b2t", B2T_OPTIONS, add_b2t_args, validate_b2t_args, describe_b2t)
options.POST_LN_RESIDUALS.add("b2t")
register_post_init_hook(rescale_b2t_init)
register_family("b2t", dict(init_scheme="fairseq", residual_scale="b2t"))
