"""What every plugin layer has (:class:`DeepInitLayer`), and the plan it is built from (:class:`LayerPlan`).

fairseq builds each layer (its attentions, FFN and norms); the plugin then applies the layer's
:class:`LayerPlan`, which the model computes from the selected methods (:mod:`fairseq_deepinit.plan`): the
sub-layer norms of ``--norm-type``, one residual module per sub-layer (``layer.residuals``), the layer's norm
placement and each method's layer set-up. :class:`DeepInitLayer` also holds the layer's interface to the
methods (its attention modules and projections), NormFormer's attention-output step and the FFN sub-layer
both layer kinds share. The encoder and decoder layers are :mod:`fairseq_deepinit.modules.layers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from .attention import DEFAULT_IMPL
from .dual_stream import DualStream
from .stacks import StackKind
from .sublayer import branch_output, check_placement, sublayer_input, sublayer_output


@dataclass(frozen=True)
class LayerPlan:
    """One layer as the model's spec has it (built by :func:`fairseq_deepinit.plan.layer_plan`).

    ``norm(dim, position)`` builds a norm of the spec's type over ``dim`` for a norm position (``attn``,
    ``ffn``, ``final`` or None; DyT/Derf take their alpha by it); ``residual(sublayer)`` builds the
    :class:`~.residual.Residual` of a sub-layer; ``placement`` is one of :data:`.sublayer.PLACEMENTS`;
    ``setup``: the set-ups of the methods that are on, ``fn(layer)``, run in method order once the layer
    is built; ``params``: the layer type's own options, typed by the layer type's record (MAtt's
    :class:`~fairseq_deepinit.matt.layer.MAttOptions`), None for a layer type without options.
    """

    kind: StackKind
    index: int
    placement: str
    norm: Callable[..., nn.Module]
    residual: Callable[[str], nn.Module]
    attention_impl: str = DEFAULT_IMPL
    setup: Tuple[Callable[[nn.Module], None], ...] = ()
    params: Any = None


class DeepInitLayer:
    """What every plugin layer has: the plan applied after fairseq's ``__init__``, and the layer's interface
    to the methods (:meth:`attention_modules`, :meth:`attention_projections`, :meth:`own_value_projections`)."""

    kind: StackKind
    layer_idx: int
    placement: str
    residuals: nn.ModuleDict
    NORMS: Tuple[str, ...] = ()  # attributes holding the sub-layer norms fairseq built
    input_scale: float = 1.0  # times each Pre-LN norm's output (a method's set-up: LayerNorm Scaling's 1/sqrt(l))
    OUT_NORMS: Tuple[str, ...] = ()  # Peri-LN's output norm of each of them (None under other placements)
    # the norm position of each slot (fairseq's final_layer_norm is the FFN's): DyT/Derf's per-position alpha
    NORM_POSITIONS: Dict[str, str] = {
        "self_attn_layer_norm": "attn",
        "encoder_attn_layer_norm": "attn",
        "final_layer_norm": "ffn",
    }
    _attention_impl: str = DEFAULT_IMPL
    dual_stream: DualStream | None = None  # the constants of a stack's second stream (ResiDual), set up by a method
    ffn_gate: nn.Module | None  # a gated FFN's gate(x, fc1(x)) in place of act(fc1(x)) (.glu), set up by a method

    @property
    def stack(self) -> str:
        """The model attribute holding this layer's stack (``encoder`` / ``decoder``)."""
        return self.kind.stack

    def _apply_plan(self, plan: LayerPlan, sublayers: Tuple[str, ...]) -> None:
        self.layer_idx = plan.index  # 1-based depth within the stack (DS-Init's l)
        self.kind = plan.kind
        self.placement = check_placement(plan.placement)
        self._norm_builder = plan.norm
        for attr in self.NORMS:
            if getattr(self, attr, None) is not None:  # in fairseq's slot: the parameter order stays
                setattr(self, attr, plan.norm(self.embed_dim, self.NORM_POSITIONS[attr]))
        for attr, out in zip(self.NORMS, self.OUT_NORMS, strict=True):
            peri = self.placement == "peri" and getattr(self, attr, None) is not None
            setattr(self, out, plan.norm(self.embed_dim, self.NORM_POSITIONS[attr]) if peri else None)
        self.residuals = nn.ModuleDict({name: plan.residual(name) for name in sublayers})
        self.ffn_gate = None  # an instance attribute: a class-level None would hide the submodule a set-up assigns
        for setup in plan.setup:
            setup(self)

    def build_norm(self, dim: int, position: str | None = None) -> nn.Module:
        """A norm of the layer's plan over ``dim`` (``--norm-type`` with the methods' norm arguments), for
        a method's set-up (Sub-LN's and NormFormer's inner norms, which have no position)."""
        return self._norm_builder(dim, position)

    def attention_modules(self) -> List[nn.Module]:
        """The layer's fairseq attention sub-layers (self-attention, then cross-attention), as the init
        schemes treat them."""
        return [a for a in (getattr(self, "self_attn", None), getattr(self, "encoder_attn", None)) if a is not None]

    def attention_projections(self) -> List[nn.Module]:
        """Every q/k/v/out projection of every attention of the layer (Lipschitz's bias-free set)."""
        return [getattr(a, p) for a in self.attention_modules() for p in ("q_proj", "k_proj", "v_proj", "out_proj")]

    def own_value_projections(self) -> List[nn.Module]:
        """Value projections outside a fairseq attention module (MAtt's own W_v); none here."""
        return []

    def _normformer_attention_output(self, x: Tensor) -> Tensor:
        """NormFormer on a self-attention's output: HeadScale ``c_attn`` on the heads of the output
        projection's result, then ``attn_ln`` (fairseq transformer_layer.py:460-466)."""
        if self.c_attn is not None:
            tgt_len, bsz = x.size(0), x.size(1)
            x = x.view(tgt_len, bsz, self.nh, self.head_dim)
            x = torch.einsum("tbhd,h->tbhd", x, self.c_attn)
            x = x.reshape(tgt_len, bsz, self.embed_dim)
        if self.attn_ln is not None:
            x = self.attn_ln(x)
        return x

    def _ffn_sublayer(
        self, x: Tensor, layer_input: Tensor, raw: Tensor | None = None
    ) -> Tuple[Tensor, Tensor, Tensor | None]:
        """The FFN sub-layer (fairseq transformer_layer.py:206-222 encoder, 490-514 decoder); returns
        ``(output, fc2's output before dropout, raw)``. A gated FFN (``ffn_gate``, :mod:`.glu`):
        ``gate(x, fc1(x))`` in place of ``act(fc1(x))``. NormFormer: ``ffn_layernorm`` before fc2, ResScale
        ``w_resid`` on the skip path. ``raw``: the stack's second stream, which the dropped-out branch output
        is added to (:mod:`.dual_stream`), None without one."""
        h, skip = self.residuals["ffn"].enter(x)  # (x, x), or the split of n streams (.hyper)
        h = sublayer_input(self.placement, h, self.final_layer_norm, self.input_scale)
        h = self.activation_fn(self.fc1(h)) if self.ffn_gate is None else self.ffn_gate(h, self.fc1(h))
        h = self.activation_dropout_module(h)
        if self.ffn_layernorm is not None:
            h = self.ffn_layernorm(h)
        h = self.fc2(h)
        fc_result = h
        h = branch_output(self.placement, h, self.final_layer_norm, self.ffn_out_norm)
        h = self.dropout_module(h)
        if raw is not None:
            raw = self.dual_stream.add(raw, h)
        if self.w_resid is not None:
            skip = torch.mul(self.w_resid, skip)
        out = sublayer_output(self.placement, h, skip, self.final_layer_norm, self.residuals["ffn"], layer_input)
        return out, fc_result, raw
