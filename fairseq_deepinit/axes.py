"""The model's axes: the options no method owns.

``--init-scheme``, ``--residual-scale`` and ``--decoder-layer-type`` choose among the values the records
add (:data:`~fairseq_deepinit.methods.INIT_SCHEMES`, :data:`~fairseq_deepinit.methods.RESIDUAL_SCALINGS`,
:data:`~fairseq_deepinit.methods.LAYER_TYPES`); ``--norm-type`` / ``--norm-eps`` pick the norm of every norm
layer; ``--force-norm-with-scheme`` lets an ablation keep a norm its scheme removes; ``--attention-impl``
picks the attention's kernel path. :func:`all_options` lists these options, then every record's, in method
order. :func:`norm_export` is what an exporter needs to know about each ``--norm-type``
(:class:`~fairseq_deepinit.methods.exporting.Export`): the plain norms' declarations are
:data:`NORM_EXPORTS`, a point-wise norm's is its method's.
"""

from __future__ import annotations

import math
from typing import List, Tuple

from .methods import INIT_SCHEMES, LAYER_TYPES, METHODS, RESIDUAL_SCALINGS
from .methods.exporting import FAIRSEQ, Export
from .methods.record import Method, Option
from .modules.attention import ATTENTION_IMPLS
from .modules.norms import NORM_TYPES


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


OPTIONS: Tuple[Option, ...] = (
    Option(
        "init_scheme",
        str,
        "xavier",
        f"initialisation scheme; one of: {', '.join(sorted(INIT_SCHEMES))} (default: xavier, the fairseq 0.8/0.9 "
        "baseline the papers used)",
        choices=tuple(sorted(INIT_SCHEMES)),
        metavar="SCHEME",
    ),
    Option(
        "norm_type",
        str,
        "auto",
        "normalisation layer replacing every LayerNorm (auto: what the init scheme needs; "
        "layernorm unless the scheme removes norms)",
        choices=("auto",) + NORM_TYPES,
    ),
    Option("norm_eps", float, 1e-5, "epsilon of the normalisation layers (default 1e-5)", check=_norm_eps_problem),
    Option(
        "residual_scale",
        str,
        "auto",
        "residual-branch scaling (auto: what the init scheme needs, none otherwise)",
        choices=("auto",) + tuple(sorted(RESIDUAL_SCALINGS)),
    ),
    Option(
        "decoder_layer_type",
        str,
        "standard",
        "decoder layer implementation (default: standard)",
        choices=tuple(sorted(LAYER_TYPES)),
    ),
    Option(
        "force_norm_with_scheme",
        bool,
        False,
        "allow a --norm-type that the init scheme normally removes (e.g. LayerNorm under t-fixup); for ablations only",
        resume=False,  # a permission, not a property of the model (the resolved --norm-type is checked)
    ),
    Option(
        "attention_impl",
        str,
        "fairseq",
        "multi-head attention implementation: fairseq (its own bmm/softmax path, default) or sdpa "
        "(torch.nn.functional.scaled_dot_product_attention: flash / memory-efficient kernels on GPU; same "
        "parameters and checkpoints, outputs equal to float round-off)",
        choices=ATTENTION_IMPLS,
        resume=False,  # same parameters and checkpoints: a resumed run may switch
    ),
)
AXES = {o.name: o for o in OPTIONS}


def all_options() -> List[Tuple[Option, Method | None]]:
    """Every option of the model: the axes' (method None), then each record's, in method order."""
    out: List[Tuple[Option, Method | None]] = [(o, None) for o in OPTIONS]
    seen = set(AXES)
    for method in METHODS.values():
        for option in method.options:
            if option.name in seen:
                raise ValueError(f"option {option.name!r} is defined twice")
            seen.add(option.name)
            out.append((option, method))
    return out


#: fairseq's LayerNorm eps (fairseq/modules/layer_norm.py: ``eps=1e-5``), which a stock transformer cannot change
FAIRSEQ_LN_EPS = 1e-5


def _fairseq_layernorm(p, spec, args) -> str | None:
    if float(spec.norm.eps) != FAIRSEQ_LN_EPS:
        return f"--norm-eps {spec.norm.eps:g}: fairseq's LayerNorm has eps 1e-5 and no option to change it"
    return None


def _not_layernorm(what: str) -> Export:
    return Export(refuses={FAIRSEQ: f"{what}: a stock fairseq transformer has LayerNorms"})


#: the plain norms for an exporter: a stock transformer has LayerNorms of eps 1e-5, CTranslate2 LayerNorm and
#: RMSNorm (ScaleNorm ``g x / sqrt(||x||^2 + eps^2)`` is the RMSNorm of weight ``g / sqrt(d)`` and eps
#: ``eps^2 / d``; the zero-centred RMSNorm ``(1 + w)`` is the RMSNorm of weight ``1 + w``; no norm at all is an
#: RMSNorm made the identity, :data:`fairseq_deepinit.export.route.IDENTITY_EPS`)
NORM_EXPORTS = {
    "layernorm": Export(refuses={FAIRSEQ: _fairseq_layernorm}),
    "rmsnorm": _not_layernorm("--norm-type rmsnorm"),
    "scalenorm": Export(refuses=_not_layernorm("--norm-type scalenorm").refuses, steps=("scalenorm-as-rms",)),
    "zc-rmsnorm": Export(refuses=_not_layernorm("--norm-type zc-rmsnorm").refuses, steps=("zero-centred-gain",)),
    "none": _not_layernorm("no norm at all"),
}


def norm_export(norm: str) -> Export | None:
    """What an exporter needs to know about ``--norm-type norm``: :data:`NORM_EXPORTS`, or the declaration of the
    method that the value turns on (DyT, Derf); None where nobody declared it."""
    if norm in NORM_EXPORTS:
        return NORM_EXPORTS[norm]
    owners = [m for m in METHODS.values() if ("norm_type", norm) in m.switches]
    return owners[0].export if owners else None
