"""Merged attention (MAtt), a decoder layer type (``--decoder-layer-type matt``).

Zhang, Titov & Sennrich 2019, "Improving Deep Transformer with Depth-Scaled Initialization and
Merged Attention", section "Merged Attention Model". The decoder's self-attention is replaced by a
simplified average attention (SAAN, a cumulative average with no gate and no FFN) and merged with
the encoder-decoder attention into one sub-layer with one shared output projection W_o:

    SAAN(x)_t   = (1/t) sum_{j<=t} x_j W_v
    MAtt(x, H)  = W_o ( SAAN(x) + CrossAttn(x, H) )      (CrossAttn: heads concatenated, before W_o)
    y           = LN(x + dropout(MAtt(x, H)))            (Post-LN; Pre-LN: x + dropout(MAtt(LN(x), H)))
    out         = LN(y + dropout(FFN(y)))

so a decoder layer has two sub-layers (``matt``, ``ffn``) instead of three. W_v is the
cross-attention's value projection by default, as in the released code (bzhangGo/zero
``func.py``, ``dot_attention``: "the important part is sharing v_map"), which the paper's parameter
count 72.3M -> 66.0M needs; ``--no-matt-share-v`` gives the average branch a W_v of its own.
The paper's ablations (Table 3) are options of the same layer (``--matt-self-branch``):

- ``aan`` (default): SAAN above;
- ``self-attn``: masked multi-head self-attention in place of SAAN, still merged through W_o;
- ``gated-aan``: the original AAN gate on the average (Zhang, Xiong & Su 2018, "Accelerating Neural
  Transformer via an Average Attention Network"): [i; f] = sigmoid([x_t; a_t] W_g + b_g),
  g_t = i * x_t + f * a_t, with a_t = SAAN(x)_t.

Incremental decoding keeps, per layer and hypothesis, only the running sum of x_j W_v and the
step count (O(1) state, no growing key/value cache; :class:`AverageBranch`); the encoder-decoder
attention is fairseq's :class:`~fairseq.modules.MultiheadAttention` with its cache of static
encoder keys/values. The norms, residual scaling and init schemes are the plugin's other axes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch
import torch.nn as nn
from fairseq import utils
from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.modules import LayerNorm
from fairseq.modules.fairseq_dropout import FairseqDropout
from fairseq.modules.quant_noise import quant_noise
from torch import Tensor

from ..modules.layers import DeepInitDecoderLayer, LayerPlan
from ..modules.linear import drop_bias
from ..modules.sublayer import branch_output, sublayer_input, sublayer_output

SELF_BRANCHES = ("aan", "self-attn", "gated-aan")
# fairseq (NormFormer) options that change the standard layer's sub-layers; MAtt has no counterpart


class SharedOutputProjection(nn.Linear):
    """MAtt's shared W_o: ``W_o (x + pending) + b`` in one matmul.

    It sits in the cross-attention as its ``out_proj``, so fairseq's MultiheadAttention (with its
    static encoder key/value cache) computes ``W_o CrossAttn + b``; the layer hands the self
    branch in as ``pending`` for the duration of that call, which makes the output
    ``W_o (SAAN + CrossAttn) + b`` exactly as in the paper, without a second d x d product.
    """

    pending: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.pending is not None:
            x = x + self.pending
        return super().forward(x)


@with_incremental_state
class AverageBranch(nn.Module):
    """SAAN, the cumulative average of ``x_j W_v`` (optionally with the original AAN gate).

    ``forward`` takes the sub-layer input ``x`` and its value projection ``v = x W_v`` (the
    projection may be shared with the cross-attention, so the layer applies it). Positions marked
    in ``padding_mask`` take no part in any average. During incremental decoding the state is the
    running sum (fp32) and the count of non-padding steps: (B, d) + (B, 1) per layer.
    """

    def __init__(
        self, embed_dim: int, gated: bool, own_value: bool, q_noise: float = 0.0, qn_block_size: int = 8
    ) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.v_proj = quant_noise(nn.Linear(embed_dim, embed_dim), q_noise, qn_block_size) if own_value else None
        # the original AAN (Zhang, Xiong & Su 2018): input and forget gates from [x_t; a_t]
        self.gate = quant_noise(nn.Linear(2 * embed_dim, 2 * embed_dim), q_noise, qn_block_size) if gated else None
        self.init_incremental_state()

    def forward(
        self,
        x: Tensor,
        v: Tensor,
        padding_mask: Tensor | None = None,
        incremental_state: Dict[str, Dict[str, Tensor | None]] | None = None,
        causal: bool = True,
    ) -> Tensor:
        """``x``, ``v``: (T, B, d); ``padding_mask``: (B, T), True at padding. Returns (T, B, d)."""
        # the sums are kept in fp32: a running fp16 sum over a long prefix loses the new terms
        vf = v.float()
        keep = None
        # fairseq's decoder passes a mask only when there is padding; no .any() here (a GPU sync per layer)
        if padding_mask is not None:
            keep = (~padding_mask).transpose(0, 1).unsqueeze(-1).to(vf.dtype)  # (T, B, 1)
            vf = vf * keep
        if incremental_state is not None:
            state = self.get_incremental_state(incremental_state, "running_sum")
            if vf.size(0) == 1:
                total = vf[0]
                count = keep[0] if keep is not None else vf.new_ones(vf.size(1), 1)
                if state is not None:
                    total = total + state["sum"]
                    count = count + state["count"]
                total, count = total.unsqueeze(0), count.unsqueeze(0)
            else:
                total = vf.cumsum(0)
                count = keep.cumsum(0) if keep is not None else self._positions(vf)
                if state is not None:
                    total = total + state["sum"]
                    count = count + state["count"]
            self.set_incremental_state(incremental_state, "running_sum", {"sum": total[-1], "count": count[-1]})
        elif causal:
            total = vf.cumsum(0)
            count = keep.cumsum(0) if keep is not None else self._positions(vf)
        else:  # full-context alignment: fairseq's decoder passes no causal mask
            total = vf.sum(0, keepdim=True)
            count = keep.sum(0, keepdim=True) if keep is not None else vf.new_full((1, 1, 1), vf.size(0))
        # only padding can leave a count at 0 (a padded position before any real token)
        avg = (total / (count if keep is None else count.clamp(min=1.0))).type_as(v)
        if avg.size(0) != v.size(0):
            avg = avg.expand_as(v)
        if self.gate is None:
            return avg
        i, f = torch.sigmoid(self.gate(torch.cat([x, avg], dim=-1))).chunk(2, dim=-1)
        return i * x + f * avg

    @staticmethod
    def _positions(vf: Tensor) -> Tensor:
        return torch.arange(1, vf.size(0) + 1, device=vf.device, dtype=vf.dtype).view(-1, 1, 1)

    def reorder_incremental_state(
        self, incremental_state: Dict[str, Dict[str, Tensor | None]], new_order: Tensor
    ) -> Dict[str, Dict[str, Tensor | None]]:
        """Beam search: hypothesis ``i`` continues from hypothesis ``new_order[i]``."""
        state = self.get_incremental_state(incremental_state, "running_sum")
        if state is not None:
            state = {k: t.index_select(0, new_order) for k, t in state.items()}
            incremental_state = self.set_incremental_state(incremental_state, "running_sum", state)
        return incremental_state


@dataclass(frozen=True)
class MAttOptions:
    """The layer's options, resolved from ``--matt-self-branch`` and ``--matt-share-v`` by MAtt's record
    (:mod:`fairseq_deepinit.methods.matt`); the defaults are the paper's (the released code's shared W_v)."""

    self_branch: str = "aan"
    share_v: bool = True


class MAttDecoderLayer(DeepInitDecoderLayer):
    """A MAtt decoder layer: sub-layers ``matt`` (self branch + cross-attention, shared W_o) and ``ffn``.

    Built with fairseq's builders (``build_encoder_attention``, ``build_self_attention``,
    ``build_fc1``/``build_fc2``; the attentions in the ``--attention-impl`` class as in
    :class:`~fairseq_deepinit.modules.layers.DeepInitDecoderLayer`), called as fairseq's decoder layer
    (``(x, attn, None)``), and given the layer plan as every plugin layer (``--norm-type`` norms, the
    placement, one residual module per sub-layer, the methods' set-ups), so DeepNorm/ReZero/Admin
    scaling and the :mod:`~fairseq_deepinit.diagnostics.hooks` statistics apply.

    Attributes seen by the init schemes: ``encoder_attn`` (fairseq MultiheadAttention; its
    ``out_proj`` is the shared W_o, its ``v_proj`` also W_v unless ``--no-matt-share-v``),
    ``self_branch`` (:class:`AverageBranch` with ``v_proj`` = W_v and ``gate``, or a fairseq
    MultiheadAttention for the ``self-attn`` ablation, its ``out_proj`` weight tied to W_o),
    ``self_attn = None`` (there is no separate self-attention sub-layer), ``fc1``, ``fc2``; and the layer
    interface :meth:`attention_projections` and :meth:`own_value_projections`.
    """

    SUBLAYERS = ("matt", "ffn")
    NORMS = ("matt_layer_norm", "final_layer_norm")
    OUT_NORMS = ("matt_out_norm", "ffn_out_norm")
    NORM_POSITIONS = {"matt_layer_norm": "attn", "final_layer_norm": "ffn"}  # the merged attention's norm: attn

    def __init__(self, cfg, plan: LayerPlan, no_encoder_attn: bool = False) -> None:
        # fairseq's __init__ would build a self-attention and three norms MAtt does not have;
        # everything is built here with fairseq's own build_* methods instead
        nn.Module.__init__(self)
        if no_encoder_attn:
            raise ValueError(
                "--decoder-layer-type matt merges the self branch into the encoder-decoder attention and needs "
                "cross-attention; drop --no-cross-attention or use --decoder-layer-type standard"
            )
        self._attention_impl = plan.attention_impl
        self.embed_dim = cfg.decoder.embed_dim
        # the record's options (the paper's defaults where a plan carries none)
        options: MAttOptions = plan.params or MAttOptions()
        self.self_branch_type = options.self_branch
        self.share_v = options.share_v
        self.dropout_module = FairseqDropout(cfg.dropout, module_name=self.__class__.__name__)
        self.quant_noise = cfg.quant_noise.pq
        self.quant_noise_block_size = cfg.quant_noise.pq_block_size
        self.cross_self_attention = False
        self.activation_fn = utils.get_activation_fn(activation=cfg.activation_fn)
        activation_dropout_p = cfg.activation_dropout or cfg.relu_dropout or 0
        self.activation_dropout_module = FairseqDropout(
            float(activation_dropout_p), module_name=self.__class__.__name__
        )
        self.attn_ln = self.c_attn = self.ffn_layernorm = self.w_resid = None  # NormFormer: not supported

        self.encoder_attn = self.build_encoder_attention(self.embed_dim, cfg)
        w_o = SharedOutputProjection(self.embed_dim, self.embed_dim)
        w_o.load_state_dict(self.encoder_attn.out_proj.state_dict())  # keep fairseq's init of out_proj
        self.encoder_attn.out_proj = quant_noise(w_o, self.quant_noise, self.quant_noise_block_size)
        if self.share_v and self.encoder_attn.vdim != self.embed_dim:
            raise ValueError(
                "MAtt shares W_v with the cross-attention (--matt-share-v, the default), whose value projection "
                f"({self.encoder_attn.vdim} -> {self.embed_dim}) cannot apply to decoder states of size "
                f"{self.embed_dim}; use equal encoder and decoder embedding dims or pass --no-matt-share-v"
            )
        self.self_attn = None
        if self.self_branch_type == "self-attn":
            attn = self.build_self_attention(self.embed_dim, cfg)
            attn.out_proj.weight = w_o.weight  # the paper's single W_o; its bias enters once, via the cross branch
            drop_bias(attn.out_proj)
            if self.share_v:
                attn.v_proj = self.encoder_attn.v_proj
            self.self_branch = attn
        elif self.self_branch_type in ("aan", "gated-aan"):
            self.self_branch = AverageBranch(
                self.embed_dim,
                gated=self.self_branch_type == "gated-aan",
                own_value=not self.share_v,
                q_noise=self.quant_noise,
                qn_block_size=self.quant_noise_block_size,
            )
        else:
            raise ValueError(f"unknown --matt-self-branch {self.self_branch_type!r}; choose from {SELF_BRANCHES}")
        self.nh = self.encoder_attn.num_heads
        self.head_dim = self.encoder_attn.head_dim

        self.fc1 = self.build_fc1(
            self.embed_dim, cfg.decoder.ffn_embed_dim, self.quant_noise, self.quant_noise_block_size
        )
        self.fc2 = self.build_fc2(
            cfg.decoder.ffn_embed_dim, self.embed_dim, self.quant_noise, self.quant_noise_block_size
        )
        self.matt_layer_norm = LayerNorm(self.embed_dim, export=cfg.export)
        self.final_layer_norm = LayerNorm(self.embed_dim, export=cfg.export)
        self.need_attn = True
        self.onnx_trace = False
        # a decoder layer with cross-attention (DeepNorm's and Sub-LN's encoder-decoder constants), with
        # two residual sub-layers of its own (closed-form Admin counts those)
        self._apply_plan(plan, self.SUBLAYERS)

    def value_projection(self) -> nn.Module:
        """W_v of the average branch: the cross-attention's (default), or its own under ``--no-matt-share-v``."""
        return self.encoder_attn.v_proj if self.share_v else self.self_branch.v_proj

    def attention_projections(self) -> list:
        """The cross-attention's q/k/v/W_o and the self branch's projections (the ablation's q/k/v/out, or W_v)."""
        out = super().attention_projections()
        branch = self.self_branch
        return out + [getattr(branch, p) for p in ("q_proj", "k_proj", "v_proj") if getattr(branch, p, None)]

    def own_value_projections(self) -> list:
        """MAtt's own W_v (``--no-matt-share-v`` with an average branch): computed like an attention's value
        projection, so the schemes that treat v_proj specially (T-Fixup, DeepNorm, SmallInit) treat it alike.
        A shared W_v is the cross-attention's v_proj and is reached through it."""
        v = getattr(self.self_branch, "v_proj", None)
        return [v] if isinstance(v, nn.Linear) and not hasattr(self.self_branch, "q_proj") else []

    def forward(
        self,
        x: Tensor,
        encoder_out: Tensor | None = None,
        encoder_padding_mask: Tensor | None = None,
        incremental_state: Dict[str, Dict[str, Tensor | None]] | None = None,
        prev_self_attn_state: list | None = None,
        prev_attn_state: list | None = None,
        self_attn_mask: Tensor | None = None,
        self_attn_padding_mask: Tensor | None = None,
        need_attn: bool = False,
        need_head_weights: bool = False,
    ):
        """fairseq's decoder-layer call; returns ``(x, cross-attention weights, None)``."""
        if prev_self_attn_state is not None or prev_attn_state is not None:
            raise NotImplementedError("MAtt keeps a running sum, not key/value states; prev_*_state is unsupported")
        if need_head_weights:
            need_attn = True
        layer_input = x

        # merged attention: W_o (self branch + cross-attention)
        skip = x
        h = sublayer_input(self.placement, x, self.matt_layer_norm, self.input_scale)
        if self.self_branch_type == "self-attn":
            # W_o (heads) without bias: the tied out_proj of the self-attention
            branch, _ = self.self_branch(
                query=h,
                key=h,
                value=h,
                key_padding_mask=self_attn_padding_mask,
                incremental_state=incremental_state,
                need_weights=False,
                attn_mask=self_attn_mask,
            )
            pending = None
        else:
            # fairseq passes no causal mask only for full-context alignment training
            causal = incremental_state is not None or self_attn_mask is not None
            branch = self.self_branch(
                h, self.value_projection()(h), self_attn_padding_mask, incremental_state, causal=causal
            )
            pending = branch
        w_o = self.encoder_attn.out_proj
        attn = None
        if encoder_out is not None:
            w_o.pending = pending
            try:
                out, attn = self.encoder_attn(
                    query=h,
                    key=encoder_out,
                    value=encoder_out,
                    key_padding_mask=encoder_padding_mask,
                    incremental_state=incremental_state,
                    static_kv=True,
                    need_weights=need_attn or (not self.training and self.need_attn),
                    need_head_weights=need_head_weights,
                )
            finally:
                w_o.pending = None
            if pending is None:
                out = out + branch
        else:  # no encoder output (decoder used alone): only the self branch
            out = w_o(branch) if pending is not None else branch + w_o.bias
        h = self.dropout_module(branch_output(self.placement, out, self.matt_layer_norm, self.matt_out_norm))
        x = sublayer_output(self.placement, h, skip, self.matt_layer_norm, self.residuals["matt"], layer_input)

        x, _, _ = self._ffn_sublayer(x, layer_input)
        return x, attn, None
