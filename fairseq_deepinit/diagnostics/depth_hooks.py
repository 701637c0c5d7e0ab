"""Statistics over depth collected from a model's forward pass by observing hooks (:mod:`.depth_stats` has
the formulas): the residual stream after every layer, the angular distance each layer moves it, the
maximum attention logit of every attention module, and mHC's ``H_res`` of every connection.

Hooks only observe; none changes an output:

- a forward hook on every layer of ``model.encoder.layers`` / ``model.decoder.layers`` sees the layer's
  input stream ``x`` (its first argument) and its output (the first element of a tuple output);
- a forward pre-hook on every fairseq :class:`~fairseq.modules.MultiheadAttention` inside those layers
  sees the attention's inputs (``query``, ``key``, ``key_padding_mask``, ``attn_mask``) and recomputes the
  scaled ``q`` and ``k`` from them with the module's own projections
  (:func:`~fairseq_deepinit.modules.probe.project_qk`): neither
  fairseq's fused path (``F.multi_head_attention_forward``) nor ``F.scaled_dot_product_attention`` exposes
  the scores, and recomputing them costs one extra ``q``/``k`` projection and one score product per head,
  on the updates that measure only. An attention class that forms ``q`` or ``k`` differently (QK-Norm)
  provides ``project_qk(query, key) -> (q * scaling, k)`` itself, and the hook uses that;
- an observer on every mHC connection (:class:`~fairseq_deepinit.modules.hyper.ManifoldHyperConnection`, with
  the stream statistics) sees its ``H_res`` and keeps the largest spectral norm and row/column-sum drift
  over all tokens (``diag_h_res_norm|row_drift|col_drift/<stack>.layers.<l>.<sub-layer>``);
- under hyper-connections a layer's ``(T, B, n, C)`` streams are measured as one ``n C`` vector per token, under
  Attention Residuals its ``(T, B, m, C)`` sources as their sum (the value the plain residual stream would hold):
  the stack's ``streams.measured``.

Which positions are real comes from the batch (``src_tokens`` for the encoder, ``prev_output_tokens`` for
the decoder, ``src_tokens`` for a decoder-only model), not from the masks the layers get: the plugin's
decoder passes no key padding mask under causal attention with right-padded targets. Everything stays on
the device; :class:`DepthStatistics` hands summable moments (:meth:`~DepthStatistics.sums`) and maxima
(:meth:`~DepthStatistics.maxima`) over, which the criterion reads with its other statistics in one copy.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
from fairseq.modules.multihead_attention import MultiheadAttention
from torch import Tensor

from ..modules.hyper import ManifoldHyperConnection
from ..modules.probe import bound_arguments, project_qk
from . import depth_stats
from .hooks import clean_name

STATS = ("stream", "angle", "logit")
# kinds of logging-output keys ("<kind>|<name>") this module turns into metrics (:func:`metrics`);
# "stream"/"angle" moments sum over logging outputs, "stream_max"/"logit"/"logit_all" are maxima
# mHC's H_res per connection (with "stream"): the largest spectral norm, row-sum and column-sum drift from 1
H_RES_KINDS = ("h_res_norm", "h_res_row_drift", "h_res_col_drift")
KINDS = ("stream", "stream_max", "angle", "logit", "logit_all", "scalar", *H_RES_KINDS)
MAX_KINDS = ("stream_max", "logit", "logit_all", *H_RES_KINDS)


def stack_inputs(model: nn.Module, net_input: Mapping) -> List[Tuple[str, nn.ModuleList, Tensor]]:
    """``[(stack, its layers, real (T, B))]`` for the model's encoder and decoder (decoder-only: the decoder)."""
    out = []
    encoder = getattr(model, "encoder", None)
    src = net_input.get("src_tokens")
    if encoder is not None and getattr(encoder, "layers", None) is not None and src is not None:
        out.append(("encoder", encoder.layers, src.ne(encoder.padding_idx).t()))
    decoder = getattr(model, "decoder", None)
    tokens = net_input.get("prev_output_tokens")
    if tokens is None and not out:
        tokens = src  # a decoder-only model reads its input from src_tokens
    if decoder is not None and getattr(decoder, "layers", None) is not None and tokens is not None:
        out.append(("decoder", decoder.layers, tokens.ne(decoder.padding_idx).t()))
    return out


def _measured(stack: nn.Module | None):
    """How a layer's ``(T, B, n, C)`` input and output are measured: the stack's ``streams.measured``, or the
    ``n C`` values of a token as one vector."""
    streams = getattr(stack, "streams", None)
    return streams.measured if streams is not None else (lambda t: t.flatten(2))


