"""QK-Norm: a norm on the output of an attention's query and key projections, before the dot product.

Dehghani et al. 2023 ("Scaling Vision Transformers to 22 Billion Parameters", sec. 2, "QK
normalization"): ``softmax(s N_q(x W_q) N_k(x' W_k)^T) x' W_v``, ``s = head_dim^-1/2``; the values are
untouched. :class:`NormedProjection` is a Linear whose *output* goes through the norm, put in the place of
fairseq's ``q_proj`` / ``k_proj`` (:func:`add_qk_norm`), so every path that calls the projections as
modules normalises before anything else happens to q and k:

- fairseq's explicit forward (``fairseq/modules/multihead_attention.py:575-602``): ``q = self.q_proj(query)``,
  then ``q *= self.scaling`` (line 602). The norm runs before the softmax scale, as in every release (an
  RMS norm after it would cancel the scale); the incremental key cache (lines 626-672) stores keys
  already normalised, and a per-token norm commutes with concatenating steps, so step-by-step decoding
  equals the full pass;
- the plugin's SDPA forward (:mod:`.attention`): ``self.q_proj(query)``, ``self.k_proj(...)``, the cache
  in fairseq's layout, the softmax scale given to the kernel.

fairseq's fused call ``F.multi_head_attention_forward`` (lines 517-562) reads ``q_proj.weight`` directly and
would skip the norm: the attention's ``skip_embed_dim_check`` (fairseq's switch to its explicit path for
pruned heads, lines 527-531) keeps it off that call; the SDPA class ignores the switch and stays fused.

Two scopes, both in released code (the norm's parameters shared by all heads in either):

- ``"head"``: one norm over ``head_dim`` applied to each head's slice (HF ``Qwen3Attention``,
  ``Gemma3Attention``; OLMo-core ``use_head_qk_norm=True``, allenai/OLMo-core @ fa6c501
  ``src/olmo_core/nn/attention/__init__.py:414-416, 604-608``; Megatron-LM ``qk_layernorm``, HybridNorm);
- ``"proj"``: one norm over the whole projection, before the head split (allenai/OLMo @ 59a53e3
  ``olmo/model.py:432-441, 603-605``; HF ``Olmo2Attention``; OLMo-core ``__init__.py:417-421, 589-593``).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.modules.multihead_attention import MultiheadAttention

from .norms import build_norm

QK_NORM_SCOPES = ("head", "proj")
#: the norm types a q/k norm may be: RMSNorm (Qwen3, Gemma 3, OLMo 2, HybridNorm), LayerNorm (ViT-22B, OLMo
#: v1, Megatron's default), ScaleNorm (an l2 norm times one learned length g per norm, as in Henry et al. 2020,
#: "Query-Key Normalization for Transformers", which learns one g per attention for q and k together)
QK_NORM_TYPES = ("rmsnorm", "layernorm", "scalenorm")


class NormedProjection(nn.Linear):
    """``norm(F.linear(x, W, b))``, the norm over each of ``groups`` equal slices of the output features.

    ``groups = num_heads`` normalises every head's slice with the one norm (QK-Norm's ``"head"`` scope),
    ``groups = 1`` the whole output (``"proj"``). Built around an existing Linear (:meth:`around`), taking
    over its ``weight`` and ``bias`` (same tensors, same names ``<proj>.weight``, ``<proj>.bias``, then
    ``<proj>.norm.*``), so the init fairseq gave the projection and its place among the parameters stay;
    a subclass of ``nn.Linear``, so the init schemes treat it as the projection it is.
    """

    norm: nn.Module

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        norm: nn.Module,
        groups: int = 1,
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: the parameters are given, nothing is drawn
        if groups < 1 or out_features % groups:
            raise ValueError(f"{out_features} output features do not split into {groups} equal groups")
        self.in_features = in_features
        self.out_features = out_features
        self.groups = groups
        self.weight = weight
        if bias is None or isinstance(bias, nn.Parameter):
            self.register_parameter("bias", bias)
        else:  # a bias-free projection's zero buffer (modules/linear.py: drop_bias) stays a buffer
            self.register_buffer("bias", bias, persistent=False)
        self.norm = norm

    @classmethod
    def around(cls, linear: nn.Linear, norm: nn.Module, groups: int = 1) -> NormedProjection:
        """A NormedProjection computing with ``linear``'s parameters (to assign in ``linear``'s place)."""
        if type(linear) is not nn.Linear:
            raise TypeError(f"a q/k norm goes after a plain nn.Linear, not {type(linear).__name__}")
        if linear._forward_pre_hooks or linear._forward_hooks:
            # quant-noise (fairseq/modules/quant_noise.py) acts through a pre-hook the new module would lose
            raise ValueError("a q/k norm cannot take over a projection that has forward hooks (quant-noise)")
        return cls(linear.in_features, linear.out_features, linear.weight, linear.bias, norm, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.groups == 1:
            return self.norm(y)
        return self.norm(y.unflatten(-1, (self.groups, -1))).flatten(-2)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, groups={self.groups}"


def build_qk_norm(norm_type: str, dim: int, eps: float, export: bool = False) -> nn.Module:
    """One q or k norm of ``dim`` features (:data:`QK_NORM_TYPES`)."""
    if norm_type not in QK_NORM_TYPES:
        raise ValueError(f"unknown q/k norm type {norm_type!r}; choose from {', '.join(QK_NORM_TYPES)}")
    return build_norm(norm_type, dim, eps, export)


def add_qk_norm(attn: MultiheadAttention, norm: Callable[[int], nn.Module], scope: str) -> None:
    """Put ``norm(n)`` after ``attn``'s q and k projections (one module each), ``n`` features per ``scope``.

    Keeps ``attn`` off fairseq's fused ``F.multi_head_attention_forward``, which would bypass the norms
    (module docstring).
    """
    if scope == "head":
        groups, dim = attn.num_heads, attn.head_dim
    elif scope == "proj":
        groups, dim = 1, attn.embed_dim
    else:
        raise ValueError(f"unknown q/k norm scope {scope!r}; choose from {', '.join(QK_NORM_SCOPES)}")
    attn.q_proj = NormedProjection.around(attn.q_proj, norm(dim), groups)
    attn.k_proj = NormedProjection.around(attn.k_proj, norm(dim), groups)
    attn.skip_embed_dim_check = True


def has_qk_norm(attn: nn.Module) -> bool:
    """Whether ``attn``'s q projection carries a q/k norm."""
    return isinstance(getattr(attn, "q_proj", None), NormedProjection)


__all__ = [
    "QK_NORM_SCOPES",
    "QK_NORM_TYPES",
    "NormedProjection",
    "add_qk_norm",
    "build_qk_norm",
    "has_qk_norm",
]
