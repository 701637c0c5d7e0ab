"""Named language-model architectures: ``--arch <family>_lm<size>`` for every family of the plugin.

A family fixes the axes (norm position, norm type, residual scaling, init scheme; the translation
model's :data:`fairseq_deepinit.architectures.FAMILIES` with their encoder-only keys dropped); a size
fixes the dimensions, those of fairseq's ``transformer_lm`` architectures plus deep and tiny variants:

- ``<family>_lm``: ``transformer_lm``'s dims (d 512, FFN 2048, 8 heads, 6 layers) through
  ``base_lm_architecture`` (fairseq's plain ``transformer_lm`` takes its dataclass defaults instead);
- ``<family>_lm_big``: ``transformer_lm_big`` (d 1024, FFN 4096, 16 heads, 12 layers);
- ``<family>_lm_gpt``: ``transformer_lm_gpt`` (d 768, FFN 3072, 12 heads, 12 layers, GELU);
- ``<family>_lm_gpt2_small``: ``transformer_lm_gpt2_small`` (d 1024, 16 heads, 24 layers, GELU);
- ``<family>_lm_<N>l``: ``transformer_lm`` dims with N = 12, 24, 48, 96 layers;
- ``<family>_lm_tiny`` and ``<family>_lm_tiny_<N>l`` (N = 6, 24, 48): d 64, FFN 256, 4 heads (tests,
  and the CPU depth study of docs/lm.md).

Every value is only a default; command-line options win. fairseq's ``base_lm_architecture`` forces
Pre-LN; here the family decides (Post-LN unless the family is Pre-LN, as the translation model).
Families whose ``--decoder-layer-type`` needs cross-attention (MAtt) are not registered.
"""

from __future__ import annotations

from typing import Callable, Dict

from fairseq.models import register_model_architecture
from fairseq.models.transformer_lm import (
    base_lm_architecture,
    transformer_lm_big,
    transformer_lm_gpt,
    transformer_lm_gpt2_small,
)

from ..architectures import FAMILIES
from ..methods import LAYER_TYPES
from ..methods.record import CROSS_ATTENTION
from .model import MODEL_NAME

TINY_DIMS = dict(decoder_embed_dim=64, decoder_ffn_embed_dim=256, decoder_attention_heads=4, decoder_layers=2)
# size -> (fairseq LM arch function, dimension defaults set before it)
LM_SIZES: Dict[str, tuple] = {
    "lm": (base_lm_architecture, {}),
    "lm_big": (transformer_lm_big, {}),
    "lm_gpt": (transformer_lm_gpt, {}),
    "lm_gpt2_small": (transformer_lm_gpt2_small, {}),
    "lm_tiny": (base_lm_architecture, TINY_DIMS),
}
for _n in (12, 24, 48, 96):
    LM_SIZES[f"lm_{_n}l"] = (base_lm_architecture, {"decoder_layers": _n})
for _n in (6, 24, 48):
    LM_SIZES[f"lm_tiny_{_n}l"] = (base_lm_architecture, {**TINY_DIMS, "decoder_layers": _n})

LM_FAMILIES: Dict[str, dict] = {}


def _set(args, **defaults) -> None:
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def lm_axes(axes: dict) -> dict:
    """A translation family's axes for a decoder-only model: encoder-only keys dropped."""
    return {k: v for k, v in axes.items() if not k.startswith("encoder_") and k != "share_all_embeddings"}


def lm_arch(size_fn: Callable, dims: dict, axes: dict) -> Callable:
    """An architecture function: the family's axes, the size's dims, then fairseq's LM defaults."""

    def arch(args) -> None:
        _set(args, **axes)
        _set(args, **dims)
        before = getattr(args, "decoder_normalize_before", None)
        size_fn(args)
        args.decoder_normalize_before = before  # fairseq's base_lm_architecture forces True; the family decides

    return arch


def register_lm_family(family: str, axes: dict) -> None:
    """Register ``<family>_<size>`` for every size of :data:`LM_SIZES`."""
    if any(r.axis == CROSS_ATTENTION for r in LAYER_TYPES[axes.get("decoder_layer_type", "standard")].requires):
        return  # a layer type that needs cross-attention (MAtt): its record refuses a decoder-only model
    LM_FAMILIES[family] = lm_axes(axes)
    for size, (size_fn, dims) in LM_SIZES.items():
        register_model_architecture(MODEL_NAME, f"{family}_{size}")(lm_arch(size_fn, dims, LM_FAMILIES[family]))


# the plain model: the plugin's defaults (xavier baseline, Post-LN, LayerNorm) at transformer_lm / tiny dims
register_model_architecture(MODEL_NAME, MODEL_NAME)(lm_arch(base_lm_architecture, {}, {}))
register_model_architecture(MODEL_NAME, f"{MODEL_NAME}_tiny")(lm_arch(base_lm_architecture, TINY_DIMS, {}))

for _family, _axes in list(FAMILIES.items()):
    register_lm_family(_family, _axes)
