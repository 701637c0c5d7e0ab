"""Attention Residuals (Kimi Team 2026, arXiv 2603.15031): every sub-layer reads a softmax-weighted mix of the
embedding and the earlier sub-layers' outputs (depth-wise attention with one learned pseudo-query per sub-layer),
in place of the running residual sum.

A stack with Attention Residuals carries its sources ``x`` of shape ``(T, B, m, d)`` between its sub-layers: the
completed blocks and, last, the current block's partial sum (:class:`DepthSources`: the embedding output in, one
``(T, B, d)`` aggregation out before the final norm). Each sub-layer's residual module is an
:class:`AttnResResidual`::

    h_in, V = enter(x)        # h_in = sum_i softmax_i(w . RMSNorm(V_i)) V_i over the m sources (per token)
    x'  = forward(F, V)       # opens a block: [V_1 .. V_m, F];  otherwise: [V_1 .. V_m-1, V_m + F]

with ``F = dropout(f(LN(h_in)))`` the sub-layer's branch. As released (MoonshotAI/Attention-Residuals @ 85e2231
``README.md:52-91``: ``block_attn_res``, ``V = stack(blocks + [partial_block])``, ``K = norm(V)``, ``logits =
einsum('d, n b t d -> n b t', proj.weight, K)``, ``h = einsum('n b t, n b t d -> b t d', softmax(logits, 0),
V)``; the layer's ``forward`` commits ``partial_block`` to ``blocks`` after the aggregation at a block boundary,
and starts the new partial sum from the sub-layer's output). The pseudo-query starts at zero, so that every
aggregation starts uniform (the paper's requirement, as torchtitan's port quotes it), the key norm's gain at one.
Full AttnRes opens a block at every sub-layer, so that each sub-layer output is a source of its own.

Everything is per token: incremental decoding needs no state beyond the self-attention's keys and values.
Formulas, sources and the encoder-decoder design: docs/schemes.md, "Attention Residuals".
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from .residual import Residual


def depth_attention(sources: Tensor, query: Tensor, gain: Tensor, eps: float) -> Tensor:
    """``sum_i softmax_i(q . RMSNorm_g(V_i)) V_i`` over the sources axis ``-2`` of ``sources`` ``(..., m, d)``.

    ``block_attn_res`` (README.md:60-71): keys are the RMS-normalised sources (gain ``g``, ``eps``), the logits
    their inner products with the pseudo-query ``q`` ``(d,)``. Computed as ``(V (g * q)) / rms(V)``, the same value
    without the keys: autograd keeps the sources (which the weighted sum needs anyway) and ``m`` scalars per token,
    not a normalised copy of the sources. The mean square, the logits and the softmax run in float32 at least (a
    bf16 model's weights are rounded once, after the softmax), the two products in the sources' (autocast) dtype.
    """
    wide = torch.promote_types(sources.dtype, torch.float32)  # float64 stays float64
    inv_rms = torch.rsqrt(torch.mean(sources.pow(2), dim=-1, dtype=wide) + eps)  # (..., m)
    logits = torch.matmul(sources, (gain * query).to(sources.dtype)).to(wide) * inv_rms
    weights = torch.softmax(logits, dim=-1).to(sources.dtype)
    return torch.matmul(weights.unsqueeze(-2), sources).squeeze(-2)


class DepthAttention(nn.Module):
    """One depth-wise attention: the pseudo-query ``w_l`` (zero at init) and the key norm's gain (one at init);
    the release's ``attn_res_proj`` (``Linear(d, 1, bias=False)``, its weight the query) and ``attn_res_norm``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = float(eps)
        self.pseudo_query = nn.Parameter(torch.zeros(dim))
        self.key_norm_weight = nn.Parameter(torch.ones(dim))

    def aggregate(self, sources: Tensor) -> Tensor:
        return depth_attention(sources, self.pseudo_query, self.key_norm_weight, self.eps)

    def extra_repr(self) -> str:
        return f"dim={self.pseudo_query.numel()}, eps={self.eps:g}"


class AttnResResidual(Residual, DepthAttention):
    """A sub-layer's residual on the sources: :meth:`enter` aggregates them into the branch input;
    :meth:`forward` appends the branch output as a new source where the sub-layer ``opens_block`` (set by the
    layer set-up), otherwise adds it to the last source (the current block's partial sum)."""

    def __init__(self, dim: int, eps: float, opens_block: bool = True) -> None:
        DepthAttention.__init__(self, dim, eps)
        self.opens_block = opens_block

    def enter(self, x: Tensor):
        return self.aggregate(x), x

    def scaled_skip(self, skip: Tensor) -> Tensor:
        return skip

    def forward(self, branch: Tensor, skip: Tensor) -> Tensor:  # type: ignore[override]
        if self.opens_block:
            return torch.cat((skip, branch.unsqueeze(-2)), dim=-2)
        return torch.cat((skip[..., :-1, :], (branch + skip[..., -1, :]).unsqueeze(-2)), dim=-2)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, opens_block={self.opens_block}"


class DepthSources:
    """A stack's sources: :meth:`expand` makes the embedding output the first source; :meth:`contract` is the
    stack's own last aggregation (``output``, a :class:`DepthAttention` registered on the stack) before its final
    norm, as the Kimi Linear port in torchtitan's ``attention_residual`` experiment (``final_attn_res_proj``);
    :meth:`hidden` is the sum of the sources, the value the plain residual stream would hold (the hidden states a
    stack returns beside its output)."""

    def __init__(self, output: DepthAttention) -> None:
        self.output = output

    def expand(self, x: Tensor) -> Tensor:
        """``(T, B, d) -> (T, B, 1, d)``."""
        return x.unsqueeze(-2)

    def contract(self, x: Tensor) -> Tensor:
        return self.output.aggregate(x)

    def hidden(self, x: Tensor) -> Tensor:
        return x.sum(-2)

    def measured(self, x: Tensor) -> Tensor:
        """What the depth diagnostics measure of a layer's sources: their sum (:meth:`hidden`), the same size
        whatever the number of sources."""
        return self.hidden(x)
