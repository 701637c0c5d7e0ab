"""``deepinit-diagnose``'s statistics over depth: ``--measure depth`` and ``--measure removal`` on a model,
and ``--training-log`` for the same statistics over updates from a ``fairseq-train`` log.

- ``depth``: the residual stream after every layer, the angular distance between consecutive layers
  and the maximum attention logit per layer (:mod:`.depth_hooks`, formulas in :mod:`.depth_stats`), on
  the first ``--num-batches`` batches in eval mode (dropout off, as the released analysis scripts run
  their models), pooled over the batches exactly as training pools micro-batches;
- ``removal``: the loss with each layer removed in turn (:mod:`.layer_removal`), on the same batches;
  ``--subset valid`` gives the released repositories' setting (a held-out set);
- ``--training-log LOG``: the ``train_inner`` lines of a ``fairseq-train`` log (``--log-format json`` or
  ``simple``, the format fairseq uses when its output is not a terminal) with the diagnostics criterion's
  statistics, plotted over updates, and the spike and loss-scale-drop counters.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from typing import Dict, List, Sequence

import torch
import torch.nn as nn

from ..errors import DeepInitConfigError
from . import depth_plots, layer_removal
from .depth_hooks import DepthStatistics, by_depth, read_values
from .training_counters import GNORM_SPIKES, LOSS_SPIKES, SCALE_DROPS

MEASURES = ("depth", "removal")
COUNTERS = (LOSS_SPIKES, GNORM_SPIKES, SCALE_DROPS)


def measure_depth(model: nn.Module, batches: Sequence[dict]) -> dict:
    """Every depth statistic of ``model`` on ``batches`` (eval mode), as metric values and curves over depth."""
    was_training = model.training
    model.eval()
    sums: Dict[str, torch.Tensor] = OrderedDict()
    maxima: Dict[str, torch.Tensor] = OrderedDict()
    with torch.no_grad():
        for batch in batches:
            with DepthStatistics(model, batch["net_input"]) as depth:
                model(**batch["net_input"])
            for k, v in depth.sums().items():
                sums[k] = sums[k] + v if k in sums else v
            for k, v in depth.maxima().items():
                maxima[k] = torch.maximum(maxima[k], v) if k in maxima else v
    model.train(was_training)
    values = read_values(sums, maxima)
    return {"values": values, **by_depth(values)}


def measure_removal(model: nn.Module, criterion, batches: Sequence[dict]) -> dict:
    out = layer_removal.removal_losses(model, criterion, batches)
    full = out["full"]["loss"]
    for stack in layer_removal.stacks(model):
        out[f"{stack}_increase"] = [r["loss"] - full for r in out[stack]]
    return out


def plot(result: dict, out_dir: str) -> List[str]:
    """The figures of whatever this module measured in ``result``."""
    written = []
    label = result.get("label", "")
    depth = result.get("depth")
    if depth:
        for figure, name in ((depth_plots.STREAM, "residual_stream.png"), (depth_plots.ANGLE, "angular_distance.png")):
            written.append(depth_plots.plot_over_depth(figure, depth, label, os.path.join(out_dir, name)))
        if depth.get("max_logit"):
            written.append(depth_plots.plot_max_logit(depth, label, os.path.join(out_dir, "max_attention_logit.png")))
    if result.get("layer_removal"):
        target = os.path.join(out_dir, "layer_removal.png")
        written.append(depth_plots.plot_removal(result["layer_removal"], label, target))
    return written


def _fmt(values: Sequence) -> str:
    return " ".join("-" if v is None else f"{v:.3g}" for v in values)


def summary_lines(result: dict) -> List[str]:
    lines = []
    depth = result.get("depth") or {}
    for stack, values in depth.get("stream_norm", {}).items():
        lines.append(f"  residual stream norm {stack} input, layers 1..{len(values) - 1}: {_fmt(values)}")
    for stack, values in depth.get("angle", {}).items():
        lines.append(f"  angular distance {stack} layers 1..{len(values)}: {_fmt(values)}")
    for curve, values in depth.get("max_logit", {}).items():
        lines.append(f"  max attention logit {curve} layers 1..{len(values)}: {_fmt(values)}")
    removal = result.get("layer_removal")
    if removal:
        lines.append(f"  loss (base 2) of the full model: {removal['full']['loss']:.4f}")
        for stack in ("encoder", "decoder"):
            if f"{stack}_increase" in removal:
                lines.append(f"  loss increase without {stack} layer 1..: {_fmt(removal[f'{stack}_increase'])}")
    return lines


# --------------------------------------------------------------------------------------------
# the training log
# --------------------------------------------------------------------------------------------

_SIMPLE_PAIR = re.compile(r"([\w./\-]+)=([^,\s]+)")


def _number(text) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def read_training_log(path: str) -> List[dict]:
    """``[{"num_updates": n, metric: value, ...}]`` of every ``train_inner`` line with diagnostics, in order."""
    if not os.path.isfile(path):
        raise DeepInitConfigError(f"--training-log {path} not found (give the output of fairseq-train)")
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            marker = line.find("| train_inner |")
            if marker < 0:
                continue
            body = line[marker + len("| train_inner |") :].strip()
            if body.startswith("{"):
                try:
                    raw = json.loads(body)
                except json.JSONDecodeError:
                    continue
            else:
                raw = dict(_SIMPLE_PAIR.findall(body))
            values = {k: _number(v) for k, v in raw.items()}
            if values.get("num_updates") is None or not any(k.startswith("diag_") for k in values):
                continue
            records.append({k: v for k, v in values.items() if v is not None})
    if not records:
        raise DeepInitConfigError(
            f"--training-log {path}: no train_inner line with diagnostics; train with --criterion "
            "label_smoothed_cross_entropy_diagnostics (or cross_entropy_diagnostics), --log-format json or simple, "
            "and a --log-interval that divides --diagnostics-interval"
        )
    return records


def plot_training_log(path: str, out_dir: str, records: List[dict] | None = None) -> List[str]:
    """The statistics over depth and the counters of a training log, over updates (one figure each);
    ``records``: the log as :func:`read_training_log` returned it (read here when None)."""
    records = read_training_log(path) if records is None else records
    updates = [int(r["num_updates"]) for r in records]
    per_update = [by_depth(r) for r in records]
    written = []
    for stat in depth_plots.TITLES:
        if any(d.get(stat) for d in per_update):
            target = os.path.join(out_dir, f"training_{stat}.png")
            written.append(depth_plots.plot_over_updates(stat, updates, per_update, target))
    counters = OrderedDict((c, [r.get(c, 0.0) for r in records]) for c in COUNTERS if any(c in r for r in records))
    if counters:
        written.append(depth_plots.plot_counters(updates, counters, os.path.join(out_dir, "training_counters.png")))
    return written