def _all_layers(layers: nn.ModuleList):
    """``(index, layer)`` of every layer: fairseq's ``LayerDropModuleList`` leaves layers out of its iteration in
    training, and the hooks go on all of them."""
    return [(i, layers[i]) for i in range(len(layers))]


def mhc_connections(layer: nn.Module) -> List[Tuple[str, ManifoldHyperConnection]]:
    """``(sub-layer, connection)`` of every mHC connection of a layer (``self_attn``, ``encoder_attn``, ``ffn``)."""
    return [(name.rsplit(".", 1)[-1], m) for name, m in layer.named_modules() if isinstance(m, ManifoldHyperConnection)]


def attention_modules(layer: nn.Module) -> List[Tuple[str, MultiheadAttention]]:
    """``[(name in the layer, module)]`` of every fairseq attention of ``layer`` (``self_attn``, ``encoder_attn``)."""
    return [(clean_name(n), m) for n, m in layer.named_modules() if isinstance(m, MultiheadAttention)]


def _merge_max(into: Dict[str, Tensor], key: str, value: Tensor) -> None:
    into[key] = value if key not in into else torch.maximum(into[key], value)


class DepthStatistics:
    """Collect the statistics of :data:`STATS` (a subset) while attached, over any number of forward passes.

    ``net_input`` is the batch's ``net_input`` (the real positions come from it); use one instance per
    batch, as a context manager around the model's forward::

        with DepthStatistics(model, sample["net_input"]) as depth:
            model(**sample["net_input"])
        depth.sums()      # {"stream|encoder.layers.0": moments, "angle|...": moments}   (add over batches)
        depth.maxima()    # {"stream_max|...": v, "logit|encoder.layers.0.self_attn": v, "logit_all|": v}
    """

    def __init__(self, model: nn.Module, net_input: Mapping, stats: Iterable[str] = STATS) -> None:
        stats = tuple(stats)
        unknown = sorted(set(stats) - set(STATS))
        if unknown:
            raise ValueError(f"unknown depth statistics {unknown}; choose from {STATS}")
        self.stream, self.angle, self.logit = ("stream" in stats, "angle" in stats, "logit" in stats)
        self.stacks = stack_inputs(model, net_input)
        self._views = {stack: _measured(getattr(model, stack, None)) for stack, _, _ in self.stacks}
        self._sums: Dict[str, Tensor] = OrderedDict()
        self._max: Dict[str, Tensor] = OrderedDict()
        self._handles: list = []
        self._observed: list = []  # (mHC connection, its observer)
        # every key a full forward pass gives, in model order: a layer that did not run (LayerDrop) still
        # has its entry, so that every rank holds the same keys in the same order (fairseq all-reduces
        # logging outputs as one flat buffer; :func:`all_reduce_max` stacks the maxima)
        self._expected_sums: Dict[str, torch.device] = OrderedDict()
        self._expected_max: Dict[str, torch.device] = OrderedDict()
        for stack, layers, real in self.stacks:
            for i, layer in _all_layers(layers):
                names = ([f"{stack}.input"] if i == 0 else []) + [f"{stack}.layers.{i}"]
                for name in names if self.stream else []:
                    self._expected_sums[f"stream|{name}"] = real.device
                    self._expected_max[f"stream_max|{name}"] = real.device
                if self.angle:
                    self._expected_sums[f"angle|{stack}.layers.{i}"] = real.device
                for sub, _ in mhc_connections(layer) if self.stream else []:
                    for kind in H_RES_KINDS:
                        self._expected_max[f"{kind}|{stack}.layers.{i}.{sub}"] = real.device
                for attn_name, _ in attention_modules(layer) if self.logit else []:
                    self._expected_max[f"logit|{stack}.layers.{i}.{attn_name}"] = real.device
                    self._expected_max["logit_all|"] = real.device

    # ---- hooks --------------------------------------------------------------------------------

    def attach(self) -> DepthStatistics:
        if self._handles:
            return self
        for stack, layers, real in self.stacks:
            for i, layer in _all_layers(layers):
                if self.stream or self.angle:
                    name, input_name = f"{stack}.layers.{i}", f"{stack}.input" if i == 0 else None
                    hook = self._layer_hook(name, input_name, real, self._views[stack])
                    self._handles.append(layer.register_forward_hook(hook, with_kwargs=True))
                for sub, connection in mhc_connections(layer) if self.stream else []:
                    self._observed.append((connection, self._h_res_observer(f"{stack}.layers.{i}.{sub}")))
                    connection.observers.append(self._observed[-1][1])
                if self.logit:
                    for name, attn in attention_modules(layer):
                        hook = self._attention_hook(f"{stack}.layers.{i}.{name}", real)
                        self._handles.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        for connection, observe in self._observed:
            connection.observers.remove(observe)
        self._handles, self._observed = [], []

    def __enter__(self) -> DepthStatistics:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def _add(self, key: str, value: Tensor) -> None:
        self._sums[key] = value if key not in self._sums else self._sums[key] + value

    def _layer_hook(self, name: str, input_name: str | None, real: Tensor, view):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
            x = args[0] if args else kwargs["x"]
            out = output[0] if isinstance(output, tuple) else output
            if out.dim() == 4:  # (T, B, n, C) streams or sources: one (T, B, C') vector per token
                x, out = view(x), view(out)
            if out.shape[:2] != real.shape:  # not this batch's stream (a caller's own call): not ours to measure
                return
            with torch.no_grad():
                if self.stream:
                    if input_name is not None:
                        self._add(f"stream|{input_name}", depth_stats.stream_moments(x, real))
                        _merge_max(self._max, f"stream_max|{input_name}", depth_stats.stream_max_abs(x, real))
                    self._add(f"stream|{name}", depth_stats.stream_moments(out, real))
                    _merge_max(self._max, f"stream_max|{name}", depth_stats.stream_max_abs(out, real))
                if self.angle:
                    self._add(f"angle|{name}", depth_stats.angle_moments(x, out, real))

        return hook

    def _h_res_observer(self, name: str):
        def observe(h_res: Tensor) -> None:
            with torch.no_grad():
                for kind, value in zip(H_RES_KINDS, depth_stats.h_res_maxima(h_res), strict=True):
                    _merge_max(self._max, f"{kind}|{name}", value)

        return observe

    def _attention_hook(self, name: str, real: Tensor):
        def hook(module: MultiheadAttention, args: tuple, kwargs: dict) -> None:
            a = bound_arguments(module, args, kwargs)
            if a.get("incremental_state") is not None:
                return  # a decoding step, not a training forward
            query = a["query"]
            if query.shape[:2] != real.shape:
                return
            with torch.no_grad():
                q, k = project_qk(module, query, a.get("key"))
                per_head = depth_stats.max_attention_logit(
                    q, k, module.num_heads, real, a.get("key_padding_mask"), a.get("attn_mask")
                )
            value = per_head.amax()
            _merge_max(self._max, f"logit|{name}", value)
            _merge_max(self._max, "logit_all|", value)

        return hook

    # ---- results ------------------------------------------------------------------------------

    def sums(self) -> Dict[str, Tensor]:
        """Summable moments by key (device tensors; they add up over batches and ranks); zeros for a layer
        that did not run."""
        empty = lambda device: torch.zeros(len(depth_stats.STREAM_MOMENTS), dtype=torch.float64, device=device)
        return OrderedDict((k, self._sums[k] if k in self._sums else empty(d)) for k, d in self._expected_sums.items())

    def maxima(self) -> Dict[str, Tensor]:
        """Maxima by key (device tensors, combined with ``max``; :class:`MaxAccumulator`); ``-inf`` for a
        layer that did not run."""
        empty = lambda device: torch.full((), -math.inf, dtype=torch.float64, device=device)
        return OrderedDict((k, self._max[k] if k in self._max else empty(d)) for k, d in self._expected_max.items())

    def values(self) -> Dict[str, float]:
        """Every statistic as its metric name and value, read in one copy (:func:`read_values`)."""
        return read_values(self.sums(), self.maxima())


