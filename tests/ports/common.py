"""Plain building blocks with explicit weights: norms, multi-head attention, feed-forward network.

Conventions follow fairseq 0.12's own modules, which every plugin layer is compared against:

- attention (``fairseq/modules/multihead_attention.py:575-602``): ``q = q_proj(x)``, ``k = k_proj(kv)``,
  ``v = v_proj(kv)``, then ``q *= head_dim ** -0.5`` before the per-head dot product; the softmax runs
  in float32 (``fairseq/utils.py: softmax`` upcasts); ``key_padding_mask`` is True at padding;
- feed-forward (``fairseq/modules/transformer_layer.py``): ``fc2(activation(fc1(x)))``, ReLU by default;
- ``LayerNorm`` is ``torch.nn.LayerNorm`` (biased variance, eps 1e-5, weight and bias).

Tensors are batch-first ``(B, T, C)``. Norms compute in at least float32 and return the input dtype
(what every released implementation cited in the ports does for RMSNorm; fairseq's LayerNorm under
``--fp16`` does the same inside the kernel).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

Norm = Callable[[Tensor], Tensor]


def identity(x: Tensor) -> Tensor:
    return x


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension, biased variance."""
    y = x.to(_compute_dtype(x))
    mean = y.mean(-1, keepdim=True)
    var = (y - mean).pow(2).mean(-1, keepdim=True)
    y = (y - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6, rounding: str = "olmo") -> Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension.

    ``rounding`` picks where the released code casts back to the input dtype (identical in float32):

    - ``"olmo"``: OLMo ``RMSLayerNorm`` (allenai/OLMo ``olmo/model.py`` ``RMSLayerNorm.forward``) and
      HF ``Qwen3RMSNorm``: normalise in float32, cast, then multiply by ``weight``;
    - ``"olmo2_hf"``: HF ``Olmo2RMSNorm``: ``(weight * x_fp32).to(dtype)``;
    - ``"gemma3"``: HF ``Gemma3RMSNorm``: ``(x_fp32 * (1 + weight)).type_as(x)``; ``weight`` is the
      zero-initialised offset, so a Gemma norm with ``weight = w - 1`` equals the others with ``w``.
    """
    y = x.to(_compute_dtype(x))
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    if rounding == "olmo":
        y = y.to(x.dtype)
        return y if weight is None else y * weight.to(x.dtype)
    if rounding == "olmo2_hf":
        return (y if weight is None else y * weight.to(y.dtype)).to(x.dtype)
    if rounding == "gemma3":
        w = torch.zeros(x.shape[-1], dtype=y.dtype) if weight is None else weight.to(y.dtype)
        return (y * (1.0 + w)).to(x.dtype)
    raise ValueError(f"unknown rounding {rounding!r}")


@dataclass
class NormSpec:
    """A norm with explicit parameters: ``kind`` is ``"layer"``, ``"rms"`` or ``"none"``."""

    kind: str = "layer"
    weight: Tensor | None = None
    bias: Tensor | None = None
    eps: float = 1e-5
    rounding: str = "olmo"

    def __call__(self, x: Tensor) -> Tensor:
        if self.kind == "layer":
            return layer_norm(x, self.weight, self.bias, self.eps)
        if self.kind == "rms":
            y = rms_norm(x, self.weight, self.eps, self.rounding)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        if self.kind == "none":
            return x
        raise ValueError(f"unknown norm kind {self.kind!r}")

    @classmethod
    def from_module(cls, m: torch.nn.Module) -> NormSpec:
        """Read ``weight``/``bias``/``eps`` of a ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` by duck typing."""
        kind = "rms" if type(m).__name__.lower().startswith("rms") else "layer"
        w = getattr(m, "weight", None)
        b = getattr(m, "bias", None)
        eps = getattr(m, "eps", None)
        if eps is None:
            eps = 1e-5 if kind == "layer" else 1e-6
        return cls(kind, None if w is None else w.detach(), None if b is None else b.detach(), float(eps))


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    return F.linear(x, w, b)


@dataclass
class AttnWeights:
    """Projection weights of one attention block, ``(out_features, in_features)`` as in ``nn.Linear``."""

    wq: Tensor
    wk: Tensor
    wv: Tensor
    wo: Tensor
    bq: Tensor | None = None
    bk: Tensor | None = None
    bv: Tensor | None = None
    bo: Tensor | None = None

    @classmethod
    def from_module(cls, m: torch.nn.Module) -> AttnWeights:
        """Read fairseq ``MultiheadAttention`` parameters (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``)."""

        def wb(lin):
            return lin.weight.detach(), None if lin.bias is None else lin.bias.detach()

        (wq, bq), (wk, bk), (wv, bv), (wo, bo) = (wb(m.q_proj), wb(m.k_proj), wb(m.v_proj), wb(m.out_proj))
        return cls(wq, wk, wv, wo, bq, bk, bv, bo)

    @classmethod
    def random(cls, d: int, generator: torch.Generator, dtype=torch.float64, std: float | None = None) -> AttnWeights:
        s = d**-0.5 if std is None else std
        t = [torch.randn(d, d, generator=generator, dtype=dtype) * s for _ in range(4)]
        b = [torch.randn(d, generator=generator, dtype=dtype) * 0.1 for _ in range(4)]
        return cls(t[0], t[1], t[2], t[3], b[0], b[1], b[2], b[3])


@dataclass
class FFNWeights:
    """``fc2(activation(fc1(x)))`` as in fairseq's transformer layers."""

    w1: Tensor
    w2: Tensor
    b1: Tensor | None = None
    b2: Tensor | None = None
    activation: str = "relu"

    @classmethod
    def from_module(cls, layer: torch.nn.Module, activation: str = "relu") -> FFNWeights:
        """Read ``fc1`` and ``fc2`` of a fairseq transformer layer."""
        f1, f2 = layer.fc1, layer.fc2
        return cls(
            f1.weight.detach(),
            f2.weight.detach(),
            None if f1.bias is None else f1.bias.detach(),
            None if f2.bias is None else f2.bias.detach(),
            activation,
        )

    @classmethod
    def random(cls, d: int, d_ff: int, generator: torch.Generator, dtype=torch.float64) -> FFNWeights:
        return cls(
            torch.randn(d_ff, d, generator=generator, dtype=dtype) * d**-0.5,
            torch.randn(d, d_ff, generator=generator, dtype=dtype) * d_ff**-0.5,
            torch.randn(d_ff, generator=generator, dtype=dtype) * 0.1,
            torch.randn(d, generator=generator, dtype=dtype) * 0.1,
        )


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def ffn(x: Tensor, w: FFNWeights) -> Tensor:
    return linear(_ACTIVATIONS[w.activation](linear(x, w.w1, w.b1)), w.w2, w.b2)


def attention(
    x_q: Tensor,
    x_kv: Tensor,
    w: AttnWeights,
    n_heads: int,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    q_norm: Norm | None = None,
    k_norm: Norm | None = None,
    v_norm: Norm | None = None,
    ctx_norm: Norm | None = None,
    norm_scope: str = "head",
    scale: float | None = None,
    gate: Tensor | None = None,
    sink: Tensor | None = None,
    v_fn: Callable[[Tensor], Tensor] | None = None,
    return_logits: bool = False,
):
    """Multi-head attention with optional q/k/v/context norms; returns ``out`` or ``(out, logits)``.

    ``norm_scope="head"`` normalises each head's ``head_dim`` slice (Qwen3, Gemma 3, Megatron
    ``qk_layernorm``, HybridNorm); ``"proj"`` normalises the whole projection before the head split
    (OLMo v1/OLMo 2, see ``ports.qk_norm``). ``ctx_norm`` acts per head on the attention output
    before the output projection (HybridNorm ``c_norm``). The norms see the raw projections, before
    the softmax scale ``head_dim ** -0.5`` (or ``scale``) is applied. ``logits`` are the pre-softmax
    scores ``(B, H, T, S)`` with masked entries at ``-inf``.

    The 2025-26 additions (``ports.gated_attention``, ``ports.attention_sinks``, ``ports.value_residual``):

    - ``gate``: gate logits ``(B, T, H)`` (one per head) or ``(B, T, H * head_dim)`` (one per element);
      the per-head attention output is multiplied by ``sigmoid(gate)`` (computed in at least float32)
      after the softmax-weighted sum and before the output projection (qiuzh20/gated_attention
      ``modeling_qwen3.py:355-360``, OLMo-core ``attention/__init__.py:636-654``);
    - ``sink``: one logit per head ``(H,)`` that joins every softmax row's denominator with no value
      (gpt-oss ``gpt_oss/torch/model.py:166-171``): a row whose keys are all masked then gives 0, not NaN;
    - ``v_fn``: applied to the projected values ``(B, S, C)`` before the head split (ResFormer's value
      mix, Zcchill/Value-Residual-Learning ``modeling_llama_resformer.py:375-381``).
    """
    B, T, C = x_q.shape
    S = x_kv.shape[1]
    dh = C // n_heads
    q, k, v = linear(x_q, w.wq, w.bq), linear(x_kv, w.wk, w.bk), linear(x_kv, w.wv, w.bv)
    if v_fn is not None:
        v = v_fn(v)
    if norm_scope == "proj":
        q = q if q_norm is None else q_norm(q)
        k = k if k_norm is None else k_norm(k)
        v = v if v_norm is None else v_norm(v)
    elif norm_scope != "head":
        raise ValueError(f"unknown norm scope {norm_scope!r}")
    q = q.reshape(B, T, n_heads, dh).transpose(1, 2)
    k = k.reshape(B, S, n_heads, dh).transpose(1, 2)
    v = v.reshape(B, S, n_heads, dh).transpose(1, 2)
    if norm_scope == "head":
        q = q if q_norm is None else q_norm(q)
        k = k if k_norm is None else k_norm(k)
        v = v if v_norm is None else v_norm(v)
    s = dh**-0.5 if scale is None else scale
    logits = torch.matmul(q * s, k.transpose(-1, -2))
    masked = torch.zeros(B, 1, T, S, dtype=torch.bool)
    if causal:
        masked = masked | torch.ones(T, S, dtype=torch.bool).triu(1 + S - T)
    if key_padding_mask is not None:
        masked = masked | key_padding_mask[:, None, None, :]
    logits = logits.masked_fill(masked, float("-inf"))
    cd = _compute_dtype(logits)
    if sink is None:
        probs = torch.softmax(logits.to(cd), dim=-1).to(v.dtype)
    else:
        col = sink.to(cd).view(1, n_heads, 1, 1).expand(B, n_heads, T, 1)
        probs = torch.softmax(torch.cat([logits.to(cd), col], dim=-1), dim=-1)[..., :-1].to(v.dtype)
    ctx = torch.matmul(probs, v)
    if ctx_norm is not None:
        ctx = ctx_norm(ctx)
    if gate is not None:
        g = gate.reshape(B, T, n_heads, -1).transpose(1, 2)  # (B, H, T, 1) or (B, H, T, dh)
        ctx = ctx * torch.sigmoid(g.to(_compute_dtype(g))).to(ctx.dtype)
    out = linear(ctx.transpose(1, 2).reshape(B, T, C), w.wo, w.bo)
    return (out, logits) if return_logits else out


def default_scale(head_dim: int) -> float:
    """fairseq's ``MultiheadAttention.scaling`` (``multihead_attention.py:114``)."""
    return 1.0 / math.sqrt(head_dim)


def decoder_input(decoder: torch.nn.Module, tokens: Tensor) -> Tensor:
    """A fairseq decoder's input in eval mode, ``embed_scale * embed_tokens(tokens) + embed_positions(tokens)``
    (``fairseq/models/transformer/transformer_decoder.py``, ``extract_features_scriptable``; the compared models
    have no ``project_in_dim`` or ``layernorm_embedding``)."""
    return decoder.embed_scale * decoder.embed_tokens(tokens) + decoder.embed_positions(tokens)


def lm_layers(decoder: torch.nn.Module) -> list[dict]:
    """The layers of a fairseq decoder-only stack as the ports' ``lm_stack`` functions take them: per layer
    ``attn_w`` (``self_attn``), ``ffn_w`` (``fc1``/``fc2``), ``norm_attn`` (``self_attn_layer_norm``) and
    ``norm_ffn`` (``final_layer_norm``), whichever side of the sub-layer the port applies each norm."""
    return [
        {
            "attn_w": AttnWeights.from_module(layer.self_attn),
            "ffn_w": FFNWeights.from_module(layer),
            "norm_attn": NormSpec.from_module(layer.self_attn_layer_norm),
            "norm_ffn": NormSpec.from_module(layer.final_layer_norm),
        }
        for layer in decoder.layers
    ]
