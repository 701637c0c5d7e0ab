"""QK-Norm (Dehghani et al. 2023): normalise queries and keys before the dot product.

Two scopes exist in released code, both ported here on top of :func:`ports.common.attention`:

- ``"head"``: one norm over ``head_dim``, shared by all heads, applied after the head split.
  HF transformers ``models/qwen3/modeling_qwen3.py`` (commit 000c33f) ``Qwen3Attention.__init__``:
  ``self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)`` ("unlike olmo, only on the
  head dim!") and ``Qwen3Attention.forward``: ``q_norm(q_proj(x).view(..., -1, head_dim))``;
  HF ``models/gemma3/modeling_gemma3.py`` (commit 0018aa6) ``Gemma3Attention`` (``q_norm``/``k_norm``
  of size ``head_dim``, ``Gemma3RMSNorm`` weight initialised to zeros and used as ``1 + weight``,
  softmax scale ``query_pre_attn_scalar ** -0.5``); Megatron-LM ``qk_layernorm``
  (``hidden_size=self.hidden_size_per_attention_head``); OLMo-core ``use_head_qk_norm=True``
  (``src/olmo_core/nn/attention/__init__.py:414-416, 604-608``, commit fa6c501).
- ``"proj"``: one norm over the whole projection (``n_heads * head_dim`` for q,
  ``n_kv_heads * head_dim`` for k), applied before the head split. allenai/OLMo ``olmo/model.py:432-441``
  (commit 59a53e3: ``k_norm`` of size ``(d_model // n_heads) * effective_n_kv_heads``, ``q_norm`` of size
  ``d_model``) and ``603-605`` (``q = self.q_norm(q).to(dtype)`` before ``view``); HF
  ``models/olmo2/modeling_olmo2.py`` ``Olmo2Attention`` (``Olmo2RMSNorm(num_attention_heads * head_dim)``);
  OLMo-core ``attention/__init__.py:417-421, 589-593`` (the OLMo 2 default, ``use_head_qk_norm=False``).

In every cited implementation the norm sits before RoPE and before the softmax scale
``head_dim ** -0.5`` (Gemma 3: ``query_pre_attn_scalar ** -0.5``). fairseq has no RoPE (positions are
added to the embeddings), so in the plugin the norm directly precedes the scaled dot product; it must
act on ``q_proj(x)`` *before* fairseq's ``q *= self.scaling`` (``multihead_attention.py:602``): an RMS
norm after that line would cancel the scale exactly (scale invariance, up to eps).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .common import AttnWeights, Norm, NormSpec, attention, layer_norm, rms_norm

SCOPES = ("head", "proj")

#: Released defaults of the norm in each implementation (kind, eps, affine).
RELEASED_DEFAULTS = {
    "qwen3": ("rms", 1e-6, "weight"),  # Qwen3Config.rms_norm_eps
    "gemma3": ("rms", 1e-6, "1+weight"),  # Gemma3RMSNorm(dim, eps=1e-6), weight zeros
    "olmo2": ("rms", 1e-6, "weight"),  # OLMo-core olmo2_* configs: layer_norm_eps=1e-6, rms
    "olmo_v1": ("layer", 1e-5, "weight+bias"),  # ModelConfig.layer_norm_eps=1e-05, layer_norm_type default
    "hybridnorm": ("rms", 1e-5, "weight"),  # HybridNorm configs/exps/1.2B-dense-HybriedNorm.yaml
}


def norm_size(scope: str, n_heads: int, head_dim: int, n_kv_heads: int | None = None, which: str = "q") -> int:
    """Number of features one q (or k) norm normalises: ``head_dim`` or the whole projection."""
    if scope == "head":
        return head_dim
    if scope == "proj":
        heads = n_heads if which == "q" or n_kv_heads is None else n_kv_heads
        return heads * head_dim
    raise ValueError(f"unknown scope {scope!r}")


def init_norm(
    scope: str, n_heads: int, head_dim: int, kind: str = "rms", eps: float = 1e-6, bias: bool = False
) -> NormSpec:
    """The norm at initialisation: unit gain (Gemma stores it as a zero offset), zero bias if any."""
    size = norm_size(scope, n_heads, head_dim)
    return NormSpec(
        kind, torch.ones(size, dtype=torch.float64), torch.zeros(size, dtype=torch.float64) if bias else None, eps
    )


def normalize_qk(q: Tensor, k: Tensor, n_heads: int, scope: str, q_norm: Norm, k_norm: Norm) -> tuple[Tensor, Tensor]:
    """``(q_hat, k_hat)`` of shape ``(B, T, C)`` from raw projections ``(B, T, C)``."""
    if scope == "proj":
        return q_norm(q), k_norm(k)
    if scope != "head":
        raise ValueError(f"unknown scope {scope!r}")
    B, T, C = q.shape
    S = k.shape[1]
    dh = C // n_heads
    qh = q_norm(q.reshape(B, T, n_heads, dh)).reshape(B, T, C)
    kh = k_norm(k.reshape(B, S, n_heads, dh)).reshape(B, S, C)
    return qh, kh


def qk_norm_attention(
    x_q: Tensor,
    x_kv: Tensor,
    w: AttnWeights,
    n_heads: int,
    scope: str,
    q_norm: Norm,
    k_norm: Norm,
    **kwargs,
):
    """Self- (``x_kv is x_q``) or cross-attention with QK-Norm; same keywords as ``common.attention``.

    Cross-attention (encoder-decoder) is this project's extension: the decoder's queries and the
    encoder's keys get their own ``q_norm``/``k_norm`` per attention block, as self-attention does.
    """
    return attention(x_q, x_kv, w, n_heads, q_norm=q_norm, k_norm=k_norm, norm_scope=scope, **kwargs)


def max_logit_bound(scope: str, n_heads: int, head_dim: int, scale: float | None = None) -> float:
    """Upper bound of ``|scale * q_hat_h . k_hat_h|`` at init (unit gains, zero bias, eps -> 0).

    A RMS- or Layer-normalised vector of ``n`` features has squared L2 norm ``n``. Per head
    (``"head"``) each ``q_hat_h`` has norm ``sqrt(head_dim)``, so Cauchy-Schwarz bounds the logit by
    ``scale * head_dim`` (``sqrt(head_dim)`` with the default scale). With ``"proj"`` only the whole
    vector has norm ``sqrt(n_heads * head_dim)``; one head can carry all of it: the bound is
    ``scale * n_heads * head_dim``. Equality when q = k and all energy sits in one head.
    """
    s = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if scope == "head":
        return s * head_dim
    if scope == "proj":
        return s * n_heads * head_dim
    raise ValueError(f"unknown scope {scope!r}")


def released_norm(name: str, size: int) -> NormSpec:
    """The released implementation's q/k norm at init (Gemma's zero offset expressed as unit gain)."""
    kind, eps, affine = RELEASED_DEFAULTS[name]
    w = torch.ones(size, dtype=torch.float64)
    b = torch.zeros(size, dtype=torch.float64) if affine == "weight+bias" else None
    return NormSpec(kind, w, b, eps)


__all__ = [
    "SCOPES",
    "RELEASED_DEFAULTS",
    "norm_size",
    "init_norm",
    "normalize_qk",
    "qk_norm_attention",
    "max_logit_bound",
    "released_norm",
    "layer_norm",
    "rms_norm",
]
