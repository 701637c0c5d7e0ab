"""Attention through ``torch.nn.functional.scaled_dot_product_attention`` (``--attention-impl sdpa``).

The same multi-head attention as fairseq's :class:`~fairseq.modules.MultiheadAttention` (Vaswani et
al. 2017, eq. 1: ``softmax(Q K^T / sqrt(d_k)) V`` per head), computed by PyTorch's fused kernel
(FlashAttention / memory-efficient / C++ math, chosen by PyTorch per call) instead of fairseq's
explicit ``bmm -> softmax -> dropout -> bmm``. What it changes, per call site of the plugin's layers:

- encoder self-attention: the key-padding mask goes to the kernel as a ``(B, 1, 1, S)`` boolean
  mask, not a per-head ``(B*H, 1, S)`` float mask as in fairseq's call of
  ``F.multi_head_attention_forward``;
- decoder self-attention in training: fairseq's future mask (``triu(-inf, 1)``) becomes
  ``is_causal=True`` (no mask tensor; the kernel skips the masked half, FlashAttention applies) when
  the batch has no target padding, or when the targets are right-padded (:func:`declare_target_padding`,
  from the task: fairseq's translation and language-modeling tasks pad on the right unless
  ``--left-pad-target``). With left padding, one ``(B, 1, T, T)`` mask instead of fairseq's ``(B*H, T, T)``.
  Right padding makes ``is_causal`` exact for every real query: a real query at ``t`` sees the keys
  ``<= t``, all real. Only padding query rows change (they also see the padding keys before them);
  the loss ignores them, and nothing at a real position depends on them, so real outputs, the loss
  and every gradient are the masked path's (to float round-off). Where padding rows are *read*
  (Admin's profiling statistics count them), :func:`exact_padding_rows` restores the masked path.
  Whether a mask is the future mask is known without reading it (:func:`.masks.future_mask`,
  :func:`.masks.is_causal_mask`): no device sync, nothing read on the ``meta`` device, no graph break;
- encoder-decoder attention (always fairseq's explicit path, as it passes ``static_kv``) and
  incremental decoding: the fused kernel, with fairseq's key/value cache in fairseq's own layout
  (``prev_key``/``prev_value`` ``(B, H, S, d_head)``, ``prev_key_padding_mask``), so
  ``reorder_incremental_state`` (beam search) and fairseq's "beamable" encoder-decoder cache
  (one copy of the encoder keys per sentence, not per beam) work unchanged.

Everything else goes to fairseq's own ``forward``: calls that return attention weights
(``need_weights``: fairseq's decoder asks for the last layer's encoder-decoder weights as its
alignment, and in eval mode for every layer's unless ``make_generation_fast_`` was called),
``before_softmax``, ``add_bias_kv``/``add_zero_attn``, ``--cross-self-attention``, ONNX tracing,
XLA, xFormers. ``skip_embed_dim_check`` (Sub-LN's self-attention, fairseq's head pruning) only
skips fairseq's query-width assertion here as in fairseq's own forward: the fused path calls
``out_proj`` as a module, which is all Sub-LN's inner norm needs. The class adds no parameter or
buffer, so state dicts (checkpoints) are identical and interchangeable between
``--attention-impl fairseq`` and ``sdpa``.

The forward is three steps a subclass may change one by one: ``_values`` (the self-attention's projected
values, before the head split and the cache), ``_attend`` (the per-head core on ``(B, H, T, d)``) and
``_output`` (the heads before ``out_proj``); :mod:`.attention_features` changes all three.

Numerics: with attention dropout 0 the two paths agree to float round-off (the tests check fp32
outputs and gradients to 1e-5). Attention dropout (``--attention-dropout``) is the kernel's
``dropout_p``: same distribution as fairseq's, different random draws.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Tuple

import torch
import torch.nn.functional as F
from fairseq.modules.multihead_attention import MultiheadAttention
from torch import Tensor, nn

from .masks import kernel_mask

ATTENTION_IMPLS = ("fairseq", "sdpa")
DEFAULT_IMPL = "fairseq"


class SDPAMultiheadAttention(MultiheadAttention):
    """fairseq's MultiheadAttention whose forward runs ``F.scaled_dot_product_attention``.

    The layers' ``build_self_attention`` / ``build_encoder_attention`` construct it with fairseq's
    arguments when ``--attention-impl sdpa`` (:func:`attention_class`).
    """

    #: a plugin decoder's causal self-attention (:func:`declare_target_padding`): the only ``attn_mask``
    #: it is given is its decoder's future mask (fairseq's ``buffered_future_mask``, or None)
    causal_self_attention: bool = False
    #: ... and its key padding marks only the end of each row (right-padded targets): the future mask
    #: is then ``is_causal`` for every real query
    causal_right_padded: bool = False

    @classmethod
    def like(cls, attn: MultiheadAttention) -> SDPAMultiheadAttention:
        """A new fused-path attention configured as ``attn`` (dims, heads, dropout, biases, kind) and holding
        a copy of its parameters; for comparing the two paths on the same weights (quant-noise is not
        carried over)."""
        new = cls(
            attn.embed_dim,
            attn.num_heads,
            kdim=attn.kdim,
            vdim=attn.vdim,
            dropout=attn.dropout_module.p,
            bias=attn.k_proj.bias is not None,
            add_bias_kv=attn.bias_k is not None,
            add_zero_attn=attn.add_zero_attn,
            self_attention=attn.self_attention,
            encoder_decoder_attention=attn.encoder_decoder_attention,
        ).to(device=attn.k_proj.weight.device, dtype=attn.k_proj.weight.dtype)
        new.load_state_dict(attn.state_dict())
        return new

    def forward(
        self,
        query: Tensor,
        key: Tensor | None,
        value: Tensor | None,
        key_padding_mask: Tensor | None = None,
        incremental_state: Dict[str, Dict[str, Tensor | None]] | None = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Tensor | None = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Tensor | None]:
        if not self._sdpa_applies(
            query, incremental_state, need_weights or need_head_weights, static_kv, before_softmax
        ):
            return super().forward(
                query,
                key,
                value,
                key_padding_mask=key_padding_mask,
                incremental_state=incremental_state,
                need_weights=need_weights,
                static_kv=static_kv,
                attn_mask=attn_mask,
                before_softmax=before_softmax,
                need_head_weights=need_head_weights,
            )
        return self._sdpa_forward(query, key, key_padding_mask, incremental_state, static_kv, attn_mask)

    def _sdpa_applies(
        self, query: Tensor, incremental_state, need_weights: bool, static_kv: bool, before_softmax: bool
    ) -> bool:
        """Whether this call is one the fused path reproduces (see the module docstring)."""
        if need_weights or before_softmax or self.onnx_trace or self.use_xformers:
            return False
        if self.bias_k is not None or self.add_zero_attn or query.device.type == "xla":
            return False
        if torch.jit.is_scripting():
            return False
        if self.self_attention:
            return True
        # fairseq's decoder always calls the encoder-decoder attention with static_kv; without it
        # fairseq projects the value from ``value`` (not ``key``) and appends keys across steps
        return self.encoder_decoder_attention and static_kv

    def _split_heads(self, x: Tensor) -> Tensor:
        """(T, B, H*d) -> (B, H, T, d), a strided view (the kernels take any stride with a unit last one)."""
        length, bsz, _ = x.shape
        return x.view(length, bsz, self.num_heads, self.head_dim).permute(1, 2, 0, 3)

    def _sdpa_forward(
        self,
        query: Tensor,
        key: Tensor | None,
        key_padding_mask: Tensor | None,
        incremental_state: Dict[str, Dict[str, Tensor | None]] | None,
        static_kv: bool,
        attn_mask: Tensor | None,
        need_weights: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Tensor | None]:
        """The projections, fairseq's key/value cache, :meth:`_attend` and :meth:`_output`; returns fairseq's
        ``(output, attention weights or None)``, the weights only from a subclass whose ``_attend`` gives them."""
        tgt_len, bsz, embed_dim = query.shape
        if not self.skip_embed_dim_check:  # as fairseq's forward: Sub-LN and head pruning skip it
            assert embed_dim == self.embed_dim, f"query dim {embed_dim} != {self.embed_dim}"
        saved_state: Dict[str, Tensor | None] | None = None
        if incremental_state is not None:
            saved_state = self._get_input_buffer(incremental_state)
            if static_kv and "prev_key" in saved_state:
                key = None  # the encoder's keys/values are cached since the first step

        q = self._split_heads(self.q_proj(query))
        k = v = None
        if self.self_attention:
            k = self._split_heads(self.k_proj(query))
            v = self._split_heads(self._values(query))
        elif key is not None:
            if self.beam_size > 1 and bsz == key.size(1):
                # fairseq's beamable encoder-decoder attention: the encoder output is repeated per
                # beam; keep one copy per sentence (exactly what fairseq's forward does)
                key = key.view(key.size(0), -1, self.beam_size, key.size(2))[:, :, 0, :]
                if key_padding_mask is not None:
                    key_padding_mask = key_padding_mask.view(-1, self.beam_size, key_padding_mask.size(1))[:, 0, :]
            k = self._split_heads(self.k_proj(key))
            v = self._split_heads(self.v_proj(key))  # fairseq: the encoder output is both key and value
        kv_bsz = bsz if k is None else k.size(0)

        if saved_state is not None:
            # fairseq's cache layout: prev_key / prev_value (kv_bsz, H, S, d), prev_key_padding_mask
            if "prev_key" in saved_state:
                prev_key = saved_state["prev_key"]
                assert prev_key is not None
                kv_bsz = prev_key.size(0)
                prev_key = prev_key.view(kv_bsz, self.num_heads, -1, self.head_dim)
                k = prev_key if static_kv else torch.cat([prev_key, k], dim=2)
            if "prev_value" in saved_state:
                prev_value = saved_state["prev_value"]
                assert prev_value is not None
                prev_value = prev_value.view(kv_bsz, self.num_heads, -1, self.head_dim)
                v = prev_value if static_kv else torch.cat([prev_value, v], dim=2)
            assert k is not None and v is not None
            key_padding_mask = MultiheadAttention._append_prev_key_padding_mask(
                key_padding_mask=key_padding_mask,
                prev_key_padding_mask=saved_state.get("prev_key_padding_mask"),
                batch_size=kv_bsz,
                src_len=k.size(2),
                static_kv=static_kv,
            )
            # contiguous, as fairseq's own forward views them as (kv_bsz * H, S, d)
            k, v = k.contiguous(), v.contiguous()
            saved_state["prev_key"] = k
            saved_state["prev_value"] = v
            saved_state["prev_key_padding_mask"] = key_padding_mask
            self._set_input_buffer(incremental_state, saved_state)
        assert k is not None and v is not None
        src_len = k.size(2)
        if key_padding_mask is not None and key_padding_mask.dim() == 0:
            key_padding_mask = None  # fairseq's TorchScript workaround for "no mask"

        if kv_bsz != bsz:
            # beam search with one cached copy of the encoder per sentence: the beam's queries of a
            # sentence are one longer query block against that sentence's keys
            beam = bsz // kv_bsz
            qb = q.reshape(kv_bsz, beam, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
            qb = qb.reshape(kv_bsz, self.num_heads, beam * tgt_len, self.head_dim)
            out, weights = self._attend(qb, k, v, attn_mask, key_padding_mask, need_weights or need_head_weights)
            out = out.view(kv_bsz, self.num_heads, beam, tgt_len, -1).transpose(1, 2)
            out = out.reshape(bsz, self.num_heads, tgt_len, -1)
            if weights is not None:
                weights = weights.view(kv_bsz, self.num_heads, beam, tgt_len, src_len).transpose(1, 2)
                weights = weights.reshape(bsz, self.num_heads, tgt_len, src_len)
        else:
            out, weights = self._attend(q, k, v, attn_mask, key_padding_mask, need_weights or need_head_weights)
        if weights is not None:  # fairseq's returned weights: (H, B, T, S), or their mean over the heads
            weights = weights.transpose(0, 1)
            if not need_head_weights:
                weights = weights.mean(dim=0)
        return self._output(out, query), weights

    def _values(self, x: Tensor) -> Tensor:
        """The self-attention's projected values ``(T, B, C)``, before the head split and the cache."""
        return self.v_proj(x)

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, key_padding_mask: Tensor | None, weights: bool
    ) -> Tuple[Tensor, Tensor | None]:
        """``softmax(scale q k^T + masks) v`` per head through the fused kernel: ``(B, H, T, d)`` in and out
        (``k``, ``v`` and ``key_padding_mask`` may have fewer rows: the beamable encoder cache); no weights."""
        tgt_len, src_len = q.size(2), k.size(2)
        mask, is_causal = kernel_mask(
            attn_mask,
            key_padding_mask,
            tgt_len,
            src_len,
            q.dtype,
            declared_future=self.causal_self_attention,
            right_padded=self.causal_right_padded,
        )
        if k.size(0) != q.size(0) and mask is not None and mask.size(-2) != 1:
            raise NotImplementedError("an attention mask over query positions with a beamable encoder cache")
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self._dropout_p(), is_causal=is_causal, scale=self.scaling
        )
        return out, None

    def _dropout_p(self) -> float:
        return self.dropout_module.p if (self.training or self.dropout_module.apply_during_inference) else 0.0

    def _output(self, out: Tensor, query: Tensor) -> Tensor:
        """(B, H, T, d) -> (T, B, H*d), then out_proj, called as a module (MAtt's shared W_o hooks in there)."""
        tgt_len, bsz = query.size(0), query.size(1)
        return self.out_proj(out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, self.embed_dim))


