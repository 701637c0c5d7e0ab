"""DyT (Zhu, Chen, He, LeCun, Liu 2025, "Transformers without Normalization") and Derf (Chen, Lu, Zhu, Sun,
Liu 2025, "Stronger Normalization-Free Transformers"): point-wise functions in place of every norm.

DyT, jiachenzhu/DyT (commit aab5dde) ``dynamic_tanh.py:6-23``::

    alpha = ones(1) * alpha_init_value   # scalar, alpha_init_value=0.5
    weight = ones(C); bias = zeros(C)
    y = tanh(alpha * x) * weight + bias

``convert_ln_to_dyt`` (``29-36``) swaps every ``nn.LayerNorm``; the fairseq patch for wav2vec 2.0
(``other_tasks/wav2vec2/dynamic-tanh.patch``) does the same for fairseq's layer norms with alpha 0.5.

DyT's LLaMA variant, ``other_tasks/LLaMA/fms_fsdp/models/llama.py``:

- ``LayerNormParameterized`` (``32-46``): ``weight * tanh(alpha * x)``, **no bias**, weight 1;
- a separate alpha init per position: ``attn_alpha_init_value`` (block's attention norm ``ln``,
  ``85-88``), ``ffn_alpha_init_value`` (``ff_ln``, ``89-92``), ``dec_alpha_init_value`` (final
  ``dec_norm``, ``245-248``); config defaults 1.0 (``73-75``); the README's values per model size are
  :data:`LLAMA_ALPHA_INIT`;
- a learnable scalar after the embedding, ``shared_scale`` (``208-209``), initialised to ``sqrt(emb_dim)``
  (``275``, ``451``) and applied as ``x = self.shared(x_in) * self.shared_scale`` (``383``);
- the rest of the model keeps fms' init (``normal(0, 0.02)``, checked by ``validate_reset_parameters``,
  ``284-309``) and the baseline's learning rate (README: 3e-4 for 7B/13B, 1.5e-4 for 34B/70B).

Derf, zlab-princeton/Derf (commit 8dd9ea3) ``ViT/dynamic_erf.py:6-26``::

    y = erf(alpha * x + shift) * weight + bias   # alpha init 0.5, shift init 0 (both scalars)

and ``language model/model_derf.patch`` (nanoGPT/GPT-2): ``Dynamic_erf`` / ``DynamicTanh`` with per-position
alpha inits ``attn_alpha_init_value``/``ffn_alpha_init_value``/``dec_alpha_init_value`` (config defaults
1.0) and ``shared_scale = sqrt(n_embd)`` applied to ``tok_emb + pos_emb`` before dropout.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

DYT_ALPHA_INIT = 0.5  # dynamic_tanh.py:7
DERF_ALPHA_INIT = 0.5  # ViT/dynamic_erf.py:7
DERF_SHIFT_INIT = 0.0  # ViT/dynamic_erf.py:7

#: README (other_tasks/LLaMA/README.md) values (attn, ffn, dec) and the config's width/depth
#: (fms_fsdp/utils/config_utils.py).
LLAMA_ALPHA_INIT = {
    "llama2_7b": {"width": 4096, "layers": 32, "attn": 0.8, "ffn": 0.2, "dec": 0.2},
    "llama2_13b": {"width": 5120, "layers": 40, "attn": 0.6, "ffn": 0.15, "dec": 0.15},
    "llama2_34b": {"width": 8192, "layers": 48, "attn": 0.2, "ffn": 0.05, "dec": 0.05},
    "llama2_70b": {"width": 8192, "layers": 80, "attn": 0.2, "ffn": 0.05, "dec": 0.05},
}


def dyt(x: Tensor, alpha: Tensor | float, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """``tanh(alpha * x) * weight + bias`` (``dynamic_tanh.py:17-23``, channels-last)."""
    y = torch.tanh(alpha * x)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def dyt_llama(x: Tensor, alpha: Tensor | float, weight: Tensor | None = None) -> Tensor:
    """``weight * tanh(alpha * x)`` without bias (``llama.py:45-46``)."""
    y = torch.tanh(alpha * x)
    return y if weight is None else weight * y


def derf(
    x: Tensor,
    alpha: Tensor | float,
    shift: Tensor | float = 0.0,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """``erf(alpha * x + shift) * weight + bias`` (``ViT/dynamic_erf.py:19-26``)."""
    y = torch.erf(alpha * x + shift)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def init_params(kind: str, size: int, alpha_init: float | None = None, dtype=torch.float64) -> dict[str, Tensor]:
    """Parameters at init: ``kind`` is ``"dyt"``, ``"dyt_llama"`` or ``"derf"``."""
    if kind == "dyt":
        a = DYT_ALPHA_INIT if alpha_init is None else alpha_init
        return {"alpha": torch.full((1,), a, dtype=dtype), "weight": torch.ones(size, dtype=dtype),
                "bias": torch.zeros(size, dtype=dtype)}  # fmt: skip
    if kind == "dyt_llama":
        a = 1.0 if alpha_init is None else alpha_init  # LLaMAConfig defaults, llama.py:73-75
        return {"alpha": torch.full((1,), a, dtype=dtype), "weight": torch.ones(size, dtype=dtype)}
    if kind == "derf":
        a = DERF_ALPHA_INIT if alpha_init is None else alpha_init
        return {"alpha": torch.full((1,), a, dtype=dtype), "shift": torch.full((1,), DERF_SHIFT_INIT, dtype=dtype),
                "weight": torch.ones(size, dtype=dtype), "bias": torch.zeros(size, dtype=dtype)}  # fmt: skip
    raise ValueError(f"unknown kind {kind!r}")


def embedding_scale_init(d_model: int) -> float:
    """``shared_scale`` init ``sqrt(d)`` (DyT ``llama.py:209``; Derf ``model_derf.patch``)."""
    return math.sqrt(d_model)


def embed_llama(tok: Tensor, shared_scale: Tensor | float) -> Tensor:
    """``shared(x_in) * shared_scale`` (``llama.py:383``; RoPE model, no absolute positions)."""
    return tok * shared_scale


def embed_gpt2(tok: Tensor, pos: Tensor, shared_scale: Tensor | float) -> Tensor:
    """``(tok_emb + pos_emb) * shared_scale`` before dropout (Derf ``model_derf.patch``, ``GPT.forward``)."""
    return (tok + pos) * shared_scale


def alpha_init_for(position: str, model: str) -> float:
    """README alpha init of ``position`` (``"attn"``, ``"ffn"``, ``"dec"``) for a released LLaMA size."""
    return LLAMA_ALPHA_INIT[model][position]
