"""QK-Clip (Kimi K2, arXiv 2507.20534, sec. 2.1 and Algorithm 1 "MuonClip"): after every optimizer step, the query
and key projections of each attention head whose largest logit in that update exceeded ``tau`` are scaled down
so that its logits scale by ``eta_h = tau / S_max^h``: ``--qk-clip``, ``--qk-clip-threshold`` (``tau``, 100),
``--qk-clip-alpha`` (the query's share, 0.5: ``W_q^h *= eta^alpha``, ``W_k^h *= eta^(1 - alpha)``) and
``--no-qk-clip-cross``.

Moonshot released no code; the maintained implementation is Megatron-LM @ d98e8a6
``megatron/core/transformer/attention.py:1975-2070`` (``clip_qk``, ``_clip_linear_qkv``), defaults
``transformer_config.py:265-272``, the data-parallel MAX ``megatron/core/optimizer/qk_clip.py:8-52``. The rule as
the plugin applies it (biases scaled with their rows, no host read, every attention of an encoder-decoder) is
:mod:`fairseq_deepinit.training.qk_clip`; the record holds the options, what the method rules out and its
training hooks there (``check_training``: the set-ups it refuses; ``after_step``: the clip). Megatron
clips self-attention only; clipping the encoder-decoder attention too is this project's extension
(``--no-qk-clip-cross`` leaves it).
"""

from __future__ import annotations

import math

from ..training.qk_clip import check_training, step_hook
from .exporting import EXPORT_NEUTRAL
from .record import TAG, Method, Option, Rule, check_cross_off, standard_layer

TAU = 100.0  # Kimi K2's tau; Megatron qk_clip_threshold
ALPHA = 0.5  # Megatron qk_clip_alpha; the paper's sqrt(gamma) on each side


def _tau_problem(tau) -> str | None:
    if isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0:
        return None
    return f"--qk-clip-threshold must be a finite number greater than 0 (default {TAU:g}), got {tau}"


def _alpha_problem(alpha) -> str | None:
    if isinstance(alpha, (int, float)) and 0 <= alpha <= 1:
        return None
    return f"--qk-clip-alpha is the query's share of the factor, between 0 and 1 (default {ALPHA}), got {alpha}"


def validate_qk_clip(p, spec) -> None:
    """``--no-qk-clip-cross`` needs an encoder-decoder attention to leave unclipped."""
    check_cross_off(p, spec, "qk_clip_cross")


def describe_qk_clip(p) -> str:
    cross = "" if p.qk_clip_cross else ",self-attention only"
    return f"qk-clip(tau={p.qk_clip_threshold:g},alpha={p.qk_clip_alpha:g}{cross})"


METHOD = Method(
    name="qk_clip",
    title="QK-Clip",
    paper="Kimi K2 (Moonshot AI 2025, arXiv 2507.20534), sec. 2.1, Algorithm 1",
    summary="after each optimizer step, every head whose max attention logit S exceeded tau (100) gets W_q, b_q "
    "times (tau/S)^alpha and W_k, b_k times (tau/S)^(1-alpha); the max over the update's micro-batches and ranks",
    code="NVIDIA/Megatron-LM @ d98e8a6 megatron/core/transformer/attention.py:1975-2070, "
    "megatron/core/optimizer/qk_clip.py:8-52",
    enabled_by="qk_clip",
    options=(
        Option(
            "qk_clip",
            bool,
            False,
            "QK-Clip: after each optimizer step, scale down W_q/W_k of every head whose max attention logit "
            "exceeded --qk-clip-threshold (Kimi K2; docs/schemes.md)",
            resume=False,
        ),
        Option(
            "qk_clip_threshold",
            float,
            TAU,
            f"with --qk-clip: tau, the largest attention logit a head keeps (default {TAU:g}: Kimi K2, Megatron)",
            check=_tau_problem,
            resume=False,
        ),
        Option(
            "qk_clip_alpha",
            float,
            ALPHA,
            f"with --qk-clip: the query's share of the factor, W_q x eta^alpha, W_k x eta^(1-alpha) (default "
            f"{ALPHA}: Megatron, the paper's sqrt split)",
            check=_alpha_problem,
            resume=False,
        ),
        Option(
            "qk_clip_cross",
            bool,
            True,
            "with --qk-clip: clip the encoder-decoder attention too (default; this project's extension, the "
            "released code clips self-attention)",
            negative="--no-qk-clip-cross",
            negative_help="with --qk-clip: clip self-attention only (as Megatron-LM)",
            resume=False,
        ),
    ),
    requires=(standard_layer("measures and rescales the standard attention's q/k projections"),),
    excludes=(
        Rule(
            TAG,
            ("normalised-qk",),
            "a norm on the queries and keys removes the scale of W_q/W_k from the logits, so the clip changes "
            "nothing it measures",
        ),
    ),
    validate=validate_qk_clip,
    describe=describe_qk_clip,
    export=EXPORT_NEUTRAL,  # rescales the q/k weights during training; the export reads them as they are
    check_training=check_training,
    after_step=step_hook,
)
