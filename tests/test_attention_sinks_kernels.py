"""Learned attention sinks through ``F.scaled_dot_product_attention`` in bf16: the kernel a call reaches and what it
computes (``fairseq_deepinit/modules/attention_features.py``, ``FeatureAttention._sdpa_with_sinks``).

The sink form widens the head by the sink's coordinate; :func:`sink_head_width` pads ``q``, ``k`` and ``v`` to one
width divisible by 8, the widths CUDA's flash and memory-efficient kernels take in 16-bit (torch
``sdp_utils.cpp``). Any other width runs the math backend, which computes bf16 attention in fp32 (its products fp32
on CUDA and on the CPU alike). The CPU shows the difference too: its flash kernel, like CUDA's, wants ``q``, ``k``,
``v`` of one width, so a call with attention dropout 0 either runs it in bf16 or falls back to fp32 math.

Tolerance of the bf16 comparison, from the float path: the port computes in float64 from exactly the bf16 values
the kernel reads (``q``, ``k``, ``v`` and the sink key's coordinate ``bf16(s_h / scale)``, so ``s_h`` as the
kernel sees it); the kernel accumulates in fp32 (rows of at most 8 keys: error ~1e-6 relative) and rounds its
output once to bf16 (at most ``2^-9 |o|``, ``|o| <= max |v|``): atol ``2^-8 max |v|``. A sink dropped, counted
twice or a padding column read would move the output by more than 1e-1.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
from ports import attention_sinks as port
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import TINY_DIMS, build_model
from fairseq_deepinit.modules.attention_features import sink_head_width

BF16, F64 = torch.bfloat16, torch.float64
HEADS = ("--encoder-attention-heads", "4", "--decoder-attention-heads", "4")  # d_h 16: sink width 24


class Kernels(TorchDispatchMode):
    """The aten attention kernels and matrix products that ran, by (op, result dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if "attention" in name or name in ("bmm", "mm", "baddbmm"):
            first = out[0] if isinstance(out, (tuple, list)) else out
            self.seen[(name, first.dtype)] += 1
        return out


def test_sink_head_width_is_the_next_multiple_of_8_above_the_head():
    assert [sink_head_width(d) for d in (4, 7, 8, 15, 16, 64, 128)] == [8, 8, 16, 16, 24, 72, 136]


@pytest.mark.parametrize("case", ["causal", "padding"])
def test_bf16_sinks_run_the_fused_kernel_and_equal_the_port(case):
    """A decoder self-attention (``is_causal``, the dropped leading query) and a cross-attention with source padding,
    bf16 inputs, attention dropout 0: the CPU's fused flash kernel forward and backward, no matrix product
    outside it, and the output of ``ports.attention_sinks.softmax_explicit`` (gpt-oss's denominator)."""
    m, _ = build_model("sinks_iwslt_de_en", *TINY_DIMS, *HEADS, "--attention-impl", "sdpa", "--attention-dropout", "0")
    layer = m.decoder.layers[1]
    attn = layer.self_attn if case == "causal" else layer.encoder_attn
    attn.causal_self_attention = case == "causal"  # as the decoder declares it
    g = torch.Generator().manual_seed(3)
    B, H, T, S, dh = 3, attn.num_heads, 5, 5 if case == "causal" else 7, attn.head_dim
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(H, generator=g) * 2)
    q, k, v = (torch.randn(B, H, n, dh, generator=g).to(BF16).requires_grad_() for n in (T, S, S))
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[0, :2], pad[2, :1] = True, True  # left-padded sources
    future = torch.triu(torch.full((T, T), float("-inf")), 1)
    masks = (future, None) if case == "causal" else (None, pad)
    with Kernels() as kernels:
        out = attn._sdpa_with_sinks(q, k, v, *masks)
        out.float().pow(2).sum().backward()
    assert out.dtype == BF16 and out.shape == (B, H, T, dh)
    assert set(kernels.seen) == {
        ("_scaled_dot_product_flash_attention_for_cpu", BF16),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", BF16),
    }, kernels.seen

    sink = (attn.sinks.detach().to(BF16) / attn.scaling).to(F64) * attn.scaling  # the sink as the kernel reads it
    logits = attn.scaling * q.detach().to(F64) @ k.detach().to(F64).transpose(-1, -2)
    if case == "causal":
        logits = logits.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(1), -math.inf)
    else:
        logits = logits.masked_fill(pad[:, None, None, :], -math.inf)
    want = port.softmax_explicit(logits, sink) @ v.detach().to(F64)
    atol = 2.0**-8 * v.detach().abs().max().item()
    torch.testing.assert_close(out.detach().to(F64), want, rtol=0, atol=atol)
    assert (want - port.softmax_explicit(logits, sink - 4) @ v.detach().to(F64)).abs().max() > 0.1  # sensitive
