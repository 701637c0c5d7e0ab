"""ResiDual (Xie et al. 2023, "ResiDual: Transformer with Dual Residual Connections", sec. 3):
``--residual-scale resi-dual``, a Post-LN stack plus a second, un-normalised stream of the sub-layers'
outputs, added back after a final norm.

As released (microsoft/ResiDual @ 8682f75, itself a fairseq user-dir plugin), for every sub-layer ``F``
of every layer (self-attention, cross-attention, FFN), with ``h = dropout(F(x))``::

    raw <- raw + s * h                 resi_dual/resi_dual_layers.py:37, 50 (encoder); 135, 163, 176 (decoder)
    x   <- LN(x + h)                   resi_dual_layers.py:39, 51; 136, 164, 177 (fairseq's Post-LN)

    raw_0 = s * x_0                    resi_dual/resi_dual.py:107 (encoder), 252 (decoder)
    y     = alpha * x_L + LN_1e-7(raw_L)   resi_dual.py:131, 283; final norm eps 1e-7: 24, 157

``x_0`` is the embedding output (after fairseq's ``embed_scale``, positions, optional
``--layernorm-embedding`` and dropout; the encoder's padding zeroed), ``s`` the released
``res_input_norm_scale`` and ``alpha`` ``enc_alpha`` / ``dec_alpha`` (``ResiDualConfig``, 294-300: both 1.0;
``hydra_config/opus.yaml:25-26``: ``s = 0.05`` for the 18+18-layer fp16 run). The blocks: the stream's
constants and steps in :mod:`~fairseq_deepinit.modules.dual_stream`, added to in the layer forwards
(:mod:`~fairseq_deepinit.modules.layers`), started and closed in the stack loops (``model.py``); the final
norm takes fairseq's ``layer_norm`` slot, as in the release, so the state-dict keys are the release's.

Options: ``--resi-dual-scale`` (s, default 1.0 as ``ResiDualConfig``; 0.05 with ``--fp16`` and deep
stacks, as opus.yaml: ``LN(s d) = LN(d)`` apart from the eps, so it only keeps the stream in fp16 range),
``--resi-dual-alpha`` (1.0), ``--resi-dual-start`` (``embedding`` as released, or ``zero``: the
``torch.zeros_like(x)`` left in a comment at lines 107 and 252) and ``--resi-dual-final-eps`` (1e-7).
Where the code and the paper's description differ, and the fairseq facts, are in docs/schemes.md.
"""

from __future__ import annotations

import math

import torch.nn as nn

from ..modules.dual_stream import STARTS, DualStream
from ..modules.norms import build_norm
from ..modules.residual import Residual
from .exporting import EXPORT_NEUTRAL, never
from .record import Method, Option, ResidualScaling, a_norm, positive, post_ln, standard_layer

NAME = "resi-dual"
FINAL_NORM_EPS = 1e-7  # resi_dual/resi_dual.py:24, 157
OPUS_SCALE = 0.05  # hydra_config/opus.yaml:25-26 (18+18 layers, fp16)
# norms with norm(s * d) = norm(d) up to their eps, which the scale relies on (a point-wise DyT is not one)
SCALE_INVARIANT_NORMS = ("layernorm", "rmsnorm", "scalenorm")


def _finite(value) -> str | None:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return None
    return f"--resi-dual-alpha must be a finite number, got {value}"


def stream(p) -> DualStream:
    """The stream's constants from the resolved options."""
    return DualStream(scale=p.resi_dual_scale, alpha=p.resi_dual_alpha, start=p.resi_dual_start)


def setup_resi_dual_layer(layer: nn.Module, p, spec) -> None:
    """Layer set-up: the stream's constants."""
    layer.dual_stream = stream(p)


