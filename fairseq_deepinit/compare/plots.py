"""``deepinit-compare``'s PNG plots (matplotlib, Agg backend): every candidate's validation nll curve on
one figure, and the per-layer gradient-norm profile at update 1 (the initial model's gradient) and
after the first updates (the first validation's update)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import List, Sequence

from .report import _layers


def _pyplot():
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its start-up and font search log at DEBUG otherwise
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def valid_curves(ranked: Sequence[dict], path: Path, stall_bits: float) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in ranked:
        pts = [(u, nll) for u, _, nll in r["valid"] if math.isfinite(nll)]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", ms=3, label=f"{r['method']} ({r['status']})")
    ax.axhline(stall_bits, color="grey", ls=":", lw=1, label="unigram model")
    ax.set_xlabel("update")
    ax.set_ylabel("validation nll (bits/token)")
    ax.set_title("Validation loss of every candidate")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gradient_profiles(ranked: Sequence[dict], path: Path, stacks: List[str]) -> Path:
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(stacks), figsize=(6 * len(stacks), 4.5), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, stack in zip(axes[0], stacks, strict=True):
        for i, r in enumerate(ranked):
            for key, style, when in (("gnorm_init", "-", "update 1"), ("gnorm_early", "--", "")):
                prof = r[key]
                g = _layers(prof, stack)
                if g and all(x > 0 and math.isfinite(x) for x in g):
                    label = f"{r['method']} {when or 'update ' + str(prof.get('update'))}"
                    ax.plot(range(1, len(g) + 1), g, style, color=colors[i % len(colors)], label=label)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(f"{stack} layer")
        ax.set_ylabel("gradient norm")
        ax.set_title(f"{stack}: gradient norm per layer")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
