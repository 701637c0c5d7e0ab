"""Hyper-connections (Zhu et al., ICLR 2025, arXiv 2409.19606: static and dynamic) and manifold-constrained
hyper-connections, mHC (Xie et al. 2025, DeepSeek, arXiv 2512.24880): ``--hyper-connections hc|mhc``.

A Pre-LN stack carries ``n`` residual streams (``--hc-streams``, default 4); every sub-layer reads its input as
a learned mix of the streams and writes its output into every stream with learned weights, in place of the
residual add ``x + F(LN(x))`` (the ``hyper-connections`` value of ``--residual-scale``, which this flag sets)::

    HC  (eq. 1-3, Algorithm 2):  H' = B^T F(LN(A_m^T H)) + A_r^T H,  A, B static + s tanh(RMSNorm(H) W)
    mHC (eq. 5-9):               x' = H_res x + H_post^T F(LN(H_pre x)),  H_res = Sinkhorn(...) doubly stochastic

Released code: lucidrains/hyper-connections @ 47751035 ``hyper_connections/hyper_connections.py:59-61,86-93,
215-372`` (HC; ``--no-hc-dynamic`` is the paper's static SHC); NVIDIA/Megatron-LM @ d98e8a64
``megatron/core/transformer/hyper_connection.py:54-146,182-285,370-418,497-535,600-642`` (mHC: Sinkhorn 20
iterations, gating factor 0.01, the mean of the streams at the end). The blocks: :mod:`fairseq_deepinit.modules.hyper`.

Encoder-decoder (no source has it; docs/schemes.md gives the reasoning): every sub-layer is a connection,
encoder 2 per layer, decoder 3 (self-attention, cross-attention, FFN); each stack expands to ``n`` streams
after its embedding and contracts before its final norm, so ``encoder_out`` stays ``(S, B, d)``. Connections
are numbered per stack in forward order (x-transformers counts sub-layers), which picks HC's initial input
stream (``index mod n``).

Refused (one line): Post-LN and the other placements, no norm (T-Fixup), any other ``--residual-scale``
(DeepNorm, Admin, ReZero, ResiDual, B2T), depth-muP and NormFormer's ResScale (their residual scales), Mix-LN
(Post-LN layers), MAtt (its merged sub-layer), ``--cross-self-attention``; the export (n streams are no stock
model).
"""

from __future__ import annotations

import torch.nn as nn

from ..modules.hyper import HyperConnection, ManifoldHyperConnection, StreamResidual, Streams
from .exporting import EXPORT_NEUTRAL, never
from .record import FLAG, TAG, Method, Option, ResidualScaling, Rule, a_norm, positive, pre_ln, standard_layer

NAME = "hyper-connections"  # the --residual-scale value the flag sets
KINDS = ("none", "hc", "mhc")
HC, MHC = "hyper_connections=hc", "hyper_connections=mhc"  # the two enabled_by values; each kind's own options
MHC_ONLY = ("mhc_sinkhorn_iters", "mhc_gating_init", "mhc_eps")
HC_ONLY = ("hc_dynamic",)


# Zhu et al. (2025) study expansion rates n = 1, 2, 4, 8 (sec. 4 ablations), mHC and DeepSeek-V4 use 4; every
# residual activation, and its gradient, is held n times, so n = 1000 is a 250-fold model that exhausts memory
# before the first update instead of failing with a message
MAX_STREAMS = 8


def _at_least_one(name: str):
    def check(value) -> str | None:
        return None if isinstance(value, int) and value >= 1 else f"--{name} must be an integer >= 1, got {value}"

    return check


def _streams(value) -> str | None:
    if isinstance(value, int) and 1 <= value <= MAX_STREAMS:
        return None
    return (
        f"--hc-streams must be an integer from 1 to {MAX_STREAMS}, got {value}: every residual activation is kept "
        f"n times, and the papers use n = 1 to {MAX_STREAMS} (Zhu et al. 2025: 1, 2, 4, 8; mHC: 4). Give "
        f"--hc-streams 4 (the default) or another value up to {MAX_STREAMS}"
    )


def build_connection(stack, sublayer: str, p) -> StreamResidual:
    """A sub-layer's connection: HC or mHC over the stack's width (its index is set by the layer set-up)."""
    if p.hyper_connections == "mhc":
        return ManifoldHyperConnection(
            p.hc_streams, stack.dim, iters=p.mhc_sinkhorn_iters, gating_init=p.mhc_gating_init, eps=p.mhc_eps
        )
    return HyperConnection(p.hc_streams, stack.dim, dynamic=p.hc_dynamic)


def number_connections(layer: nn.Module, p, spec) -> None:
    """Layer set-up: HC's connections numbered per stack in forward order, ``(l - 1) * k + j`` for the j-th of
    the layer's k sub-layers (the initial input stream is the number mod n)."""
    names = list(layer.residuals)
    for j, name in enumerate(names):
        residual = layer.residuals[name]
        if isinstance(residual, HyperConnection):
            residual.set_index((layer.layer_idx - 1) * len(names) + j)


