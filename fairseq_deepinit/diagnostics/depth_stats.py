"""Statistics over depth, on plain tensors: residual-stream size, angular distance between layers, maximum
attention logit. Pure functions (no hooks, no fairseq); :mod:`.depth_hooks` feeds them a model's tensors.

Every tensor is fairseq's time-first layout: a stream ``h`` is ``(T, B, C)`` and ``real`` the ``(T, B)``
boolean mask of non-padding positions. Sums are returned as float64 *moments* that add up over
micro-batches and data-parallel ranks (fairseq sums logging outputs), maxima as 0-dim tensors that are
combined with ``max``; nothing is read to the host here.

**Residual-stream size** after every layer (the claim of LayerNorm Scaling, Sun et al. 2025, and Peri-LN,
Kim et al. 2025: the Pre-LN stream grows with depth). Two released statistics and one of ours:

- OLMo-core ``GAPMonitorCallback.record_tensor_stats`` (allenai/OLMo-core @ fa6c501,
  ``src/olmo_core/train/callbacks/gap_monitor.py:196-212``, ``var_mean`` at ``331-333``): per instance,
  ``var, mean = torch.var_mean(x.reshape(B, -1), dim=-1)`` (unbiased, over the ``T * C`` values), summed
  over instances and divided by their number; and ``max |x|`` over the tensor. Here each sentence's
  values are those of its real tokens only (extension: OLMo-core has no padding; a sentence without
  padding gives exactly OLMo-core's value), and the instances of every micro-batch and rank are pooled
  (OLMo-core divides by the local batch size and averages over ranks: equal for equal batch sizes).
- the mean over real tokens of the per-token l2 norm ``||h[t, b, :]||_2`` (this project's, as the port
  ``tests/ports/diagnostics.py: residual_norms``; no released code computes exactly it). It is what
  "the norm of the residual stream" means in the Peri-LN paper's plots and it is comparable across
  widths as ``norm / sqrt(C)``.

**Angular distance** between the stream before and after a layer: lmsdss/LayerNorm-Scaling @ 3ac54dd and
pixeli99/MixLN @ ff45826, ``utils/metrics.py:4-26`` (``block_influence``): ``sim = <a, b> / (|a| |b|)``
per token, ``sim.nan_to_num(nan=0.5)``, ``arccos(sim) / pi``. ``utils/short_hf.py:168-192`` keeps only the
last position of each sequence (``[:, -1:]``, ShortGPT section 3.2) and averages over the batch
(LayerNorm-Scaling; MixLN ``short_hf.py:61-80`` sums). In a padded translation batch the last position is
padding, so both token choices are kept: the mean over every real token, and the last *real* token of
each sentence, averaged over sentences (the released convention). Extension: ``sim`` is clamped to
``[-1, 1]`` before ``arccos``, so that a layer that returns its input (ReZero at initialisation) gives 0
and not the NaN that round-off (``sim = 1 + 1 ulp``) gives the released code.

**Maximum attention logit**: Megatron-LM ``megatron/core/optimizer/qk_clip.py`` ``prepare_qk_clip``
(index commit 2ba9903): per head the maximum of TransformerEngine's softmax row-max statistic, i.e. the
maximum over batch, valid queries and unmasked keys of the pre-softmax score ``scale * q . k``
(``transformer_engine/pytorch/cpp_extensions/fused_attn.py`` ``fused_attn_fwd(return_max_logit=True)``);
the logged ``log_max_attention_logit`` is ``max(0.0, max over layers and heads)``. Here per attention
module (extension: one value per layer and attention kind, encoder self, decoder self, cross), from
fairseq's own score: ``q = q_proj(x) * head_dim ** -0.5``, ``k = k_proj(kv)``, per head ``q . k``, plus
``attn_mask`` (additive, or boolean with True = masked), ``-inf`` at padded keys
(fairseq/modules/multihead_attention.py:575-602, 702-727).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

# stream moments: real tokens, sum of per-token l2 norms, sentences, sum of per-sentence variances
STREAM_MOMENTS = ("tokens", "norm_sum", "sentences", "var_sum")
# angle moments: real tokens, sum of their angles, sentences, sum of the angles at their last real token
ANGLE_MOMENTS = ("tokens", "angle_sum", "sentences", "last_sum")


def _f64(x: Tensor) -> Tensor:
    return x.detach().to(torch.float64)


def stream_moments(h: Tensor, real: Tensor) -> Tensor:
    """``[tokens, sum ||h_t||_2, sentences, sum_b Var_b]`` over the real tokens of a ``(T, B, C)`` stream.

    ``Var_b`` is OLMo-core's per-instance variance (unbiased, over the ``n_b = len_b * C`` values of
    sentence ``b``'s real tokens); a sentence with fewer than two values is left out.
    """
    keep = real.unsqueeze(-1)
    x = torch.where(keep, _f64(h), 0.0)  # padding out (a where, not a product: inf * 0 would be NaN)
    r = real.to(torch.float64)
    c = x.size(-1)
    tokens = r.sum()
    norm_sum = x.norm(dim=-1).sum()
    n_b = r.sum(0) * c  # (B,)
    mean_b = x.sum((0, 2)) / n_b.clamp(min=1)
    dev = torch.where(keep, x - mean_b.view(1, -1, 1), 0.0)
    counted = n_b > 1
    var_b = torch.where(counted, dev.pow(2).sum((0, 2)) / (n_b - 1).clamp(min=1), torch.zeros_like(n_b))
    return torch.stack([tokens, norm_sum, counted.sum().to(torch.float64), var_b.sum()])


def stream_max_abs(h: Tensor, real: Tensor) -> Tensor:
    """OLMo-core's ``max |x|`` over the real tokens of a ``(T, B, C)`` stream (0-dim, float64)."""
    return h.detach().abs().masked_fill(~real.unsqueeze(-1), 0).amax().to(torch.float64)


