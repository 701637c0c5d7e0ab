"""Gated feed-forward networks: ``--ffn-type swiglu`` (Shazeer 2020, "GLU Variants Improve Transformer", arXiv
2002.05202, eq. 6) and ``--ffn-type swiglu-oss`` (gpt-oss's clamped variant, ``--swiglu-limit``, ``--swiglu-alpha``).

Every FFN of the model (encoder and decoder; :mod:`fairseq_deepinit.modules.glu` has the formulas):

    swiglu:      FFN(x) = fc2( silu(W_g x + b_g) * (W_1 x + b_1) )
    swiglu-oss:  g = min(W_g x + b_g, L), u = clamp(W_1 x + b_1, -L, L),  FFN(x) = fc2( g sigmoid(alpha g) (u + 1) )

with ``L`` = 7 and ``alpha`` = 1.702 as gpt-oss releases them (openai/gpt-oss @ 7b58334
``gpt_oss/torch/model.py:20, 249-255``); plain SwiGLU as HF transformers' ``LlamaMLP``. The hidden size F is
``--encoder-/--decoder-ffn-embed-dim`` as given: three ``d x F`` matrices where fairseq's FFN has two, so the
parameter count of a ReLU FFN of width 4d is kept by ``F = 8d/3`` (Shazeer 2020, sec. 2: "we reduce the number of
hidden units d_ff (the second dimension of W and V and the first dimension of W2) by a factor of 2/3"); nothing
rescales F behind the user's back. fairseq's ``--activation-fn`` is replaced by the gate and refused.

Init schemes: the gate ``W_g`` is one more ``Linear`` of the layer, initialised by every scheme that treats each
of the layer's Linears alike (``xavier``, ``fairseq``, ``normal``, ``normal-scaled``, Admin's xavier before its
profiling, which measures the branch as built, whatever its matrices). The schemes whose constants come from an
argument about the two-matrix FFN (T-Fixup, DeepNorm, DS-Init, Lipschitz: their ``two_matrix_ffn``), and Sub-LN's
gamma, are refused with it (docs/schemes.md).
"""

from __future__ import annotations

import torch.nn.functional as F

from ..modules.glu import GLU_KINDS, FFNGate
from .exporting import FAIRSEQ, Export
from .record import INIT, TAG, TWO_MATRIX_FFN, Method, Option, Rule, positive

STANDARD = "standard"
SWIGLU, OSS = (f"ffn_type={kind}" for kind in GLU_KINDS)
DEFAULT_LIMIT = 7.0  # gpt-oss ModelConfig.swiglu_limit (gpt_oss/torch/model.py:20)
DEFAULT_ALPHA = 1.702  # gpt-oss swiglu(alpha=1.702) (gpt_oss/torch/model.py:249)

OPTIONS = (
    Option(
        "ffn_type",
        str,
        STANDARD,
        "feed-forward network: standard (fairseq's fc2(act(fc1 x)), default), swiglu (fc2(silu(W_g x) * fc1 x), "
        "Shazeer 2020) or swiglu-oss (gpt-oss's clamped variant); the hidden size is --*-ffn-embed-dim as given "
        "(8d/3 keeps a 4d ReLU FFN's parameters; docs/schemes.md)",
        choices=(STANDARD, *GLU_KINDS),
    ),
    Option(
        "swiglu_limit",
        float,
        DEFAULT_LIMIT,
        f"swiglu-oss: the clamp L of the gate (max L) and of the linear half (-L..L) (default {DEFAULT_LIMIT:g}, "
        "gpt-oss's swiglu_limit)",
        metavar="L",
        check=positive("swiglu_limit"),
        only_with=OSS,
    ),
    Option(
        "swiglu_alpha",
        float,
        DEFAULT_ALPHA,
        f"swiglu-oss: alpha of the gate's g*sigmoid(alpha*g) (default {DEFAULT_ALPHA}, gpt-oss)",
        metavar="A",
        check=positive("swiglu_alpha"),
        only_with=OSS,
    ),
)


def oss_options_off(p, layers) -> dict:
    """Under plain SwiGLU gpt-oss's options are stored as None (a stored model resolves again without them)."""
    return {} if p.ffn_type == "swiglu-oss" else {"swiglu_limit": None, "swiglu_alpha": None}


def setup_gated_ffn(layer, p, spec) -> None:
    """Layer set-up: the gate ``W_g`` of the layer's FFN (``d -> F``, a bias as ``fc1`` has one)."""
    if layer.activation_fn is not F.relu:
        raise METHOD.error(
            f"--ffn-type {p.ffn_type} brings its own activation (the gate's), so --activation-fn does nothing; "
            "drop --activation-fn"
        )
    fc1 = layer.fc1
    oss = dict(limit=p.swiglu_limit, alpha=p.swiglu_alpha) if p.ffn_type == "swiglu-oss" else {}
    gate = FFNGate(fc1.in_features, fc1.out_features, p.ffn_type, bias=fc1.bias is not None, **oss)
    layer.ffn_gate = gate.to(device=fc1.weight.device, dtype=fc1.weight.dtype)


def _export_refusal(p, spec, args) -> str:
    if p.ffn_type == "swiglu-oss":
        return "--ffn-type swiglu-oss clamps both halves and adds 1 to the linear one, which neither target computes"
    return ""


def describe(p) -> str:
    if p.ffn_type == "swiglu-oss":
        return f"ffn=swiglu-oss(limit={p.swiglu_limit:g},alpha={p.swiglu_alpha:g})"
    return f"ffn={p.ffn_type}"


METHOD = Method(
    name="swiglu",
    title="SwiGLU feed-forward",
    paper="Shazeer 2020 (arXiv 2002.05202), eq. 6; gpt-oss (OpenAI 2025) swiglu with limit",
    summary="a third matrix W_g gates the FFN: fc2(silu(W_g x) * fc1 x), or gpt-oss's clamped "
    "g sigmoid(1.702 g) (u + 1) (limit 7); hidden size as given (8d/3 keeps a 4d ReLU FFN's parameters)",
    code="openai/gpt-oss @ 7b58334 gpt_oss/torch/model.py:20,249-255; HF transformers LlamaMLP.forward",
    enabled_by=(SWIGLU, OSS),
    options=OPTIONS,
    excludes=(
        Rule(INIT, (TWO_MATRIX_FFN,)),
        Rule(TAG, ("two-matrix-ffn-init",), "its init constants assume the FFN's two matrices fc1, fc2"),
    ),
    derive=oss_options_off,
    describe=describe,
    layer_setup=setup_gated_ffn,
    # Pre-LN + the gated FFN, the FFN width as the size gives it (three matrices: 1.5x the FFN's parameters)
    families={"swiglu": dict(init_scheme="xavier", ffn_type="swiglu", norm_placement="pre")},
    export=Export(
        neither=_export_refusal,
        # CTranslate2 4.8 carries plain SwiGLU: FeedForwardSpec(glu=True) (specs/transformer_spec.py:443-449),
        # linear_0 the gate with activation SWISH, linear_0_noact fc1 (fairseq_deepinit.export.to_ct2)
        refuses={FAIRSEQ: "--ffn-type swiglu: a stock transformer's FFN is fc2(act(fc1 x)), with no gate"},
    ),
)
