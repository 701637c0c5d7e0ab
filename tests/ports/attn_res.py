"""Attention Residuals (Kimi Team 2026, arXiv 2603.15031): Full and Block AttnRes.

Port of the release's PyTorch-style pseudocode, MoonshotAI/Attention-Residuals @ 85e2231 ``README.md:52-91``,
kept in its shape: a list ``blocks`` of completed block representations and a ``partial_block``, ``[B, T, D]``
each (the release's layout; the plugin's is ``(T, B, m, d)``)::

    def block_attn_res(blocks, partial_block, proj, norm):
        V = torch.stack(blocks + [partial_block])                               # [N+1, B, T, D]
        K = norm(V)                                                             # RMSNorm
        logits = torch.einsum('d, n b t d -> n b t', proj.weight.squeeze(), K)
        h = torch.einsum('n b t, n b t d -> b t d', logits.softmax(0), V)

    forward(blocks, hidden_states):   # one layer: attention, then MLP
        partial_block = hidden_states
        h = block_attn_res(blocks, partial_block, attn_res_proj, attn_res_norm)
        if layer_number % (block_size // 2) == 0: blocks.append(partial_block); partial_block = None
        attn_out = attn(attn_norm(h)); partial_block = partial_block + attn_out (or attn_out)
        h = block_attn_res(blocks, partial_block, mlp_res_proj, mlp_res_norm)
        mlp_out = mlp(mlp_norm(h)); partial_block = partial_block + mlp_out

The stack starts with no blocks and the embedding output as ``partial_block`` (layer 0 is a boundary, so the
embedding is the first block: "blocks already include token embedding"), and ends with one more
``block_attn_res`` with its own query and norm before the final norm (torchtitan's Kimi Linear port,
``final_attn_res_proj``). The translation decoder's cross-attention is one more sub-layer between the two
(:func:`layer`'s ``sublayers``). Full AttnRes (the README's formula): every sub-layer output is a block of its own, the
boundary check before every sub-layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``torch.nn.RMSNorm``: ``x / sqrt(mean(x^2) + eps) * weight``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@dataclass
class Query:
    """One AttnRes: the pseudo-query (``proj.weight.squeeze()``) and the key RMSNorm's weight and eps."""

    proj: Tensor
    norm_weight: Tensor
    eps: float


def block_attn_res(blocks: list[Tensor], partial_block: Tensor, q: Query) -> Tensor:
    """README.md:60-71."""
    v = torch.stack(blocks + [partial_block])
    k = rms_norm(v, q.norm_weight, q.eps)
    logits = torch.einsum("d, n b t d -> n b t", q.proj, k)
    return torch.einsum("n b t, n b t d -> b t d", logits.softmax(0), v)


def layer(
    blocks: list[Tensor],
    hidden_states: Tensor,
    sublayers: Sequence[tuple[Query, Callable[[Tensor], Tensor]]],
    boundary: Callable[[int], bool],
) -> tuple[list[Tensor], Tensor]:
    """README.md:73-91 for any number of sub-layers; ``boundary(j)``: whether the block ends before sub-layer
    ``j`` of this layer (the release: ``j == 0 and layer_number % (block_size // 2) == 0``)."""
    partial_block: Tensor | None = hidden_states
    for j, (q, branch) in enumerate(sublayers):
        assert partial_block is not None
        h = block_attn_res(blocks, partial_block, q)
        if boundary(j):
            blocks = blocks + [partial_block]
            partial_block = None
        out = branch(h)
        partial_block = out if partial_block is None else partial_block + out
    assert partial_block is not None
    return blocks, partial_block


def stack(
    x0: Tensor,
    layers: Sequence[Sequence[tuple[Query, Callable[[Tensor], Tensor]]]],
    final: Query,
    final_norm: Callable[[Tensor], Tensor],
    block_layers: int | None,
) -> Tensor:
    """A stack: no blocks, the embedding output ``x0`` as the partial block, every layer, the final aggregation
    and the final norm. ``block_layers`` None: Full AttnRes (a boundary before every sub-layer); else Block
    AttnRes with ``block_size // 2 = block_layers`` (layers numbered from 0)."""
    blocks: list[Tensor] = []
    partial = x0
    for number, sublayers in enumerate(layers):
        if block_layers is None:
            boundary: Callable[[int], bool] = lambda j: True  # noqa: E731
        else:
            boundary = lambda j, n=number: j == 0 and n % block_layers == 0  # noqa: E731
        blocks, partial = layer(blocks, partial, sublayers, boundary)
    return final_norm(block_attn_res(blocks, partial, final))
