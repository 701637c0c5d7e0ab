"""``multi30k_matrix.py report``: the Markdown tables of the early-training study in docs/results.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, List

from deepinit_tools.matrix.cells import Rules, analyse, target_of
from deepinit_tools.matrix.common import BLEU_RE, METHODS, REGIMES, MatrixError, cell_name


def load_results(work: Path, rules: Rules) -> Dict[str, dict]:
    """Every finished cell under ``work/runs``, analysed, with its BLEU scores when translated."""
    results = {}
    records = sorted((work / "runs").glob("*/result.json"))
    if records:
        rules = rules.for_work(work)
    for p in records:
        r = analyse(p.parent, rules)
        bleu = p.parent / "bleu.json"
        if bleu.exists():
            r["bleu"] = json.loads(bleu.read_text())
        results[r["cell"]] = r
    return results


def select_for_bleu(results: Dict[str, dict]) -> List[str]:
    """Per method: the better regime at the shallowest and at the deepest depth where it was converging."""
    chosen = []
    for m in METHODS:
        ok = [r for r in results.values() if r["method"] == m and r["status"] == "converging"]
        for depth in sorted({min((r["depth"] for r in ok), default=0), max((r["depth"] for r in ok), default=0)}):
            at = [r for r in ok if r["depth"] == depth]
            if at:
                chosen.append(min(at, key=lambda r: r["best_dev_nll"])["cell"])
    return chosen


def fmt_cell(r: dict | None) -> str:
    if r is None:
        return "not run"
    nll = f"{r['best_dev_nll']:.2f}" if r["best_dev_nll"] is not None else "-"
    if r["status"] == "diverged":
        return f"**diverged** at {r['updates_done']}" + (f" (best {nll})" if r["best_dev_nll"] is not None else "")
    if r["status"] in ("stalled", "failed", "source-blind"):
        return f"**{r['status']}** {nll}"
    reach = f" @{r['updates_to_target']}" if r["updates_to_target"] is not None else " @-"
    return f"ok {nll}{reach}"


def _grid(results: Dict[str, dict], depths: List[int], fmt: Callable, empty: str) -> List[str]:
    """Markdown table, a row per method and a column per (depth, regime); rows with nothing run are left out."""
    lines = [
        "| method | " + " | ".join(f"{d}L warmup | {d}L no warmup" for d in depths) + " |",
        "|---|" + "---|" * (2 * len(depths)),
    ]
    for m, (label, _) in METHODS.items():
        row = [fmt(results.get(cell_name(m, d, r))) for d in depths for r in REGIMES]
        if any(x != empty for x in row):
            lines.append(f"| {label} | " + " | ".join(row) + " |")
    return lines


def _fmt_probe(r: dict | None) -> str:
    if r is None or not r.get("probe"):
        return "-"
    return f"{r['probe']['bleu']:.1f} ({r['probe']['distinct']})"


def _layer_summary(g: Dict[str, float]) -> str:
    """Gradient norms of the embeddings and of the bottom and top layer of each stack."""
    if not g:
        return "no per-layer gradient norms logged"
    parts = []
    for stack in ("encoder", "decoder"):
        layers = sorted(int(k.split(".")[2]) for k in g if k.startswith(f"{stack}.layers."))
        if layers:
            lo, hi = g[f"{stack}.layers.{layers[0]}"], g[f"{stack}.layers.{layers[-1]}"]
            parts.append(
                f"{stack} layer 1 {lo:.3g}, layer {layers[-1] + 1} {hi:.3g} (top/bottom {hi / max(lo, 1e-30):.3g})"
            )
    return f"update {g['update']}: " + "; ".join(parts)


def report(work: Path, rules: Rules) -> str:
    """The Markdown tables of ``docs/results.md``: stability matrix, BLEU, failing cells."""
    results = load_results(work, rules)
    if not results:
        raise MatrixError(f"no results under {work / 'runs'}: run `matrix` first")
    depths = sorted({r["depth"] for r in results.values()})
    any_r = next(iter(results.values()))
    targets = ", ".join(f"{d}L {target_of(rules.target_spec, d)}" for d in depths)
    lines = [
        f"Cell: status, best dev nll (bits/token), `@U` = first validation with dev nll <= the depth's target "
        f"({targets}); `@-`: not reached. Stalled: never below the unigram model's {any_r['stall_bits']:.2f} bits, "
        f"or less than {rules.plateau_bits} bits gained in the second half of the run.",
        "",
        *_grid(results, depths, fmt_cell, "not run"),
    ]
    n_dev = next((r["probe"]["sentences"] for r in results.values() if r.get("probe")), None)
    if n_dev:
        lines += [
            "",
            "Dev BLEU of each cell's best checkpoint (greedy, sacreBLEU) and, in brackets, the number of distinct "
            f"translations of the {n_dev} dev sentences:",
            "",
            *_grid(results, depths, _fmt_probe, "-"),
        ]
    bleu_rows = [r for r in results.values() if "bleu" in r]
    if bleu_rows:
        lines += [
            "",
            "| method | layers | regime | status | best update | test2016 BLEU | test2017 BLEU | best dev nll |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(bleu_rows, key=lambda r: (list(METHODS).index(r["method"]), r["depth"], r["regime"])):
            b = {k: BLEU_RE.search(v).group(1) for k, v in r["bleu"].items()}
            lines.append(
                f"| {METHODS[r['method']][0]} | {r['depth']} | {r['regime']} | {r['status']} | {r['best_update']} "
                f"| {b['test2016']} | {b['test2017']} | {r['best_dev_nll']:.2f} |"
            )
        sig = next(iter(bleu_rows[0]["bleu"].values())).split("signature: ")[-1].rstrip(")")
        lines += ["", f"sacreBLEU signature: `{sig}`"]
    failing = [r for r in results.values() if r["status"] != "converging"]
    if failing:
        lines += ["", "Cells that were not converging, and why:", ""]
        for r in sorted(failing, key=lambda r: (r["depth"], list(METHODS).index(r["method"]), r["regime"])):
            step = max(1, -(-len(r["valid"]) // 8))  # at most about 8 points, the last one always shown
            points = r["valid"][::step] + ([r["valid"][-1]] if (len(r["valid"]) - 1) % step else [])
            curve = ", ".join(f"{u}: {nll:.2f}" for u, _, nll in points) or "no validation"
            why = f"{r['error']}; " if r["error"] else ""
            lines.append(
                f"- `{r['cell']}` ({r['status']}): {why}dev nll by update {curve}; gradient norms at the last "
                f"logged update, {_layer_summary(r['gnorm_layers'])}"
            )
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- multi30k_matrix report: begin -->", "<!-- multi30k_matrix report: end -->"


def write_between_markers(path: Path, text: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace the generated block of ``path`` (between ``begin`` and ``end``), keeping the prose around it."""
    doc = path.read_text(encoding="utf-8") if path.exists() else f"{begin}\n{end}\n"
    if doc.count(begin) != 1 or doc.count(end) != 1 or doc.index(begin) > doc.index(end):
        raise MatrixError(f"{path} needs exactly one {begin} ... {end} block to write the report into")
    head, rest = doc.split(begin)
    tail = rest.split(end)[1]
    path.write_text(f"{head}{begin}\n{text}{end}{tail}", encoding="utf-8")
