"""Plots of the statistics over depth (matplotlib, Agg backend), one figure per statistic.

Over depth, from one measurement (``deepinit-diagnose --measure depth,removal``): the residual stream's
size after every layer (LayerNorm Scaling, Sun et al. 2025, and Peri-LN, Kim et al. 2025, plot it), the
angular distance between consecutive layers (ShortGPT section 3.2 as LayerNorm Scaling's and Mix-LN's
``utils/short_hf.py`` compute it), the maximum attention logit per layer (Megatron-LM's
``log_max_attention_logit``, per layer), and the loss with one layer removed (``layer_remove.py``).
Over updates, from a training log (``deepinit-diagnose --training-log``): the same per-layer statistics
as logged every ``--diagnostics-interval`` updates, and the spike and loss-scale-drop counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from .plots import _plt, _save


@dataclass(frozen=True)
class Panel:
    """One panel of a figure over depth: the statistic, its y label, an optional title and whether the y axis
    starts at 0 (all but the residual stream's variance, whose axis follows its values)."""

    stat: str
    ylabel: str
    title: str | None = None
    from_zero: bool = True


@dataclass(frozen=True)
class DepthFigure:
    """A row of :class:`Panel` s over the layers of each stack; ``first`` is the x of a curve's first value
    (0: the first layer's input, 1: the first layer), ``width`` each panel's width in inches."""

    panels: Tuple[Panel, ...]
    first: int
    xlabel: str
    suptitle: str
    width: float


STREAM = DepthFigure(
    panels=(
        Panel("stream_norm", "mean ||h||_2 per token"),
        Panel("stream_var", "Var per sentence (OLMo-core GAP)", from_zero=False),
        Panel("stream_max", "max |h| (OLMo-core GAP)"),
    ),
    first=0,
    xlabel="layer (0: the first layer's input)",
    suptitle="residual stream after every layer (LayerNorm Scaling, Peri-LN)",
    width=4.0,
)
ANGLE = DepthFigure(
    panels=(
        Panel("angle", "arccos(cos) / pi", "mean over real tokens"),
        Panel("angle_last", "arccos(cos) / pi", "last real token (ShortGPT)"),
    ),
    first=1,
    xlabel="layer l (distance between the streams after l-1 and l)",
    suptitle="angular distance between consecutive layers (LayerNorm Scaling, Mix-LN)",
    width=4.5,
)
TITLES = {
    "stream_norm": "residual stream: mean per-token l2 norm",
    "stream_var": "residual stream: per-sentence variance (OLMo-core GAP)",
    "stream_max": "residual stream: max |h| (OLMo-core GAP)",
    "angle": "angular distance to the previous layer (mean over real tokens)",
    "angle_last": "angular distance to the previous layer (last real token)",
    "max_logit": "maximum attention logit (Megatron log_max_attention_logit, per layer)",
}


def _integer_axes(ax, y: bool = False) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if y:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _xs(values: Sequence, first: int) -> List[int]:
    return list(range(first, first + len(values)))


def _points(values: Sequence, first: int):
    pts = [(x, v) for x, v in zip(_xs(values, first), values, strict=True) if v is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_over_depth(figure: DepthFigure, depth: dict, label: str, path: str) -> str:
    """``figure``'s statistics of one measurement over depth (``deepinit-diagnose --measure depth``): a panel
    per statistic, a curve per stack; a layer without a value (None) is left out of its curve."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(figure.panels), figsize=(figure.width * len(figure.panels), 3.2))
    for ax, panel in zip(axes, figure.panels, strict=True):
        for i, (stack, values) in enumerate(depth.get(panel.stat, {}).items()):
            ax.plot(*_points(values, figure.first), marker="o", ms=3, label=stack, color=f"C{i}")
        ax.set_xlabel(figure.xlabel)
        _integer_axes(ax)
        ax.set_ylabel(panel.ylabel)
        if panel.from_zero:
            ax.set_ylim(bottom=0)
        if panel.title is not None:
            ax.set_title(panel.title, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{figure.suptitle}\n{label}", fontsize=8)
    return _save(fig, path)


def plot_max_logit(depth: dict, label: str, path: str) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for i, (curve, values) in enumerate(depth.get("max_logit", {}).items()):
        ax.plot(*_points(values, 1), marker="o", ms=3, label=curve.replace(".", " "), color=f"C{i}")
    if depth.get("max_logit_all") is not None:
        ax.axhline(depth["max_logit_all"], ls=":", lw=0.8, color="grey", label="max over layers (Megatron)")
    ax.set_xlabel("layer")
    _integer_axes(ax)
    ax.set_ylabel("max scale * q.k")
    ax.set_title(f"maximum attention logit per layer\n{label}", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    return _save(fig, path)


def plot_removal(removal: dict, label: str, path: str) -> str:
    plt = _plt()
    stacks = [s for s in ("encoder", "decoder") if removal.get(s)]
    fig, axes = plt.subplots(1, len(stacks), figsize=(4.5 * len(stacks), 3.2), squeeze=False)
    full = removal["full"]["loss"]
    for ax, stack in zip(axes[0], stacks, strict=True):
        losses = [r["loss"] - full for r in removal[stack]]
        ax.bar(_xs(losses, 1), losses, color="C0" if stack == "encoder" else "C1")
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xlabel(f"{stack} layer removed")
        _integer_axes(ax)
        ax.set_ylabel("loss increase (base 2)")
        ax.set_title(f"{stack} (full model: loss {full:.3f})", fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"loss with one layer removed (LayerNorm Scaling / Mix-LN layer_remove.py)\n{label}", fontsize=8)
    return _save(fig, path)


def plot_over_updates(stat: str, updates: List[int], per_update: List[dict], path: str) -> str:
    """One statistic of the training log over updates: a panel per curve (stack or attention kind), a
    line per layer, coloured from the first (dark) to the last layer (light)."""
    plt = _plt()
    curves: List[str] = []
    for depth in per_update:
        curves += [c for c in depth.get(stat, {}) if c not in curves]
    fig, axes = plt.subplots(1, len(curves), figsize=(4.5 * len(curves), 3.2), squeeze=False)
    cmap = plt.get_cmap("viridis")
    first = 0 if stat.startswith("stream") else 1
    for ax, curve in zip(axes[0], curves, strict=True):
        n = max(len(d.get(stat, {}).get(curve, [])) for d in per_update)
        for j in range(n):
            xs, ys = [], []
            for u, d in zip(updates, per_update, strict=True):
                values = d.get(stat, {}).get(curve, [])
                if j < len(values) and values[j] is not None:
                    xs.append(u)
                    ys.append(values[j])
            name = "input" if first == 0 and j == 0 else f"layer {j + first}"
            ax.plot(xs, ys, lw=1, color=cmap(j / max(n - 1, 1)), label=name)
        ax.set_xlabel("update")
        _integer_axes(ax)
        ax.set_title(curve.replace(".", " "), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5, ncol=2)
    fig.suptitle(TITLES.get(stat, stat) + ", from the training log", fontsize=8)
    return _save(fig, path)


def plot_counters(updates: List[int], counters: Dict[str, List[float]], path: str) -> str:
    """The counters of every diagnostic interval (bars) and their running total (line)."""
    plt = _plt()
    names = list(counters)
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.0), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        values = counters[name]
        gaps = [b - a for a, b in zip(updates, updates[1:], strict=False)]
        width = max(1.0, 0.8 * min(gaps)) if gaps else 1.0
        ax.bar(updates, values, width=width, color="C3", label="in the interval")
        total, running = 0.0, []
        for v in values:
            total += v
            running.append(total)
        ax.step(updates, running, where="post", color="C0", label="running total")
        ax.set_xlabel("update")
        _integer_axes(ax, y=True)
        ax.set_title(name.replace("diag_", "").replace("_", " "), fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("instability counters, counted between diagnostic updates", fontsize=8)
    return _save(fig, path)