def h_res_maxima(h_res: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """mHC's ``H_res`` ``(..., n, n)`` over all tokens: the largest spectral norm (1 for a doubly stochastic
    matrix) and the largest row-sum and column-sum drift from 1 (Sinkhorn's non-final axis drifts; float64)."""
    h = h_res.detach().to(torch.float64)
    spectral = torch.linalg.matrix_norm(h, ord=2).amax()
    return spectral, (h.sum(-1) - 1).abs().amax(), (h.sum(-2) - 1).abs().amax()


def stream_statistics(moments: Tensor) -> dict[str, float]:
    """``{"norm": mean per-token l2 norm, "var": mean per-sentence variance}`` from summed :func:`stream_moments`."""
    tokens, norm_sum, sentences, var_sum = (float(v) for v in moments)
    return {
        "norm": norm_sum / tokens if tokens > 0 else math.nan,
        "var": var_sum / sentences if sentences > 0 else math.nan,
    }


def angular_distance(a: Tensor, b: Tensor) -> Tensor:
    """``arccos(sim) / pi`` per vector (last dimension), ``sim`` the cosine with NaN -> 0.5 (``metrics.py:20-24``),
    clamped to ``[-1, 1]`` (module docstring); float64."""
    a, b = _f64(a), _f64(b)
    sim = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    sim = sim.nan_to_num(nan=0.5).clamp(-1.0, 1.0)
    return torch.arccos(sim) / math.pi


def last_real_index(real: Tensor) -> Tensor:
    """``(B,)`` index of the last real position of every column of a ``(T, B)`` mask (any padding side)."""
    positions = torch.arange(real.size(0), device=real.device).unsqueeze(1)
    return torch.where(real, positions, torch.full_like(positions, -1)).amax(0)


def angle_moments(before: Tensor, after: Tensor, real: Tensor) -> Tensor:
    """``[tokens, sum of angles, sentences, sum of angles at each sentence's last real token]`` between
    two ``(T, B, C)`` streams (:func:`angular_distance` per token)."""
    d = angular_distance(before, after)  # (T, B)
    last = last_real_index(real)
    has = last >= 0
    at_last = d.gather(0, last.clamp(min=0).unsqueeze(0)).squeeze(0)
    return torch.stack(
        [
            real.sum().to(torch.float64),
            torch.where(real, d, 0.0).sum(),
            has.sum().to(torch.float64),
            torch.where(has, at_last, 0.0).sum(),
        ]
    )


def angle_statistics(moments: Tensor) -> dict[str, float]:
    """``{"mean": over real tokens, "last": over sentences at their last real token}`` from :func:`angle_moments`."""
    tokens, angle_sum, sentences, last_sum = (float(v) for v in moments)
    return {
        "mean": angle_sum / tokens if tokens > 0 else math.nan,
        "last": last_sum / sentences if sentences > 0 else math.nan,
    }


def max_attention_logit(
    q: Tensor,
    k: Tensor,
    num_heads: int,
    query_real: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
) -> Tensor:
    """Per head ``(H,)``: the maximum over batch, valid queries and unmasked keys of the score ``q . k``.

    ``q`` ``(T, B, H * dh)`` already multiplied by the softmax scale (as fairseq does before the product),
    ``k`` ``(S, B, H * dh)``; ``query_real`` ``(T, B)`` marks the queries that count (None: all);
    ``key_padding_mask`` ``(B, S)``, nonzero at padding; ``attn_mask`` ``(T, S)``, additive float or boolean
    with True = masked (fairseq's conventions). One head at a time, so that the ``(B, T, S)`` scores of a
    single head are the largest temporary. Computed in ``q``'s dtype (what the model computes), returned
    as float64.
    """
    tgt_len, bsz, _ = q.shape
    src_len = k.size(0)
    qh = q.detach().view(tgt_len, bsz, num_heads, -1)
    kh = k.detach().view(src_len, bsz, num_heads, -1)
    fill = None  # (B, T, S) True where a score does not count
    if key_padding_mask is not None and key_padding_mask.dim() > 0:
        fill = key_padding_mask.bool().view(bsz, 1, src_len).expand(bsz, tgt_len, src_len)
    if query_real is not None:
        q_out = (~query_real.bool()).t().reshape(bsz, tgt_len, 1)
        fill = q_out.expand(bsz, tgt_len, src_len) if fill is None else fill | q_out
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        m = attn_mask.view(1, tgt_len, src_len)
        fill = m.expand(bsz, tgt_len, src_len) if fill is None else fill | m
        attn_mask = None
    out = []
    for head in range(num_heads):
        scores = torch.einsum("tbd,sbd->bts", qh[:, :, head], kh[:, :, head])
        if attn_mask is not None:
            scores = scores + attn_mask.to(scores.dtype).unsqueeze(0)
        if fill is not None:
            scores = scores.masked_fill(fill, float("-inf"))
        out.append(scores.amax())
    return torch.stack(out).to(torch.float64)


def megatron_log_max(values: Sequence[float]) -> float:
    """Megatron's ``log_max_attention_logit``: ``max(0.0, max of the per-layer values)`` (``qk_clip.py``)."""
    m = 0.0
    for v in values:
        m = max(m, v)
    return m
