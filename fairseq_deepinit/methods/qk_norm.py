"""QK-Norm (Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion Parameters", sec. 2, "QK
normalization"): ``--qk-norm``, queries and keys normalised before the dot product,

    logits_h = head_dim^-1/2 <N_q(x W_q + b_q)_h, N_k(x' W_k + b_k)_h>,     values untouched,

with ``--qk-norm-scope head`` (one norm over ``head_dim``, shared by the heads: HF ``Qwen3Attention`` /
``Gemma3Attention``, Megatron-LM ``qk_layernorm``, OLMo-core ``use_head_qk_norm``, HybridNorm) or ``proj``
(one norm over the whole projection before the head split: allenai/OLMo @ 59a53e3 ``olmo/model.py:432-441,
603-605``, HF ``Olmo2Attention``, OLMo-core @ fa6c501 ``src/olmo_core/nn/attention/__init__.py:417-421,
589-593``), and ``--qk-norm-type`` / ``--qk-norm-eps`` for the norm. Defaults, from the released code:
scope ``head`` (Qwen3, Gemma 3, Megatron, OLMo-core's Qwen3/Gemma 3 configs; its logit bound at init,
``sqrt(head_dim)``, does not grow with the number of heads), RMSNorm with eps 1e-6 (Qwen3's
``rms_norm_eps``, Gemma 3, OLMo 2's ``layer_norm_eps=1e-6``, OLMo-core ``transformer/config.py:524-536``).

Every attention block gets its own q and k norm: encoder and decoder self-attention, and the decoder's
cross-attention (queries from the decoder stream, keys from the encoder output). The released code is
decoder-only; cross-attention q/k norms are this project's extension (``--no-qk-norm-cross`` leaves the
cross-attention as it is). The block (:mod:`fairseq_deepinit.modules.qk_norm`) says how the norm precedes
fairseq's softmax scale and the incremental key cache on both ``--attention-impl`` paths.
"""

from __future__ import annotations

import math

from fairseq.modules.multihead_attention import MultiheadAttention

from ..modules.qk_norm import QK_NORM_SCOPES, QK_NORM_TYPES, add_qk_norm, build_qk_norm
from .exporting import CTRANSLATE2, FAIRSEQ, Export, HeadNorm
from .record import FLAG, Method, Option, Rule, check_cross_off

DEFAULT_SCOPE = "head"
DEFAULT_TYPE = "rmsnorm"
DEFAULT_EPS = 1e-6


def _eps_problem(eps) -> str | None:
    if isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0:
        return None
    return f"--qk-norm-eps must be a finite number greater than 0 (default {DEFAULT_EPS}), got {eps}"


OPTIONS = (
    Option(
        "qk_norm",
        bool,
        False,
        "QK-Norm: normalise every attention's queries and keys before the dot product (Dehghani et al. 2023; "
        "docs/schemes.md)",
    ),
    Option(
        "qk_norm_scope",
        str,
        DEFAULT_SCOPE,
        "with --qk-norm: head (one norm over head_dim for each head: Qwen3, Gemma 3, Megatron; default) or proj "
        "(one norm over the whole projection: OLMo, OLMo 2)",
        choices=QK_NORM_SCOPES,
    ),
    Option(
        "qk_norm_type",
        str,
        DEFAULT_TYPE,
        "with --qk-norm: the q/k norm, rmsnorm (Qwen3, Gemma 3, OLMo 2; default), layernorm (ViT-22B, OLMo v1) "
        "or scalenorm",
        choices=QK_NORM_TYPES,
    ),
    Option(
        "qk_norm_eps",
        float,
        DEFAULT_EPS,
        f"with --qk-norm: epsilon of the q/k norms (default {DEFAULT_EPS}: Qwen3, Gemma 3, OLMo 2)",
        check=_eps_problem,
    ),
    Option(
        "qk_norm_cross",
        bool,
        True,
        "with --qk-norm: normalise the encoder-decoder attention's queries and keys too (default; this "
        "project's extension, the released code has no cross-attention)",
        negative="--no-qk-norm-cross",
        negative_help="with --qk-norm: leave the encoder-decoder attention without q/k norms (only self-attention, "
        "as in the decoder-only released code)",
    ),
)


def validate_qk_norm(p, spec) -> None:
    """``--no-qk-norm-cross`` needs an encoder-decoder attention to leave without q/k norms."""
    check_cross_off(p, spec, "qk_norm_cross")