def declare_target_padding(decoder: nn.Module, side: str) -> None:
    """Tell a plugin decoder's SDPA self-attentions that they are its causal self-attentions (their
    ``attn_mask`` is the decoder's future mask, fairseq's ``buffered_future_mask``, or None) and where
    the targets are padded (:func:`fairseq_deepinit.modules.padding.target_padding`).

    ``"right"`` lets a causal self-attention pass ``is_causal`` with target padding (module
    docstring); anything else keeps the ``(B, 1, T, T)`` mask. Build-time facts of the decoder and
    the task, so that no forward reads a mask to find out.
    """
    for module in decoder.modules():
        if isinstance(module, SDPAMultiheadAttention) and module.self_attention:
            module.causal_self_attention = True
            module.causal_right_padded = side == "right"


@contextlib.contextmanager
def exact_padding_rows(model: nn.Module) -> Iterator[None]:
    """Within the block, causal self-attentions compute padding query rows as fairseq does (masked).

    For computations that read every position, padding included (Admin's profiling statistics,
    which the released code takes over the whole padded batch): there, the padding rows must hold
    fairseq's values, not the ``is_causal`` ones. Real positions are the same either way.
    """
    changed = [m for m in model.modules() if isinstance(m, SDPAMultiheadAttention) and m.causal_right_padded]
    for m in changed:
        m.causal_right_padded = False
    try:
        yield
    finally:
        for m in changed:
            m.causal_right_padded = True


def attention_class(impl: str | None) -> type:
    """The attention class a layer builds for ``--attention-impl`` (default: fairseq's own).

    :class:`SDPAMultiheadAttention` adds a forward and no state, so both build the same parameters
    from the same arguments (and the same random draws): checkpoints are interchangeable.
    """
    impl = impl or DEFAULT_IMPL
    if impl == "sdpa":
        return SDPAMultiheadAttention
    if impl != "fairseq":
        raise ValueError(f"unknown --attention-impl {impl!r}; choose from {', '.join(ATTENTION_IMPLS)}")
    return MultiheadAttention


__all__ = [
    "ATTENTION_IMPLS",
    "DEFAULT_IMPL",
    "SDPAMultiheadAttention",
    "attention_class",
    "declare_target_padding",
    "exact_padding_rows",
]