def setup_streams(stack: nn.Module, p, spec, stack_spec) -> None:
    """Stack set-up: ``n`` copies after the embedding; HC sums them before the final norm, mHC averages
    (Megatron's ``output_contract``)."""
    stack.streams = Streams(p.hc_streams, "mean" if p.hyper_connections == "mhc" else "sum")


def other_kind_options(p, layers) -> dict:
    """The options of the other kind are stored as None (a stored model resolves again without them)."""
    return dict.fromkeys(MHC_ONLY if p.hyper_connections == "hc" else HC_ONLY)


def describe(p) -> str:
    if p.hyper_connections == "mhc":
        return f"mhc streams={p.hc_streams} sinkhorn-iters={p.mhc_sinkhorn_iters} gating-init={p.mhc_gating_init:g}"
    return f"hc streams={p.hc_streams} {'dynamic' if p.hc_dynamic else 'static'}"


PRE_LN = dict(init_scheme="xavier", norm_placement="pre")

METHOD = Method(
    name="hyper_connections",
    title="Hyper-connections / mHC",
    paper="Zhu et al. 2025 (ICLR), eq. 1-3, Alg. 2; Xie et al. 2025 (mHC), eq. 5-9",
    summary="Pre-LN with n residual streams mixed around every sub-layer (encoder 2 per layer, decoder 3 incl. "
    "cross-attention): HC's static + tanh-dynamic weights, or mHC's Sinkhorn-projected doubly stochastic H_res",
    code="lucidrains/hyper-connections @ 47751035 hyper_connections/hyper_connections.py:59-61,86-93,215-372; "
    "NVIDIA/Megatron-LM @ d98e8a64 megatron/core/transformer/hyper_connection.py:54-146,182-285,370-418,497-535",
    enabled_by=(HC, MHC),
    options=(
        Option(
            "hyper_connections",
            str,
            "none",
            "hyper-connections: n residual streams mixed around every sub-layer, Pre-LN only: hc (Zhu et al. "
            "2025, dynamic unless --no-hc-dynamic), mhc (manifold-constrained, Megatron-LM's rule), none (default)",
            choices=KINDS,
        ),
        Option(
            "hc_streams",
            int,
            4,
            "hyper-connections: the expansion rate n, residual streams per token, 1 to 8 (default 4, as Megatron-LM "
            "and DeepSeek-V4)",
            metavar="N",
            check=_streams,
        ),
        Option(
            "hc_dynamic",
            bool,
            True,
            "hc: the dynamic (input-dependent, tanh) weights (default, as released)",
            negative="--no-hc-dynamic",
            negative_help="hc: static hyper-connections only (the paper's SHC)",
            only_with=HC,
        ),
        Option(
            "mhc_sinkhorn_iters",
            int,
            20,
            "mhc: Sinkhorn-Knopp iterations of H_res (default 20, Megatron-LM and DeepSeek-V4)",
            metavar="N",
            check=_at_least_one("mhc-sinkhorn-iters"),
            only_with=MHC,
        ),
        Option(
            "mhc_gating_init",
            float,
            0.01,
            "mhc: initial value of the three gating factors alpha_pre/post/res (default 0.01, Megatron-LM's "
            "mhc_init_gating_factor)",
            metavar="A",
            check=positive("mhc-gating-init"),
            only_with=MHC,
        ),
        Option(
            "mhc_eps",
            float,
            1e-6,
            "mhc: the mapping norm's eps and Sinkhorn's denominator clamp (default 1e-6, as Megatron-LM)",
            metavar="EPS",
            check=positive("mhc-eps"),
            only_with=MHC,
        ),
    ),
    residual_scalings=(
        ResidualScaling(
            NAME,
            build_connection,
            "n streams, each sub-layer reads a learned mix and writes into every stream (set by --hyper-connections)",
            export=never(
                lambda p, spec, args: (
                    f"--hyper-connections {p.hyper_connections} carries {p.hc_streams} residual streams per token, "
                    "mixed by learned weights around every sub-layer; neither target has more than one residual stream"
                )
            ),
        ),
    ),
    export=EXPORT_NEUTRAL,  # its options shape the streams, which its residual scaling declares
    sets={"residual_scale": NAME},
    requires=(
        a_norm("mixes the streams around Pre-LN sub-layers, which need their norms"),
        pre_ln("its released forms are Pre-LN; Post-LN's LN(x + F(x)) has no residual add to replace"),
        standard_layer("gives each of the standard layer's sub-layers its own connection"),
    ),
    excludes=(
        Rule(TAG, ("post-ln-layers",), "its connections replace Pre-LN residuals; those layers are Post-LN"),
        Rule(TAG, ("residual-scale",), "a scale of the residual, which the connections replace"),
        Rule(FLAG, ("cross_self_attention",), "the self-attention's keys would mix the encoder output into one stream"),
    ),
    derive=other_kind_options,
    describe=describe,
    layer_setup=number_connections,
    stack_setup=setup_streams,
    families={"hc": dict(PRE_LN, hyper_connections="hc"), "mhc": dict(PRE_LN, hyper_connections="mhc")},
)
