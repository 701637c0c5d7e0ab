"""Diagnostics beside the papers' plots: residual-stream size, max attention logit, angular distance between
layers, loss with one layer removed.

Residual stream size. OLMo-core's ``GAPMonitorCallback`` (``src/olmo_core/train/callbacks/gap_monitor.py``,
commit fa6c501) hooks every module's output (``pre_train``, ``112-129``; a block's output is the residual
stream after that layer) and records per activation (``record_tensor_stats``, ``182-247``, activations
``196-231``): ``max |x|`` over the local tensor, and ``var``/``mean`` computed per instance over the
flattened ``T * C`` values (``torch.var_mean``, unbiased, ``331-333``) then averaged over instances
(:func:`gap_activation_stats`). The per-token L2 norm averaged over non-padding tokens
(:func:`residual_norms`) is this project's companion statistic (no released code computes exactly it).

Max attention logit. Megatron-LM ``megatron/core/optimizer/qk_clip.py`` ``prepare_qk_clip`` (index commit
2ba9903): ``log_max_attention_logit = max(0.0, max over layers of logits.max())`` where ``logits`` is each
self-attention's ``core_attention.current_max_attn_logits`` (one value per head), all-reduced with MAX over
the data(+context)-parallel group; it starts from ``0.0``, so the logged value is never negative.
The per-head value comes from TransformerEngine (``return_max_logit=True``,
``transformer_engine/pytorch/cpp_extensions/fused_attn.py`` ``fused_attn_fwd``): ``max_logit =
amax(Max, dims=(batch, seq_q))`` of cuDNN's softmax statistic ``Max`` (per row max of the pre-softmax
scores ``softmax_scale * q . k`` after masking); newer TE versions set padded query rows to ``-inf`` first.
So per head: ``max over batch, valid queries, unmasked keys of scale * q . k``. :func:`max_attention_logit`.

Angular distance. lmsdss/LayerNorm-Scaling (commit 3ac54dd) and pixeli99/MixLN (commit ff45826) ship the
same ``utils/metrics.py:4-26`` ``block_influence``: rows flattened to ``(B*S, D)``, ``sim = <a, b> / (|a||b|)``
(diagonal of the product), ``nan_to_num(nan=0.5)``, angular: ``arccos(sim) / pi``, else ``1 - sim``.
``utils/short_hf.py`` uses only the last token (``in_hidden[:, -1:]``, ShortGPT section 3.2) of the HF
``output_hidden_states`` (embedding output, then every layer's output; the last entry is after the final
norm) and accumulates per layer: ``.mean()`` in LayerNorm-Scaling (``short_hf.py:168-192``), ``.sum()``
over the batch in MixLN (``short_hf.py:61-80``); MixLN compares ``hiddens[i]`` with ``hiddens[i + n]``
with ``n = n_prune_layers`` (1 in ``angular_distance.py``). :func:`angular_distance`, :func:`layer_distances`.

Loss spikes. OLMo-core's ``StabilityMonitorCallback``: :func:`olmo_spike_flags`.

Layer removal. ``layer_remove.py:8-27`` (both repositories) deletes ``model.model.layers[i]`` and
renumbers only ``self_attn.layer_idx`` (KV cache); the other layers keep their weights and positions in the
residual stream: the removed layer is the identity. :func:`forward_without_layer`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def residual_norms(hiddens: Sequence[Tensor], padding_mask: Tensor | None = None) -> list[float]:
    """Mean over non-padding tokens of ``||h_l[b, t]||_2`` for each ``(B, T, C)`` entry of ``hiddens``."""
    out = []
    for h in hiddens:
        n = h.double().norm(dim=-1)
        if padding_mask is not None:
            keep = ~padding_mask
            out.append(float(n[keep].mean()))
        else:
            out.append(float(n.mean()))
    return out


def gap_activation_stats(t: Tensor) -> dict[str, float]:
    """OLMo-core GAP activation statistics of one ``(B, ...)`` tensor (``gap_monitor.py:196-212``)."""
    flat = t.detach().double().reshape(t.shape[0], -1)
    var, mean = torch.var_mean(flat, dim=-1)
    return {
        "max": float(flat.abs().max()),
        "mean": float(mean.sum() / t.shape[0]),
        "var": float(var.sum() / t.shape[0]),
    }


def max_attention_logit(logits: Tensor) -> Tensor:
    """Per-head maximum of pre-softmax scores ``(B, H, T, S)`` with masked entries at ``-inf``."""
    return logits.detach().amax(dim=(0, 2, 3))


def megatron_log_max(per_layer_per_head: Sequence[Tensor]) -> float:
    """``prepare_qk_clip``'s logged value: ``max(0.0, max over layers and heads)``."""
    m = 0.0
    for logits in per_layer_per_head:
        m = max(m, float(logits.max()))
    return m


def block_influence(a: Tensor, b: Tensor, angular: bool = False) -> Tensor:
    """``metrics.py:4-26``: per row ``arccos(sim) / pi`` (angular) or ``1 - sim``; ``sim`` nan -> 0.5."""
    d = a.shape[-1]
    a = a.reshape(-1, d)
    b = b.reshape(-1, d)
    sim = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    sim = sim.nan_to_num(nan=0.5)
    if angular:
        return torch.arccos(sim) / math.pi
    return 1 - sim


def angular_distance(a: Tensor, b: Tensor) -> Tensor:
    return block_influence(a, b, angular=True)


def layer_distances(
    hiddens: Sequence[Tensor], n: int = 1, last_token: bool = True, reduce: str = "mean"
) -> list[float]:
    """Per layer ``i``: distance between ``hiddens[i]`` and ``hiddens[i + n]`` (``short_hf.py``).

    ``reduce="mean"`` is LayerNorm-Scaling, ``"sum"`` MixLN. ``last_token=False`` averages every position
    (this project's option for translation, where the last position of a padded batch is padding).
    """
    out = []
    for i in range(len(hiddens) - n):
        a, b = hiddens[i], hiddens[i + n]
        if last_token:
            a, b = a[:, -1:], b[:, -1:]
        v = angular_distance(a, b)
        out.append(float(v.mean() if reduce == "mean" else v.sum()))
    return out


def forward_without_layer(
    x: Tensor, layers: Sequence[Callable[[Tensor], Tensor]], skip: int | None, final: Callable[[Tensor], Tensor]
) -> Tensor:
    """Run ``layers`` in order with ``layers[skip]`` replaced by the identity, then ``final``."""
    for i, layer in enumerate(layers):
        if i != skip:
            x = layer(x)
    return final(x)


def olmo_spike_flags(values: Sequence[float], window: int = 128, threshold_std: float = 6.0) -> list[bool]:
    """OLMo-core ``StabilityMonitorCallback`` (``src/olmo_core/train/callbacks/stability_monitor.py``, commit
    fa6c501): per value, ``_is_spike`` (``117-135``: only with a full history of ``window`` values, population
    std, no spike when ``std < 1e-10``, spike when ``value > mean + threshold_std * std``), checked before the
    value joins the history (``85-89``), which keeps the last ``window`` values (``69-73``)."""
    history: list[float] = []
    flags = []
    for value in values:
        spike = False
        if len(history) >= window:
            mean = sum(history) / len(history)
            std = math.sqrt(sum((x - mean) ** 2 for x in history) / len(history))
            spike = std >= 1e-10 and value > mean + threshold_std * std
        flags.append(spike)
        history.append(value)
        if len(history) > window:
            history.pop(0)
    return flags