def setup_qk_norm_layer(layer, p, spec) -> None:
    """Layer set-up: a q and a k norm in every attention of the layer (not the cross-attention under
    ``--no-qk-norm-cross``)."""
    for attn in [m for m in layer.modules() if isinstance(m, MultiheadAttention)]:
        if attn.encoder_decoder_attention and not p.qk_norm_cross:
            continue
        norm = lambda dim: build_qk_norm(p.qk_norm_type, dim, p.qk_norm_eps, spec.norm.export)  # noqa: E731
        add_qk_norm(attn, norm, p.qk_norm_scope)


def _ct2_head_norm(p, spec, args) -> tuple:
    """``(HeadNorm, None)`` as CTranslate2 computes the self-attentions' q/k norms, or ``(None, why not)``.

    CTranslate2 4.8 normalises self-attention queries and keys per head (src/layers/attention.cc:514-517) and
    cross-attention queries over d_model before the head split (430-439); a ScaleNorm over ``head_dim`` is the
    RMSNorm of eps ``eps^2 / head_dim``, one value only where every attention has one head size.
    """
    if p.qk_norm_cross and spec.encoder is not None:
        return None, (
            "--qk-norm on the cross-attention: CTranslate2 4.8 normalises cross-attention queries over d_model before "
            "the head split (src/layers/attention.cc:430-439), not per head as the plugin; train with "
            "--no-qk-norm-cross, or export to neither"
        )
    if p.qk_norm_scope != DEFAULT_SCOPE:
        return None, (
            "--qk-norm-scope proj: CTranslate2 normalises self-attention queries and keys per head "
            "(src/layers/attention.cc:514-517), not over the whole projection"
        )
    if p.qk_norm_type != "scalenorm":
        return HeadNorm(p.qk_norm_type, float(p.qk_norm_eps), False), None
    head_dims = {s.dim // int(getattr(args, f"{s.kind.stack}_attention_heads")) for s in spec.stacks}
    if len(head_dims) != 1:
        return None, "--qk-norm-type scalenorm with two head sizes gives two epsilons (eps^2/head_dim)"
    return HeadNorm("rmsnorm", float(p.qk_norm_eps) ** 2 / head_dims.pop(), True), None


#: a stock transformer has no q/k norms; CTranslate2 has per-head ones in its self-attentions
EXPORT = Export(
    refuses={
        FAIRSEQ: "--qk-norm: a stock transformer has no q/k norms",
        CTRANSLATE2: lambda p, spec, args: _ct2_head_norm(p, spec, args)[1],
    },
    steps=("scalenorm-as-rms",),  # a q/k ScaleNorm's g as an RMSNorm weight over head_dim
    head_norm=lambda p, spec, args: _ct2_head_norm(p, spec, args)[0],
)


def describe_qk_norm(p) -> str:
    cross = "" if p.qk_norm_cross else ",self-attention only"
    return f"qk-norm={p.qk_norm_scope}/{p.qk_norm_type}(eps={p.qk_norm_eps}){cross}"


METHOD = Method(
    name="qk_norm",
    title="QK-Norm",
    paper="Dehghani et al. 2023, sec. 2 (QK normalization); Qwen3, Gemma 3, OLMo 2",
    summary="a norm on each attention's queries and keys before the dot product (per head or over the whole "
    "projection), bounding the logits at init by sqrt(head_dim) (per head)",
    code="allenai/OLMo @ 59a53e3 olmo/model.py:432-441,603-605; allenai/OLMo-core @ fa6c501 "
    "src/olmo_core/nn/attention/__init__.py:409-421,589-608; HF transformers @ 000c33f Qwen3Attention, "
    "Olmo2Attention",
    enabled_by="qk_norm",
    options=OPTIONS,
    excludes=(
        Rule(FLAG, ("quant_noise_pq",), "its noise hooks sit on the q/k projections the norms take over"),
        Rule(
            FLAG,
            ("encoder_xformers_att_config", "decoder_xformers_att_config"),
            "fairseq's xFormers path has no place for a q/k norm; --attention-impl sdpa is the fused path that "
            "applies QK-Norm",
        ),
    ),
    tags={"normalised-qk": ()},
    validate=validate_qk_norm,
    describe=describe_qk_norm,
    layer_setup=setup_qk_norm_layer,
    export=EXPORT,
    families={
        # Pre-LN + QK-Norm with the Pre-LN baseline's init: the preln_* model plus the q/k norms only
        "qknorm": dict(init_scheme="xavier", qk_norm=True, norm_placement="pre"),
    },
)
