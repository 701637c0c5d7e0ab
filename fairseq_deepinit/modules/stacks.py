"""The kind of stack a layer belongs to: encoder, decoder with cross-attention, or decoder-only.

The released code of the depth-dependent methods picks its constants by this kind, not by the
model's depths alone: torchscale (microsoft/torchscale @ 4d1e0e8) passes ``is_encoder_decoder`` to
every layer and uses it for DeepNorm's alpha and init divisor and for Sub-LN's gain
(architecture/encoder.py:78-87, 235-270; decoder.py:89-93, 286-314), and admin-torch
(microsoft/admin-torch @ 08b6605, admin_torch/admin.py:54-81) counts the residual sub-layers of a
stack. Each layer therefore carries its kind (``layer.kind``), set where the layer is built from
what it is built with (a decoder layer without cross-attention is decoder-only), and every formula
reads it from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Tuple


@dataclass(frozen=True)
class StackKind:
    """What a layer is: its stack and the residual sub-layers a standard layer of it has.

    ``stack`` is the model attribute holding the layers (``model.encoder`` / ``model.decoder``);
    ``encoder_decoder`` is torchscale's ``is_encoder_decoder``; ``sublayers`` are the standard
    layer's residual sub-layers in forward order (a layer type with other sub-layers, MAtt,
    keeps the kind and has its own).
    """

    name: str
    stack: str
    encoder_decoder: bool
    sublayers: Tuple[str, ...]

    def __str__(self) -> str:
        return self.name


ENCODER = StackKind("encoder", "encoder", True, ("self_attn", "ffn"))
DECODER = StackKind("decoder", "decoder", True, ("self_attn", "encoder_attn", "ffn"))
DECODER_ONLY = StackKind("decoder-only", "decoder", False, ("self_attn", "ffn"))


def decoder_kind(cross_attention: bool) -> StackKind:
    """The kind of a decoder layer built with (``DECODER``) or without (``DECODER_ONLY``) cross-attention."""
    return DECODER if cross_attention else DECODER_ONLY


def iter_layers(model) -> Iterator[Tuple[str, int, object]]:
    """``(stack, l, layer)`` for every layer of ``model``, l counted from 1 separately per stack; a stack the
    model does not have (a language model's encoder) is skipped."""
    for stack in ("encoder", "decoder"):
        module = getattr(model, stack, None)
        if module is not None:
            for i, layer in enumerate(module.layers, start=1):
                yield stack, i, layer
