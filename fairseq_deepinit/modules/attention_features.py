"""An attention with an output gate, learned sinks, a value mix and a logit soft-cap, on both attention paths.

One class, :class:`FeatureAttention`, the plugin's SDPA attention (:mod:`.attention`: fairseq's
projections, key/value cache and beamable encoder cache, computed by the plugin) with three optional
parts, each read where its formula acts (``(B, H, T, dh)`` per head; ``x`` the attention's query-side
input, ``(T, B, C)``):

- ``gate`` (:class:`AttentionGate`), gated attention (Qiu et al. 2025, arXiv 2505.06708, the G1 position):
  ``o_h <- o_h * sigmoid(g_h(x))`` after the softmax-weighted sum (after SDPA) and before the head merge
  and ``out_proj``; ``g = W_g x + b_g`` with ``H`` outputs (headwise) or ``H dh`` (elementwise); the
  sigmoid in at least float32 (OLMo-core @ fa6c501 ``src/olmo_core/nn/attention/__init__.py:636-654``;
  qiuzh20/gated_attention @ 49645df ``modeling_qwen3.py:353-360``);
- ``sinks`` (an ``(H,)`` parameter), learned attention sinks (gpt-oss @ 7b58334
  ``gpt_oss/torch/model.py:153-173``; x-transformers @ 9252ed7 ``x_transformers/attend.py:592-628``):
  ``p_ij = exp(l_ij) / (exp(s_h) + sum_k exp(l_ik))``, a logit with no value in every row's denominator;
- ``value_source`` (:class:`FirstValues`), ResFormer's value residual (Zcchill/Value-Residual-Learning
  @ 95652f6 ``src/modeling/modeling_llama_resformer.py:375-381``): the first layer's self-attention
  records its projected values ``V_1``; a later layer's self-attention attends with
  ``lam V_1 + (1 - lam) V_l`` (before the head split and the cache: the cache holds mixed values, as
  released), ``lam`` fixed (0.5 released) or, learned, ``1 - sigmoid(W_m x + b_m)`` per token and head
  (x-transformers ``x_transformers.py:2079-2085, 2296-2302``: ``v1.lerp(v, mix)``);
- ``softcap`` (a float ``c``), attention logit soft-capping (Gemma 2; google-deepmind/gemma @ 7691fd4
  ``gemma/gm/nn/_modules.py:254-256``): ``l_ij <- c tanh(l_ij / c)`` on the scaled logits, before the masks, in
  at least float32. The capped logits must exist as a tensor, so an attention with a cap always takes the
  explicit core (``F.scaled_dot_product_attention`` has no hook on the logits; its record refuses
  ``--attention-impl sdpa``).

The core (:meth:`FeatureAttention._attend`) is fairseq's explicit path under ``--attention-impl fairseq``
(``fairseq/modules/multihead_attention.py:602-773``: ``q * scaling``, scores, ``attn_mask`` added, key padding
``-inf``, the softmax in float32 as ``utils.softmax`` (float64 kept), dropout, weighted sum; the soft-cap before
the masks; the sink column appended after the masks and dropped before dropout) and
``F.scaled_dot_product_attention`` under ``sdpa``.
The sink through the fused kernel, exact: one more head dimension, ``q' = [q, 1]``, keys ``[k, 0]`` and a sink key
``[0, s_h / scale]`` with value 0 prepended, so ``scale q' . k'_sink = s_h``, and ``q'``, ``k'``, ``v`` padded to
one width divisible by 8 (:func:`sink_head_width`; ``q'`` with ones, the keys and ``v`` with zeros), so that CUDA
runs a fused kernel in the autocast dtype rather than its fp32 math backend; a boolean or float mask gets a kept
column for it; a causal call keeps ``is_causal`` (no mask tensor) by prepending one query too, which only sees the
sink key under the kernel's upper-left alignment and is dropped (each real query then sees the sink and its own
prefix). Calls that return attention weights (fairseq's alignment) take the explicit core on either path.

A layer's attention becomes a :class:`FeatureAttention` by :func:`feature_attention` (same object,
same parameters, buffers and hooks; the parts added as submodules after fairseq's, so the stock
parameters keep their names and order). fairseq's own forward is never used: configurations it alone
handles (``add_bias_kv``, ``add_zero_attn``, ``--cross-self-attention``, xFormers, ONNX tracing) are
refused when the attention is converted.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.modules.multihead_attention import MultiheadAttention
from torch import Tensor

from .attention import SDPAMultiheadAttention
from .masks import kernel_mask

GATE_KINDS = ("headwise", "elementwise")
SINK_WIDTH_MULTIPLE = 8  # CUDA's fused attention kernels take 16-bit head widths divisible by 8 (sink_head_width)


def _fp32_or_wider(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float64 else t.float()


class AttentionGate(nn.Module):
    """``sigmoid(W_g x + b_g)`` per head (``headwise``: ``H`` outputs) or per element (``H dh``), computed in
    at least float32, broadcast over ``(B, H, T, dh)``."""

    def __init__(self, embed_dim: int, num_heads: int, kind: str, bias: bool = True) -> None:
        super().__init__()
        if kind not in GATE_KINDS:
            raise ValueError(f"unknown gate kind {kind!r}; choose from {', '.join(GATE_KINDS)}")
        self.kind, self.num_heads = kind, num_heads
        self.proj = nn.Linear(embed_dim, num_heads if kind == "headwise" else embed_dim, bias=bias)

    def forward(self, out: Tensor, x: Tensor) -> Tensor:
        """``out`` ``(B, H, T, dh)`` gated by the query-side input ``x`` ``(T, B, C)``."""
        g = self.proj(x)  # (T, B, H) or (T, B, H*dh)
        g = g.view(g.size(0), g.size(1), self.num_heads, -1).permute(1, 2, 0, 3)  # (B, H, T, 1 or dh)
        return out * torch.sigmoid(_fp32_or_wider(g)).to(out.dtype)


class FirstValues:
    """The first layer's self-attention values of a stack, shared by its layers' self-attentions.

    The stack's first layer records ``V_1 = v_proj(x)`` of the current forward (of the current step in
    incremental decoding) and every later layer reads it in the same forward; layers run in order, so
    what is read is always this forward's (LayerDrop and activation checkpointing, which break that, are
    refused by the record). Holds a tensor, no parameter: nothing in the state dict.
    """

    def __init__(self) -> None:
        self.values: Tensor | None = None


class ValueMix(nn.Module):
    """A later layer's ``lam V_1 + (1 - lam) V_l``: ``lam`` fixed, or learned per token and head
    ``1 - sigmoid(W_m x + b_m)`` (x-transformers' ``v1.lerp(v, mix)``, ``mix`` the weight of the own values)."""

    def __init__(self, source: FirstValues, lam: float, learned: bool, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.source, self.lam, self.num_heads = source, lam, num_heads
        self.mix = nn.Linear(embed_dim, num_heads) if learned else None

    def forward(self, v: Tensor, x: Tensor) -> Tensor:
        v1 = self.source.values
        if v1 is None:
            raise RuntimeError("value residual: the stack's first layer did not run before this one")
        if self.mix is None:
            return self.lam * v1 + (1.0 - self.lam) * v
        m = torch.sigmoid(self.mix(x)).to(v.dtype)  # (T, B, H): the own values' weight
        m = m.repeat_interleave(v.size(-1) // self.num_heads, dim=-1)
        return v1 + m * (v - v1)


class FeatureAttention(SDPAMultiheadAttention):
    """The plugin's attention with ``gate``, ``sinks`` and a value mix (module docstring); ``fused``: the
    core is ``F.scaled_dot_product_attention`` (``--attention-impl sdpa``), else fairseq's explicit path."""

    fused: bool
    gate: AttentionGate | None
    sinks: nn.Parameter | None
    value_source: FirstValues | None  # the first layer's: it records V_1
    value_mix: ValueMix | None  # a later layer's: it mixes
    softcap: float | None  # c of c tanh(l / c) on the logits

    def forward(
        self,
        query: Tensor,
        key: Tensor | None,
        value: Tensor | None,
        key_padding_mask: Tensor | None = None,
        incremental_state=None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Tensor | None = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Tensor | None]:
        if before_softmax:
            raise NotImplementedError("before_softmax with a gated / sink / value-residual attention")
        if self.encoder_decoder_attention and not static_kv:
            raise NotImplementedError("an encoder-decoder attention with gates or sinks needs static_kv")
        return self._sdpa_forward(
            query, key, key_padding_mask, incremental_state, static_kv, attn_mask, need_weights, need_head_weights
        )

    def _values(self, x: Tensor) -> Tensor:
        v = self.v_proj(x)
        if self.value_source is not None:
            self.value_source.values = v
        if self.value_mix is not None:
            v = self.value_mix(v, x)
        return v

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, key_padding_mask: Tensor | None, weights: bool
    ) -> Tuple[Tensor, Tensor | None]:
        if weights or not self.fused or self.softcap is not None:
            return self._explicit(q, k, v, attn_mask, key_padding_mask, weights)
        if self.sinks is None:
            return super()._attend(q, k, v, attn_mask, key_padding_mask, weights)
        return self._sdpa_with_sinks(q, k, v, attn_mask, key_padding_mask), None

    def _explicit(
        self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, key_padding_mask: Tensor | None, weights: bool
    ) -> Tuple[Tensor, Tensor | None]:
        """fairseq's explicit path (lines 602-773) on ``(B, H, T, dh)``, the soft-cap before the masks (Gemma's
        order), the sink column after them."""
        logits = torch.matmul(q * self.scaling, k.transpose(-1, -2))  # (B, H, T, S)
        if self.softcap is not None:  # in float32 or wider: the softmax below is taken there anyway
            logits = self.softcap * torch.tanh(_fp32_or_wider(logits) / self.softcap)
        if attn_mask is not None:
            logits = logits + attn_mask.unsqueeze(0).unsqueeze(0).to(logits.dtype)
        if key_padding_mask is not None:
            pad = key_padding_mask.to(torch.bool).view(k.size(0), 1, 1, k.size(2))
            logits = logits.masked_fill(pad, float("-inf"))
        if self.sinks is not None:
            col = self.sinks.to(logits.dtype).view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
            logits = torch.cat([logits, col], dim=-1)
        probs_float = torch.softmax(_fp32_or_wider(logits), dim=-1)  # fairseq's utils.softmax, float64 kept
        if self.sinks is not None:
            probs_float = probs_float[..., :-1]
        probs = self.dropout_module(probs_float.to(q.dtype))
        return torch.matmul(probs.to(v.dtype), v), (probs_float if weights else None)

    def _sdpa_with_sinks(
        self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, key_padding_mask: Tensor | None
    ) -> Tensor:
        """The sink as a prepended key in a head width padded to :func:`sink_head_width` (module docstring)."""
        dh = q.size(-1)
        width = sink_head_width(dh)
        mask, is_causal = kernel_mask(
            attn_mask,
            key_padding_mask,
            q.size(2),
            k.size(2),
            q.dtype,
            declared_future=self.causal_self_attention,
            right_padded=self.causal_right_padded,
        )
        # q's padding columns are 1 and the real keys' 0, so only the sink key's coordinate dh (s_h / scale) meets
        # them: scale * q2 . k2[0] = s_h. Under is_causal one query in front (dropped): with it, upper-left causal
        # is the sink plus the own prefix.
        q2 = F.pad(q, (0, width - dh, int(is_causal), 0), value=1.0)
        sink_key = F.pad((self.sinks.to(k.dtype) / self.scaling).view(1, -1, 1, 1), (dh, width - dh - 1))
        k2 = torch.cat([sink_key.expand(k.size(0), -1, 1, -1), F.pad(k, (0, width - dh))], dim=2)
        v2 = F.pad(v, (0, width - v.size(-1), 1, 0))  # its value 0; q, k, v of one width, as the fused kernels need
        if mask is not None:
            keep = mask.new_ones(1) if mask.dtype == torch.bool else mask.new_zeros(1)  # the sink's column: kept
            mask = torch.cat([keep.expand(*mask.shape[:-1], 1), mask], dim=-1)
        out = F.scaled_dot_product_attention(
            q2, k2, v2, attn_mask=mask, dropout_p=self._dropout_p(), is_causal=is_causal, scale=self.scaling
        )
        return out[:, :, int(is_causal) :, : v.size(-1)]

    def _output(self, out: Tensor, query: Tensor) -> Tensor:
        if self.gate is not None:
            out = self.gate(out, query)
        return super()._output(out, query)


def sink_head_width(dh: int) -> int:
    """The head width of the sink form through ``F.scaled_dot_product_attention``: ``dh + 1`` (the sink's
    coordinate) rounded up to a multiple of 8, the widths CUDA's flash and memory-efficient kernels take in
    16-bit (torch ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``: ``check_head_dim_size_flash`` wants
    ``q``, ``k``, ``v`` of one width, ``check_head_dim_size_mem_efficient`` widths divisible by 8); any other
    width runs the math backend, which computes bf16 attention in fp32. The keys' padding is zeros: no dot
    product changes."""
    return -(-(dh + 1) // SINK_WIDTH_MULTIPLE) * SINK_WIDTH_MULTIPLE


def feature_attention(attn: MultiheadAttention) -> FeatureAttention:
    """``attn`` (fairseq's class or the plugin's SDPA one, as the layer built it) as a :class:`FeatureAttention`,
    the same module with no part yet; a no-op on one already converted. The core follows the class it
    was built in: fused for the SDPA class, fairseq's explicit path otherwise."""
    if isinstance(attn, FeatureAttention):
        return attn
    if type(attn) not in (MultiheadAttention, SDPAMultiheadAttention):
        raise TypeError(f"gates, sinks and value residual apply to fairseq's attention, not {type(attn).__name__}")
    if attn.bias_k is not None or attn.add_zero_attn or attn.use_xformers:
        raise ValueError("gates, sinks and value residual do not apply with add_bias_kv, add_zero_attn or xFormers")
    if not (attn.self_attention or attn.encoder_decoder_attention):
        raise ValueError("gates, sinks and value residual do not apply to --cross-self-attention")
    fused = type(attn) is SDPAMultiheadAttention
    attn.__class__ = FeatureAttention  # the module fairseq built, its parameters, buffers and hooks kept
    attn.fused = fused
    attn.gate = None
    attn.sinks = None
    attn.value_source = None
    attn.value_mix = None
    attn.softcap = None
    return attn


__all__ = [
    "GATE_KINDS",
    "SINK_WIDTH_MULTIPLE",
    "AttentionGate",
    "FeatureAttention",
    "FirstValues",
    "ValueMix",
    "feature_attention",
    "sink_head_width",
]
