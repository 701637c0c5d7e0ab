"""The plots of ``deepinit-diagnose`` (matplotlib, Agg backend), one function per paper figure.

Each takes the measurement records of :mod:`.diagnose` and writes one PNG: gradient norm per layer
(DS-Init, Zhang et al. 2019, Fig. 1), beta_LN / beta_RC / beta / Var(r) per sub-layer (DS-Init
Table 1), norm-layer input norms (T-Fixup, Huang et al. 2020, Fig. 3), output change against depth
(Admin, Liu et al. 2020, Fig. 4) and ScaleNorm g against depth (Transformers without Tears, Fig. 3).
"""

from __future__ import annotations

import re
from typing import Dict, List

from .stats import sublayer_type

FLOW_KEYS = ("beta_ln", "beta_rc", "beta", "var_r")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _plt().close(fig)
    return path


def _stacks(runs: List[dict], present) -> List[str]:
    """``encoder``/``decoder`` in that order, those that some run has (a language model: the decoder)."""
    return [s for s in ("encoder", "decoder") if any(present(run, s) for run in runs)] or ["decoder"]


def plot_grad_norm(runs: List[dict], path: str) -> str:
    plt = _plt()
    stacks = _stacks(runs, lambda run, s: bool(run["grad_norm"].get(s)))
    fig, axes = plt.subplots(1, len(stacks), figsize=(4 * len(stacks), 3.2), squeeze=False)
    axes = axes[0]
    for ax, stack in zip(axes, stacks, strict=True):
        for i, run in enumerate(runs):  # one colour per run in every panel
            values = run["grad_norm"].get(stack) or []
            ax.plot(range(1, len(values) + 1), values, marker="o", ms=3, label=run["label"], color=f"C{i}")
        ax.set_yscale("log")
        ax.set_xlabel(f"{stack} layer")
        ax.set_ylabel("gradient norm")
        ax.set_title(f"{stack} (DS-Init Fig. 1)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7)
    return _save(fig, path)


def _depth_of(sub: str) -> int:
    return int(sub.split(".")[2]) + 1


def plot_gradient_flow(run: dict, path: str) -> str:

    plt = _plt()
    per_sub = run["gradient_flow"]["per_sublayer"]
    fig, axes = plt.subplots(1, 4, figsize=(11, 3.0))
    titles = {"beta_ln": "beta_LN", "beta_rc": "beta_RC", "beta": "beta", "var_r": "Var(r)"}
    types: Dict[str, List[str]] = {}
    for sub in per_sub:
        types.setdefault(sublayer_type(sub), []).append(sub)
    for ax, key in zip(axes, FLOW_KEYS, strict=True):
        for t, subs in types.items():
            ax.plot([_depth_of(s) for s in subs], [per_sub[s][key] for s in subs], marker="o", ms=3, label=t)
        if key != "var_r":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(titles[key] + " (DS-Init Tab. 1)", fontsize=9)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=6)
    fig.suptitle(run["label"], fontsize=9)
    return _save(fig, path)


def plot_norm_input(run: dict, path: str) -> str:
    plt = _plt()
    stats = run["norm_input"]
    groups: Dict[str, List[tuple]] = {}
    for name, s in stats.items():
        parts = name.split(".")
        if len(parts) >= 4 and parts[1] == "layers":
            groups.setdefault(f"{parts[0]} {parts[3]}", []).append((int(parts[2]) + 1, s["mean_norm"]))
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for g, pts in groups.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=g)
    ax.set_xlabel("layer")
    ax.set_ylabel("mean ||input||_2")
    ax.set_title(f"norm-layer input (T-Fixup Fig. 3)\n{run['label']}", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    return _save(fig, path)


def _sweep_label(run: dict) -> str:
    """The run's label without its ``<N>L`` suffix: the output-change sweep sets the depth itself."""
    return re.sub(rf"\s*\b{run.get('encoder_layers')}L$", "", run["label"]) or run["label"]


def plot_output_change(runs: List[dict], path: str) -> str:
    plt = _plt()
    stacks = _stacks(runs, lambda run, s: s in run["output_change"]["random"]["fit"])
    fig, axes = plt.subplots(2, len(stacks), figsize=(4 * len(stacks), 5.6), squeeze=False)
    for row, kind in enumerate(("random", "adam")):
        for col, stack in enumerate(stacks):
            ax = axes[row][col]
            for i, run in enumerate(runs):  # one colour per run in every panel
                oc = run["output_change"]
                if stack not in oc[kind]["fit"]:  # a language model among translation models
                    continue
                depths, values, fit = oc["depths"], oc[kind][stack], oc[kind]["fit"][stack]
                label = f"{_sweep_label(run)} (N^{fit['exponent']:.2f})"
                line = ax.plot(depths, values, marker="o", ms=3, label=label, color=f"C{i}")
                xs = [min(depths), max(depths)]
                ax.plot(xs, [fit["intercept"] + fit["slope"] * x for x in xs], ls=":", color=line[0].get_color())
            what = "random delta" if kind == "random" else "one Adam step"
            ax.set_title(f"{stack} output, {what}", fontsize=9)
            ax.set_xlabel("layers per stack N")
            ax.set_ylabel("|F(x,W) - F(x,W+delta)|^2")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle("output change against depth (Admin Fig. 4); dotted: linear fit", fontsize=9)
    return _save(fig, path)


def plot_scalenorm(run: dict, path: str) -> str:
    plt = _plt()
    groups: Dict[str, List[tuple]] = {}
    for name, g in run["scalenorm_g"].items():
        parts = name.split(".")
        if len(parts) >= 4 and parts[1] == "layers":
            groups.setdefault(f"{parts[0]} {parts[3]}", []).append((int(parts[2]) + 1, g))
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for g, pts in groups.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=g)
    for name, g in run["scalenorm_g"].items():
        if ".layers." not in name:
            ax.axhline(g, ls=":", lw=0.8, color="grey")
            ax.annotate(name, (1, g), fontsize=6)
    ax.set_xlabel("layer")
    ax.set_ylabel("ScaleNorm g")
    ax.set_title(f"learned ScaleNorm g (TwT Fig. 3)\n{run['label']}", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    return _save(fig, path)


# --------------------------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------------------------
