"""``deepinit-compare``'s ranking, ``summary.json`` and ``report.md``.

Ranking: ``ok`` and ``stalled`` candidates first, then ``diverged``, then ``failed``; within each group by
the best validation loss at equal updates: the lowest loss among the validations at or before the
horizon, the last validated update that every ``ok`` / ``stalled`` candidate reached (all of them reach
``--max-update`` unless ``--budget-min`` stopped some); a candidate without a validation ranks last of
its group.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Sequence

GROUP = {"ok": 0, "stalled": 0, "diverged": 1, "failed": 2}
STATUS_MEANING = {
    "ok": "trained: finite losses, the best validation nll below the unigram model's and still improving in "
    "the second half of the run",
    "stalled": "finite, but the best validation nll never got below the unigram model's (a model that ignores "
    "its input), or the second half of the run improved it by less than 0.1 bits: it stopped learning",
    "diverged": "a non-finite loss or gradient stopped training (the divergence guard names the update and the "
    "first layer whose output went non-finite), or a non-finite validation loss",
    "failed": "fairseq-train exited with an error of another kind (a refused option combination, out of memory, "
    "...); the reason is its one-line error",
}


def horizon(records: Sequence[dict]) -> int | None:
    """The last validated update every ok / stalled candidate reached (None: none validated)."""
    reached = [r["valid"][-1][0] for r in records if GROUP[r["status"]] == 0 and r["valid"]]
    return min(reached) if reached else None


def loss_at(r: dict, at: int | None) -> float | None:
    """The best finite validation loss of ``r`` at or before update ``at`` (all of them if None)."""
    losses = [v[1] for v in r["valid"] if (at is None or v[0] <= at) and math.isfinite(v[1])]
    return min(losses) if losses else None


def rank(records: Sequence[dict]) -> List[dict]:
    """``records`` best first (module docstring), each with ``rank``, ``horizon`` and ``loss_at_horizon``."""
    h = horizon(records)
    out = []
    for r in records:
        out.append({**r, "horizon": h, "loss_at_horizon": loss_at(r, h)})
    out.sort(key=lambda r: (GROUP[r["status"]], r["loss_at_horizon"] is None, r["loss_at_horizon"] or 0.0))
    for i, r in enumerate(out, 1):
        r["rank"] = i
    return out


def _num(x, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def write_summary(path: Path, ranked: List[dict], meta: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**meta, "methods": ranked}, indent=1))
    tmp.replace(path)


def _layers(profile: Dict[str, float], stack: str) -> List[float]:
    keys = sorted((k for k in profile if k.startswith(f"{stack}.layers.")), key=lambda k: int(k.rsplit(".", 1)[1]))
    return [profile[k] for k in keys]


def gradient_line(profile: Dict[str, float], stack: str) -> str:
    """``bottom B, top T (top/bottom R)`` of ``stack``'s per-layer gradient norms."""
    g = _layers(profile, stack)
    if not g:
        return "-"
    ratio = g[-1] / g[0] if g[0] > 0 else math.inf
    return f"{g[0]:.2g} / {g[-1]:.2g} ({ratio:.3g})"


def report_md(ranked: List[dict], meta: dict, plots: Sequence[str]) -> str:
    """The report: the ranked table, what each status means, the commands, what the comparison says."""
    stacks = ["decoder"] if meta["task"] == "language_modeling" else ["encoder", "decoder"]
    h = ranked[0]["horizon"] if ranked else None
    lines = [
        f"# deepinit-compare: {len(ranked)} candidates at depth {meta['depth']}",
        "",
        f"Data `{meta['data']}` ({meta['task']}), {meta['max_update']} updates per candidate, validation every "
        f"{meta['valid_every']} updates, on {meta['device']}, {meta['date']}. The user's fairseq-train "
        f"arguments: `{meta['user_args']}`. Stall threshold (the unigram model's validation nll): "
        f"{meta['stall_bits']:.3f} bits/token.",
        "",
        f"Ranked best first: ok / stalled by the best validation loss at or before update {h} (the last "
        "validation every one of them reached), then diverged, then failed.",
        "",
        "| rank | method | status | best valid loss | best valid nll (bits) | at update | updates | updates/s | "
        "peak memory (MiB) | "
        + " | ".join(f"{s} gradient bottom / top layer at update 1 (ratio)" for s in stacks)
        + " |",
        "|---" * (9 + len(stacks)) + "|",
    ]
    for r in ranked:
        status = r["status"] if r["status"] == "ok" else f"**{r['status']}**"
        if not r["finished"]:
            status += " (unfinished)"
        grads = " | ".join(gradient_line(r["gnorm_init"], s) for s in stacks)
        lines.append(
            f"| {r['rank']} | {r['label']} (`{r['method']}`) | {status} | {_num(r['loss_at_horizon'])} | "
            f"{_num(r['best_valid_nll'])} | {_num(r['best_update'], '{}')} | {r['updates']} | "
            f"{_num(r['updates_per_s'], '{:.2f}')} | {_num(r['peak_rss_mib'], '{:.0f}')} | {grads} |"
        )
    lines += ["", "Why each candidate that is not `ok` has its status:", ""]
    lines += [f"- `{r['method']}` ({r['status']}): {r['reason']}" for r in ranked if r["reason"]] or ["- (none)"]
    lines += [
        "",
        "Gradient norms per layer after the first updates (update of the first validation), bottom / top (top/bottom):",
        "",
    ]
    for r in ranked:
        prof = r["gnorm_early"]
        at = prof.get("update", "-")
        lines.append(f"- `{r['method']}` at update {at}: " + "; ".join(f"{s} {gradient_line(prof, s)}" for s in stacks))
    lines += ["", "## What the statuses mean", ""]
    lines += [f"- **{k}**: {v}." for k, v in STATUS_MEANING.items()]
    lines += [
        "- *(unfinished)*: stopped by `--budget-min` before `--max-update`; the same `deepinit-compare` "
        "command continues it from its `checkpoint_last.pt`.",
        "",
        "## What this comparison predicts, and what it does not",
        "",
        "It measures early-training stability at your depth, width, batch, learning rate, warm-up and "
        "precision: which candidates diverge or stall, and which reaches the lowest validation loss after "
        "the same number of updates. A candidate that diverges or stalls here will usually need a different "
        "learning rate or warm-up at full length too. It does not predict the final quality (BLEU, "
        "perplexity at convergence): rankings after a few hundred updates can change later (a slow starter "
        "may end best), one seed is one sample, and a model that learns only a target-side language model "
        "first reaches a loss that hides it (the Multi30k matrix decodes to catch that: docs/results.md).",
        "",
        "## Commands",
        "",
        "Each candidate's comparison run, and the command that continues it at full length from its "
        "`checkpoint_last.pt` (the same options with your own `--max-update`, logging and validation "
        "intervals):",
        "",
    ]
    for r in ranked:
        lines += [f"`{r['method']}`:", "", "```bash", r["command"], "# continue at full length:"]
        lines += [r["continue_command"], "```", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)
