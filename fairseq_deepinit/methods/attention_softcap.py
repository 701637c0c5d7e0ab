"""Attention logit soft-capping (Gemma 2, Gemma Team 2024, arXiv 2408.00118, sec. 2 "Logit soft-capping"):
``--attention-softcap``, every attention logit squashed into ``(-c, c)`` before the softmax,

    l_ij = c * tanh((q_i . k_j / sqrt(dh)) / c),     p_ij = softmax_j(l_ij + mask_ij),

``c`` = ``--attention-softcap-value`` (50, Gemma 2's ``attn_logits_soft_cap``). Released code:
google-deepmind/gemma @ 7691fd4 ``gemma/gm/nn/_modules.py:254-256`` (on the scaled logits, before the masks) and
``gemma/gm/nn/_gemma.py:68`` (``attn_logits_soft_cap=50.0``); HF transformers' ``eager_attention_forward`` of
``models/gemma2/modeling_gemma2.py`` (``attn_weights / softcap``, ``tanh``, ``* softcap``, then the mask).

Every attention gets the cap: encoder and decoder self-attention and the decoder's cross-attention (this
project's extension; Gemma is decoder-only), on every call: training, the explicit path's weights and
incremental decoding (fairseq's key/value cache, beam search), all through the plugin's explicit core
(:mod:`fairseq_deepinit.modules.attention_features`), the cap computed in float32 or wider. The capped logits
must be materialised, which ``F.scaled_dot_product_attention`` never does: ``--attention-impl sdpa`` is refused
(docs/schemes.md has its cost).
"""

from __future__ import annotations

from ..modules.attention_features import feature_attention
from .exporting import never
from .record import FLAG, Method, Option, Rule, positive, standard_layer

DEFAULT_CAP = 50.0  # Gemma 2: attn_logits_soft_cap=50.0 (gemma/gm/nn/_gemma.py:68)


OPTIONS = (
    Option(
        "attention_softcap",
        bool,
        False,
        "attention logit soft-capping: every attention logit l becomes c*tanh(l/c) before the masks and the "
        "softmax (Gemma 2; docs/schemes.md); needs --attention-impl fairseq",
    ),
    Option(
        "attention_softcap_value",
        float,
        DEFAULT_CAP,
        f"with --attention-softcap: the cap c (default {DEFAULT_CAP:g}, Gemma 2's attn_logits_soft_cap)",
        metavar="C",
        check=positive("attention_softcap_value"),
    ),
)


def validate_attention_softcap(p, spec) -> None:
    """The fused kernel never forms the logits the cap acts on."""
    if spec.attention == "sdpa":
        raise METHOD.error(
            "--attention-softcap caps the attention logits, which --attention-impl sdpa's fused kernel never "
            "materialises; use --attention-impl fairseq (docs/schemes.md: what the cap costs)"
        )


def setup_softcap_layer(layer, p, spec) -> None:
    """Layer set-up: the cap in every attention of the layer."""
    for attn in layer.attention_modules():
        feature_attention(attn).softcap = float(p.attention_softcap_value)


METHOD = Method(
    name="attention_softcap",
    title="Attention logit soft-capping",
    paper="Gemma Team 2024 (Gemma 2, arXiv 2408.00118), sec. 2 logit soft-capping",
    summary="every attention logit l becomes c tanh(l / c) (c 50) before the masks and the softmax, in float32; "
    "the logits are materialised (no fused SDPA)",
    code="google-deepmind/gemma @ 7691fd4 gemma/gm/nn/_modules.py:254-256, gemma/gm/nn/_gemma.py:68",
    enabled_by="attention_softcap",
    options=OPTIONS,
    requires=(standard_layer("caps each attention of the standard layer (MAtt's merged one has its own forward)"),),
    excludes=(
        Rule(
            FLAG,
            ("encoder_xformers_att_config", "decoder_xformers_att_config"),
            "fairseq's xFormers attention never materialises the logits the cap acts on",
        ),
        Rule(FLAG, ("cross_self_attention",), "the joint source-target self-attention is fairseq's own forward"),
    ),
    validate=validate_attention_softcap,
    describe=lambda p: f"attention-softcap={p.attention_softcap_value:g}",
    layer_setup=setup_softcap_layer,
    families={
        # Pre-LN + the attention cap with the Pre-LN baseline's init: the preln_* model plus the cap only
        "attnsoftcap": dict(init_scheme="xavier", attention_softcap=True, norm_placement="pre"),
    },
    export=never(
        "--attention-softcap squashes every attention logit by c*tanh(l/c), which neither target computes "
        "(a stock transformer and CTranslate2 4.8's TransformerSpec have no attention soft-cap)"
    ),
)
