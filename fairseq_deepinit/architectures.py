"""Named architectures: ``--arch <family>_<size>`` for every configuration the papers' tables use.

A family fixes the axes (norm position, norm type, residual scaling, init scheme); a size fixes
the dimensions (fairseq's IWSLT small, WMT base and big, plus deep variants). Every value is only
a default: command-line overrides (``--encoder-layers 18`` ...) win, as with fairseq's own archs.
"""

from __future__ import annotations

from typing import Callable, Dict

from fairseq.models import register_model_architecture
from fairseq.models.transformer.transformer_legacy import (
    base_architecture,
    transformer_iwslt_de_en,
    transformer_vaswani_wmt_en_de_big,
)


def _set(args, **defaults) -> None:
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


# family -> model-option defaults (the four axes)
FAMILIES: Dict[str, dict] = {
    # Xu et al. 2020: Post-LN ("v1") and Pre-LN ("v2") baselines, and v1 with Lipschitz init
    "postln": dict(init_scheme="xavier"),
    "preln": dict(init_scheme="xavier", encoder_normalize_before=True, decoder_normalize_before=True),
    "lipschitz": dict(init_scheme="lipschitz"),
    # Huang et al. 2020
    "tfixup": dict(init_scheme="t-fixup"),
    # Zhang et al. 2019
    "dsinit": dict(init_scheme="ds-init"),
    # Nguyen & Salazar 2019: PreNorm + ScaleNorm + FixNorm + SmallInit, tied output layer
    "twt": dict(
        init_scheme="smallinit",
        norm_type="scalenorm",
        fixnorm=True,
        encoder_normalize_before=True,
        decoder_normalize_before=True,
        share_decoder_input_output_embed=True,
    ),
    # Wang et al. 2022
    "deepnorm": dict(init_scheme="deepnorm"),
    # torchscale's DeepNorm constants (schemes/deepnorm.py)
    "deepnorm_torchscale": dict(init_scheme="deepnorm", deepnorm_variant="torchscale"),
    # Liu et al. 2020, Table 3 baselines
    "rezero": dict(init_scheme="rezero"),
    "rezero_postln": dict(init_scheme="rezero+postln"),
}

# size -> (fairseq arch function, extra dimension defaults)
SIZES: Dict[str, tuple] = {
    "iwslt_de_en": (transformer_iwslt_de_en, {}),
    "wmt_en_de": (base_architecture, {}),
    "wmt_en_de_big": (transformer_vaswani_wmt_en_de_big, {}),
}
# deep variants of WMT base used in the papers' depth tables (layers per stack)
DEEP_LAYERS = (12, 18, 24, 36)


def register_family(family: str, axes: dict) -> None:
    """Register ``<family>_<size>`` and ``<family>_wmt_en_de_<N>l`` for ``family``."""
    FAMILIES.setdefault(family, axes)

    def make(size_fn: Callable, dims: dict, layers: int | None = None):
        def arch(args):
            _set(args, **axes)
            if layers is not None:
                _set(args, encoder_layers=layers, decoder_layers=layers)
            _set(args, **dims)
            size_fn(args)

        return arch

    for size, (size_fn, dims) in SIZES.items():
        register_model_architecture("deepinit", f"{family}_{size}")(make(size_fn, dims))
    for n in DEEP_LAYERS:
        register_model_architecture("deepinit", f"{family}_wmt_en_de_{n}l")(make(base_architecture, {}, n))


@register_model_architecture("deepinit", "deepinit")
def deepinit_base(args):
    """WMT base dimensions with the plugin's defaults (xavier baseline, Post-LN, LayerNorm)."""
    base_architecture(args)


@register_model_architecture("deepinit", "deepinit_tiny")
def deepinit_tiny(args):
    """d=64, FFN 128, 2 heads, 2+2 layers: for tests and smoke runs."""
    _set(
        args,
        encoder_embed_dim=64,
        encoder_ffn_embed_dim=128,
        encoder_attention_heads=2,
        encoder_layers=2,
        decoder_embed_dim=64,
        decoder_ffn_embed_dim=128,
        decoder_attention_heads=2,
        decoder_layers=2,
    )
    base_architecture(args)


for _family, _axes in list(FAMILIES.items()):
    register_family(_family, _axes)


@register_model_architecture("deepinit", "tfixup_iwslt_de_en_200l")
def tfixup_200l(args):
    """T-Fixup Fig. 4b: 200 encoder + 200 decoder layers of d=64, FFN 128, 2 heads."""
    _set(args, **FAMILIES["tfixup"])
    _set(
        args,
        encoder_embed_dim=64,
        encoder_ffn_embed_dim=128,
        encoder_attention_heads=2,
        encoder_layers=200,
        decoder_embed_dim=64,
        decoder_ffn_embed_dim=128,
        decoder_attention_heads=2,
        decoder_layers=200,
    )
    transformer_iwslt_de_en(args)