def read_values(sums: Mapping[str, Tensor], maxima: Mapping[str, Tensor]) -> Dict[str, float]:
    """Summed moments and maxima (:meth:`DepthStatistics.sums`, :meth:`DepthStatistics.maxima`) as metric
    names and values, read from the device in one copy (``deepinit-diagnose``)."""
    keys = [*sums, *maxima]
    flat = [t.detach().reshape(-1).to(torch.float64) for t in (*sums.values(), *maxima.values())]
    if not flat:
        return OrderedDict()
    numbers = torch.cat(flat).tolist()
    out: Dict[str, float] = OrderedDict()
    start = 0
    for key, t in zip(keys, flat, strict=True):
        kind, rest = key.split("|", 1)
        out.update(metrics(kind, rest, torch.tensor(numbers[start : start + t.numel()], dtype=torch.float64)))
        start += t.numel()
    return out


class MaxAccumulator:
    """The maxima of one update, over its micro-batches (fairseq sums logging outputs, so maxima travel
    outside them): :meth:`add` after each collecting forward, :meth:`take` once when the update is reduced."""

    def __init__(self) -> None:
        self.update_num: int | None = None
        self.values: Dict[str, Tensor] = OrderedDict()

    def add(self, update_num: int, maxima: Mapping[str, Tensor]) -> None:
        if update_num != self.update_num:  # an update that was never reduced (an fp16 overflow) is dropped
            self.update_num, self.values = update_num, OrderedDict()
        for key, value in maxima.items():
            _merge_max(self.values, key, value)

    def take(self, update_num: int) -> Dict[str, Tensor]:
        values = self.values if update_num == self.update_num else OrderedDict()
        self.update_num, self.values = None, OrderedDict()
        return all_reduce_max(values)


