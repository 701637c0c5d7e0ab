"""Attention masks as the fused kernel takes them, and fairseq's future mask recognised without a device read.

``F.scaled_dot_product_attention`` takes one boolean (``True`` = attend) or additive mask, or
``is_causal`` with no mask at all; fairseq passes an additive ``attn_mask`` (its decoder's future mask
``triu(-inf, 1)``) and a ``(B, S)`` key-padding mask. :func:`kernel_mask` turns fairseq's pair into the
kernel's form; :func:`future_mask` builds the decoder's future mask so that :func:`is_future_mask`
knows it (its slices and aliases too) without reading it back from the device.
"""

from __future__ import annotations

import weakref
from typing import Dict, Tuple

import torch
from torch import Tensor


def kernel_mask(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    tgt_len: int,
    src_len: int,
    dtype: torch.dtype,
    declared_future: bool = False,
    right_padded: bool = False,
) -> Tuple[Tensor | None, bool]:
    """fairseq's ``attn_mask`` (additive float, or bool/byte with True = masked) and key-padding mask
    (``(B, S)``, nonzero = padding) as one mask for the kernel, or ``is_causal`` where that is exact.

    ``declared_future``: the caller is a decoder's causal self-attention, whose ``attn_mask`` is its
    decoder's future mask (:func:`is_causal_mask`). ``right_padded``: the key padding marks only the
    end of each row. Both are the caller's build-time knowledge, never read from the masks (a device
    sync per call); with a future mask over the same positions, ``is_causal`` is then exact for every
    query row that is not padding.

    Returns ``(mask, is_causal)``: ``mask`` is None, boolean ``True = attend`` or additive float in
    the query's dtype, broadcastable to ``(B, H, T, S)``.
    """
    if (
        attn_mask is not None
        and tgt_len == src_len
        and (key_padding_mask is None or right_padded)
        and is_causal_mask(attn_mask, declared_future)
    ):
        return None, True
    mask: Tensor | None = None
    if attn_mask is not None:
        mask = attn_mask.to(dtype) if attn_mask.is_floating_point() else ~attn_mask.bool()
    if key_padding_mask is not None:
        keep = ~key_padding_mask.bool().view(key_padding_mask.size(0), 1, 1, src_len)
        if mask is None:
            mask = keep
        elif mask.dtype == torch.bool:
            mask = mask & keep
        else:
            mask = mask.masked_fill(~keep, float("-inf"))
    return mask, False


# masks known to be (or not to be) fairseq's future mask, by storage:
# StorageImpl address -> (weakref(root tensor), root._version, result). fairseq's decoder hands every
# layer a top-left slice of one buffer (``buffered_future_mask``), and ``--checkpoint-activations``
# hands the recomputed layer a detached alias of that slice: both share the root's storage (and its
# version counter), so one entry per buffer version answers every layer call without a device sync.
# While the root is alive its storage is, so no other storage can have that address.
_VERIFIED_MASKS: Dict[int, tuple] = {}


def _storage_key(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def _lookup(mask: Tensor) -> bool | None:
    entry = _VERIFIED_MASKS.get(_storage_key(mask))
    if entry is None:
        return None
    root = entry[0]()
    if (
        root is None
        or root._version != entry[1]
        or mask._version != root._version
        or mask.storage_offset() != root.storage_offset()
        or mask.stride() != root.stride()
        or mask.size(0) > root.size(0)
        or mask.dtype != root.dtype
    ):
        return None
    return entry[2]  # a top-left square of a future mask is a future mask


def _remember(root: Tensor, result: bool) -> None:
    if len(_VERIFIED_MASKS) > 64:
        for key in [k for k, e in _VERIFIED_MASKS.items() if e[0]() is None]:
            del _VERIFIED_MASKS[key]
    _VERIFIED_MASKS[_storage_key(root)] = (weakref.ref(root), root._version, result)


def is_future_mask(mask: Tensor) -> bool:
    """Whether ``mask`` is exactly fairseq's causal mask ``triu(-inf, 1)`` (so ``is_causal`` is exact).

    A mask made by :func:`future_mask` (the plugin's decoders build theirs with it), a slice or an
    alias of one, is known without reading it; any other is compared once per version (one device
    sync) and remembered.
    """
    if mask.dim() != 2 or mask.size(0) != mask.size(1) or not mask.is_floating_point():
        return False
    known = _lookup(mask)
    if known is not None:
        return known
    root = mask._base
    # check (and remember) the whole buffer a top-left slice was cut from: later slices then hit the entry
    if not (
        root is not None
        and root.dim() == 2
        and root.size(0) == root.size(1)
        and mask.storage_offset() == root.storage_offset()
        and mask.stride() == root.stride()
    ):
        root = mask
    result = bool(torch.equal(root, torch.full_like(root, float("-inf")).triu(1)))
    _remember(root, result)
    return result


def is_causal_mask(mask: Tensor, declared: bool = False) -> bool:
    """Whether ``mask`` is fairseq's future mask, for the kernel's ``is_causal``.

    ``declared``: the caller's decoder declared its self-attention masks to be its future mask
    (:func:`.attention.declare_target_padding`). Eager PyTorch checks anyway (:func:`is_future_mask`: a lookup,
    no device read, for the plugin decoders' masks); a graph being compiled cannot look at values
    and identities, so there the declaration stands for the check (no graph break).
    """
    if declared and torch.compiler.is_compiling():
        return mask.dim() == 2 and mask.is_floating_point()
    return is_future_mask(mask)


def future_mask(size: int, like: Tensor) -> Tensor:
    """fairseq's decoder future mask ``triu(-inf, 1)`` of ``size x size`` in ``like``'s dtype and device,
    remembered as such: :func:`is_future_mask` answers for it, its slices and aliases without a
    device read (on a GPU, no sync; on the ``meta`` device, where nothing can be read, at all)."""
    mask = torch.full((size, size), float("-inf"), dtype=like.dtype, device=like.device).triu(1)
    if not torch.compiler.is_compiling():  # a compiled graph relies on the declaration (is_causal_mask)
        _remember(mask, True)
    return mask
