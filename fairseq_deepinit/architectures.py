"""Named architectures: ``--arch <family>_<size>`` for every configuration the papers' tables use.

A family fixes the axes (norm position, norm type, residual scaling, init scheme); a size fixes
the dimensions (fairseq's IWSLT small, WMT base and big, plus deep variants). Every value is only
a default: command-line overrides (``--encoder-layers 18`` ...) win, as with fairseq's own archs.
The families and the single named architectures are the method records' (``Method.families``,
``Method.architectures``, :mod:`fairseq_deepinit.methods`), registered here in method order;
:mod:`fairseq_deepinit.lm.architectures` derives the language-model families from the same records.
"""

from __future__ import annotations

from typing import Callable, Dict

from fairseq.models import register_model_architecture
from fairseq.models.transformer.transformer_legacy import (
    base_architecture,
    transformer_iwslt_de_en,
    transformer_vaswani_wmt_en_de_big,
)

from . import model  # noqa: F401  (registers the deepinit model, which fairseq needs before its architectures)
from .checkpoints.config_check import TRANSLATION_MODEL
from .methods import METHODS


def _set(args, **defaults) -> None:
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


# family -> model-option defaults (the four axes), in method order
FAMILIES: Dict[str, dict] = {family: axes for m in METHODS.values() for family, axes in m.families.items()}

# size -> (fairseq arch function, extra dimension defaults)
SIZES: Dict[str, tuple] = {
    "iwslt_de_en": (transformer_iwslt_de_en, {}),
    "wmt_en_de": (base_architecture, {}),
    "wmt_en_de_big": (transformer_vaswani_wmt_en_de_big, {}),
}
# deep variants of WMT base used in the papers' depth tables (layers per stack)
DEEP_LAYERS = (12, 18, 24, 36)


def make_arch(size_fn: Callable, defaults: dict, layers: int | None = None) -> Callable:
    """An architecture function: ``defaults`` (axes, dims), the layers, then fairseq's size function."""

    def arch(args):
        _set(args, **defaults)
        if layers is not None:
            _set(args, encoder_layers=layers, decoder_layers=layers)
        size_fn(args)

    return arch


def register_family(family: str, axes: dict) -> None:
    """Register ``<family>_<size>`` and ``<family>_wmt_en_de_<N>l`` for ``family``."""
    for size, (size_fn, dims) in SIZES.items():
        register_model_architecture(TRANSLATION_MODEL, f"{family}_{size}")(make_arch(size_fn, {**axes, **dims}))
    for n in DEEP_LAYERS:
        register_model_architecture(TRANSLATION_MODEL, f"{family}_wmt_en_de_{n}l")(
            make_arch(base_architecture, axes, n)
        )


@register_model_architecture(TRANSLATION_MODEL, TRANSLATION_MODEL)
def deepinit_base(args):
    """WMT base dimensions with the plugin's defaults (xavier baseline, Post-LN, LayerNorm)."""
    base_architecture(args)


@register_model_architecture(TRANSLATION_MODEL, "deepinit_tiny")
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


for _family, _axes in FAMILIES.items():
    register_family(_family, _axes)
for _method in METHODS.values():
    for _name, (_size, _defaults) in _method.architectures.items():
        register_model_architecture(TRANSLATION_MODEL, _name)(make_arch(SIZES[_size][0], _defaults))