def setup_resi_dual_stack(stack: nn.Module, p, spec, stack_spec) -> None:
    """Stack set-up: the stream's constants and its final norm (``resi_dual.py:24, 157``) in fairseq's
    ``layer_norm`` slot, of ``--norm-type`` with eps ``--resi-dual-final-eps``, over the layers' width."""
    stack.dual_stream = stream(p)
    stack.layer_norm = build_norm(spec.norm.type, stack_spec.dim, p.resi_dual_final_eps, spec.norm.export)


def fp16_warning(p, spec) -> str | None:
    """A warning for an unscaled stream under fp16 (the released deep fp16 run scales it)."""
    if spec.fp16 and p.resi_dual_scale == 1.0:
        return (
            f"--residual-scale {NAME} under --fp16 with --resi-dual-scale 1: the second stream sums every layer's "
            f"un-normalised outputs in fp16; the released 18+18-layer fp16 run uses --resi-dual-scale {OPUS_SCALE} "
            "(the model's function does not depend on it apart from the final norm's eps)"
        )
    return None


def describe_resi_dual(p) -> str:
    return (
        f"resi-dual-scale={p.resi_dual_scale:g}, resi-dual-alpha={p.resi_dual_alpha:g}, "
        f"resi-dual-start={p.resi_dual_start}, resi-dual-final-eps={p.resi_dual_final_eps:g}"
    )


METHOD = Method(
    name="resi_dual",
    title="ResiDual",
    paper="Xie et al. 2023, sec. 3",
    summary="Post-LN plus a second stream summing every sub-layer's dropped-out output (started from the embedding), "
    "added to the output after its own final norm",
    code="microsoft/ResiDual @ 8682f75 resi_dual/resi_dual_layers.py:25-51,116-177, resi_dual/resi_dual.py:24,"
    "107-131,157,252-283,294-300, hydra_config/opus.yaml:25-26",
    enabled_by=f"residual_scale={NAME}",
    options=(
        Option(
            "resi_dual_scale",
            float,
            1.0,
            "resi-dual: factor s of every term of the second stream (the released res_input_norm_scale; "
            f"default 1.0; {OPUS_SCALE} for deep fp16 stacks as the released opus.yaml: the function is the same "
            "apart from the final norm's eps, the stream's range s times smaller)",
            metavar="S",
            check=positive("resi-dual-scale"),
        ),
        Option(
            "resi_dual_alpha",
            float,
            1.0,
            "resi-dual: factor of the Post-LN stream in the output alpha x + norm(raw) (released enc_alpha/dec_alpha; "
            "default 1.0)",
            metavar="ALPHA",
            check=_finite,
        ),
        Option(
            "resi_dual_start",
            str,
            "embedding",
            "resi-dual: the second stream starts as s times the embedding output (embedding, default, as released) "
            "or at zero (zero, the alternative left in a comment there)",
            choices=STARTS,
        ),
        Option(
            "resi_dual_final_eps",
            float,
            FINAL_NORM_EPS,
            "resi-dual: epsilon of the second stream's final norm (default 1e-7, as released; the layers' norms "
            "keep --norm-eps)",
            metavar="EPS",
            check=positive("resi-dual-final-eps"),
        ),
    ),
    residual_scalings=(
        ResidualScaling(
            NAME,
            lambda stack, sublayer, p: Residual(),
            "LN(x + f(x)), and f(x) summed in a second stream added after a final norm (ResiDual)",
            requires=(
                post_ln(),
                a_norm(
                    "needs a norm with norm(s x) = norm(x) in its Post-LN layers and final norm", SCALE_INVARIANT_NORMS
                ),
                standard_layer("carries its second stream through the standard layers"),
            ),
            export=never(
                "--residual-scale resi-dual carries a second, un-normalised stream through every layer, which "
                "neither target has"
            ),
        ),
    ),
    export=EXPORT_NEUTRAL,  # its options shape the second stream, which its residual scaling declares
    validate=fp16_warning,
    describe=describe_resi_dual,
    layer_setup=setup_resi_dual_layer,
    stack_setup=setup_resi_dual_stack,
    families={"resi_dual": dict(init_scheme="fairseq", residual_scale=NAME)},
)