def all_reduce_max(values: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """The maxima over the data-parallel ranks (one all-reduce; a no-op without torch.distributed).

    Every rank runs the same layers on an update that measures, so the keys line up across ranks.
    """
    dist = torch.distributed
    if not values or not (dist.is_available() and dist.is_initialized()):
        return values
    from fairseq.distributed import utils as dist_utils

    stacked = torch.stack([v.reshape(()) for v in values.values()])
    dist_utils.all_reduce(stacked, group=dist_utils.get_data_parallel_group(), op="max")
    return OrderedDict((k, stacked[i]) for i, k in enumerate(values))


def metrics(kind: str, rest: str, total: Tensor) -> List[Tuple[str, float]]:
    """The metric names and values of one summed logging-output entry ``<kind>|<rest>`` (a float64 CPU tensor);
    none for a layer that ran on no rank (no token counted, a maximum of ``-inf``)."""
    if kind in ("stream", "angle") and float(total.reshape(-1)[0]) == 0:
        return []
    if kind in MAX_KINDS and float(total.reshape(-1)[0]) == -math.inf:
        return []
    if kind == "stream":
        s = depth_stats.stream_statistics(total)
        return [(f"diag_stream_norm/{rest}", s["norm"]), (f"diag_stream_var/{rest}", s["var"])]
    if kind == "stream_max":
        return [(f"diag_stream_max/{rest}", float(total.reshape(-1)[0]))]
    if kind == "angle":
        s = depth_stats.angle_statistics(total)
        return [(f"diag_angle/{rest}", s["mean"]), (f"diag_angle_last/{rest}", s["last"])]
    if kind == "logit":
        return [(f"diag_max_logit/{rest}", float(total.reshape(-1)[0]))]
    if kind == "logit_all":
        return [("diag_max_logit/all", depth_stats.megatron_log_max([float(total.reshape(-1)[0])]))]
    if kind == "scalar":
        return [(rest, float(total.reshape(-1)[0]))]
    if kind in H_RES_KINDS:
        return [(f"diag_{kind}/{rest}", float(total.reshape(-1)[0]))]
    raise ValueError(f"not a depth statistic: {kind}")


# --------------------------------------------------------------------------------------------
# the metric names as curves over depth (deepinit-diagnose's JSON and plots, the training log's plots)
# --------------------------------------------------------------------------------------------

_NAME = re.compile(
    r"^diag_(stream_norm|stream_var|stream_max|angle|angle_last|max_logit)/(\w+)\.(input|layers\.(\d+)(?:\.(.+))?)$"
)


def by_depth(values: Mapping[str, float]) -> dict:
    """Metric values grouped as curves over depth.

    ``{"stream_norm": {"encoder": [input, layer 1, ..., layer L]}, "stream_var": ..., "stream_max": ...,
    "angle": {"encoder": [layer 1, ..., L]}, "angle_last": ..., "max_logit": {"encoder.self_attn": [...],
    "decoder.encoder_attn": [...]}, "max_logit_all": value}``; a layer without a value (LayerDrop) is None.
    """
    points: Dict[str, Dict[str, Dict[int, float]]] = {}
    out: dict = {}
    for name, v in values.items():
        if name == "diag_max_logit/all":
            out["max_logit_all"] = v
            continue
        m = _NAME.match(name)
        if not m:
            continue
        stat, stack, where, layer, attn = m.groups()
        if where == "input":
            depth, curve = 0, stack
        else:
            depth = int(layer) + 1
            curve = f"{stack}.{attn}" if stat == "max_logit" else stack
        points.setdefault(stat, {}).setdefault(curve, {})[depth] = v
    for stat, curves in points.items():
        out[stat] = {}
        for curve, pts in curves.items():
            first = 0 if stat.startswith("stream") else 1
            last = max(pts)
            out[stat][curve] = [pts.get(d) for d in range(first, last + 1)]
    return out
