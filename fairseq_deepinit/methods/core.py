"""The options no single method owns: the selectors of the model's axes and the settings every model has.

``--init-scheme``, ``--residual-scale`` and ``--decoder-layer-type`` choose among the values the
methods add (their choices are filled in from the records by :mod:`fairseq_deepinit.options`);
``--norm-type`` / ``--norm-eps`` pick the norm of every norm layer; ``--force-norm-with-scheme`` lets an
ablation keep a norm its scheme removes; ``--attention-impl`` picks the attention's kernel path. The
plain residual (``--residual-scale none``) and fairseq's decoder layer (``--decoder-layer-type
standard``) are the defaults every method composes with.
"""

from __future__ import annotations

import math

from ..modules.attention import ATTENTION_IMPLS
from ..modules.layers import DeepInitDecoderLayer
from ..modules.norms import NORM_TYPES
from ..modules.residual import Residual
from .record import LayerType, Method, Option, ResidualScale


def _norm_eps_problem(eps) -> str | None:
    """``--norm-eps`` must be a finite number > 0.

    Every norm divides by ``sqrt(var + eps)`` (LayerNorm, RMSNorm) or ``sqrt(||x||^2 + eps^2)`` (ScaleNorm):
    eps <= 0 can divide by zero, ``inf`` turns every norm's output into 0 (a model that learns
    nothing, with no error), and ``nan`` makes every output NaN (fairseq only notices at the first
    update, with its generic non-finite gradient error).
    """
    if isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0:
        return None
    return (
        f"--norm-eps must be a finite number greater than 0 (default 1e-5), got {eps}; "
        "drop --norm-eps or give e.g. --norm-eps 1e-6"
    )


# the selectors' choices depend on every record: options.py fills them in
INIT_SCHEME = Option(
    "init_scheme",
    str,
    "xavier",
    "initialisation scheme (default: xavier, the fairseq 0.8/0.9 baseline the papers used)",
    metavar="SCHEME",
)
NORM_TYPE = Option(
    "norm_type",
    str,
    "auto",
    "normalisation layer replacing every LayerNorm (auto: what the init scheme needs; "
    "layernorm unless the scheme removes norms)",
    choices=("auto",) + NORM_TYPES,
)
NORM_EPS = Option(
    "norm_eps", float, 1e-5, "epsilon of the normalisation layers (default 1e-5)", check=_norm_eps_problem
)
RESIDUAL_SCALE = Option(
    "residual_scale", str, "auto", "residual-branch scaling (auto: what the init scheme needs, none otherwise)"
)
DECODER_LAYER_TYPE = Option("decoder_layer_type", str, "standard", "decoder layer implementation (default: standard)")
FORCE_NORM = Option(
    "force_norm_with_scheme",
    bool,
    False,
    "allow a --norm-type that the init scheme normally removes (e.g. LayerNorm under t-fixup); for ablations only",
    resume=False,  # a permission, not a property of the model (the resolved --norm-type is checked)
)
ATTENTION_IMPL = Option(
    "attention_impl",
    str,
    "fairseq",
    "multi-head attention implementation: fairseq (its own bmm/softmax path, default) or sdpa "
    "(torch.nn.functional.scaled_dot_product_attention: flash / memory-efficient kernels on GPU; same "
    "parameters and checkpoints, outputs equal to float round-off)",
    choices=ATTENTION_IMPLS,
    resume=False,  # same parameters and checkpoints: a resumed run may switch
)

METHOD = Method(
    name="core",
    title="the model's axes",
    paper="Vaswani et al. 2017 (fairseq's transformer)",
    summary="the selectors `--init-scheme`, `--residual-scale`, `--decoder-layer-type`; `--norm-type`, "
    "`--norm-eps`, `--attention-impl`",
    options=(INIT_SCHEME, NORM_TYPE, NORM_EPS, RESIDUAL_SCALE, DECODER_LAYER_TYPE, FORCE_NORM, ATTENTION_IMPL),
    residual_scales=(ResidualScale("none", lambda cfg, kind, sub, idx: Residual(), "x + f(x)"),),
    layer_types=(LayerType("standard", DeepInitDecoderLayer, "fairseq's decoder layer"),),
)
