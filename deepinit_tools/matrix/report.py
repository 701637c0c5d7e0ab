"""``multi30k_matrix.py report --converged``: accumulate converged cells and write their tables.

Sources, merged cell by cell (a newer ``date`` replaces an older result of the same cell):

1. ``docs/results/converged.json`` itself (what earlier GPU sessions brought back);
2. every ``--packs FILE`` (what ``converge --pack`` wrote on a device);
3. every ``RUNS_DIR/*/result.json`` (``--runs-dir``, cells run on this machine).

Writes ``docs/results/converged.json`` (a list of cells, each with method, layers, regime, device,
status, test2016_bleu, test2017_bleu, epochs, wall_s and the rest of its result file) and the
tables between ``BEGIN`` and ``END`` in ``docs/results.md``: the regime of every method, the chunk
plan with its estimated GPU minutes, the paper-regime and common-regime matrices, the 18-layer seeds,
every cell, and the per-paper verdicts computed by the rules in :data:`CLAIMS`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from deepinit_tools.matrix import budget as est
from deepinit_tools.matrix import regimes as rg
from deepinit_tools.matrix.commands import PACK_FORMAT
from deepinit_tools.matrix.common import METHODS, log
from deepinit_tools.matrix.verdicts import _get, verdict_table
from deepinit_tools.paths import REPO

BEGIN, END = "<!-- converged report: begin -->", "<!-- converged report: end -->"
REQUIRED = ("method", "layers", "regime", "device", "status", "test2016_bleu", "test2017_bleu", "epochs", "wall_s")
LABELS = {m: METHODS[m][0] for m in rg.METHODS}
DEPTHS = (6, 18, 36, 100)


class ReportError(RuntimeError):
    """An expected failure (unreadable pack, missing markers); the message says what to do."""


def read_pack(path: Path) -> List[dict]:
    """The cells of a ``converge --pack`` file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ReportError(f"cannot read pack {path} ({e}); give a file written by `converge --pack`") from None
    if not isinstance(data, dict) or data.get("format") != PACK_FORMAT:
        raise ReportError(f"{path} is not a `converge --pack` file (format {PACK_FORMAT!r})")
    return data["cells"]


def merge(store: Dict[str, dict], cells: Sequence[dict]) -> Dict[str, dict]:
    """Add ``cells`` to ``store`` (by cell name); a newer date replaces an older result, except that a
    cell cut at a GPU session's deadline (status ``cut``) never replaces one that ended by itself."""
    for c in cells:
        missing = [k for k in REQUIRED if k not in c]
        if missing:
            raise ReportError(f"result of {c.get('cell', '?')} lacks {', '.join(missing)}: not a converge result")
        old = store.get(c["cell"])
        # a run cut at a session's deadline never replaces one that ended by itself
        shorter = c["status"] == "cut" and old is not None and old["status"] != "cut"
        if old is None or (c["date"] >= old["date"] and not shorter):
            store[c["cell"]] = c
    return store


def collect(store_path: Path, packs: Sequence[Path], runs: Path | None) -> Dict[str, dict]:
    store: Dict[str, dict] = {}
    if store_path.exists():
        merge(store, json.loads(store_path.read_text()))
    for p in packs:
        merge(store, read_pack(p))
    if runs is not None and runs.exists():
        merge(store, [json.loads(p.read_text()) for p in sorted(runs.glob("*/result.json"))])
    return store


def _order(c: dict) -> Tuple:
    return (list(rg.METHODS).index(c["method"]), c["layers"], c["regime"], c["seed"])


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def fmt_cell(c: dict | None) -> str:
    """``status BLEU16/BLEU17 (epochs)`` for the matrices."""
    if c is None:
        return "not run"
    if c["status"] in ("diverged", "failed"):
        return f"**{c['status']}** (epoch {c['epochs']})"
    head = "ok" if c["status"] == "converged" else f"**{c['status']}**"
    return f"{head} {_f(c['test2016_bleu'])} / {_f(c['test2017_bleu'])} ({c['best_epoch']}/{c['epochs']} ep)"


def matrix_table(cells: Dict[str, dict], which: str) -> List[str]:
    """Rows: method (and regime variant), columns: depths; ``which`` = paper or common."""
    depths = sorted({c["layers"] for c in cells.values()}) or list(DEPTHS[:3])
    lines = [
        "| method | regime | " + " | ".join(f"{d} layers" for d in depths) + " |",
        "|---|---|" + "---|" * len(depths),
    ]
    for m in rg.METHODS:
        names = list(rg.PAPER_REGIMES[m]) if which == "paper" else ["common"]
        for r in names:
            row = [fmt_cell(_get(cells, m, d, r)) for d in depths]
            if any(x != "not run" for x in row):
                lines.append(f"| {LABELS[m]} | {r} | " + " | ".join(row) + " |")
    return lines


def seeds_table(cells: Dict[str, dict], depth: int = 18) -> List[str]:
    lines = [
        f"| method ({depth} layers, paper regime) | statuses | test2016 BLEU per seed | mean ± sd "
        "| test2017 mean ± sd |",
        "|---|---|---|---|---|",
    ]
    for m in rg.METHODS:
        runs = [c for c in (_get(cells, m, depth, "paper", s) for s in (1, 2, 3)) if c]
        if len(runs) < 2:
            continue
        b16 = [c["test2016_bleu"] for c in runs if c["test2016_bleu"] is not None]
        b17 = [c["test2017_bleu"] for c in runs if c["test2017_bleu"] is not None]

        def ms(xs: List[float]) -> str:
            return f"{statistics.mean(xs):.1f} ± {statistics.stdev(xs):.1f}" if len(xs) > 1 else "-"

        lines.append(
            f"| {LABELS[m]} | {', '.join(c['status'] for c in runs)} | {', '.join(_f(x) for x in b16)} "
            f"| {ms(b16)} | {ms(b17)} |"
        )
    return lines


def all_cells_table(cells: Dict[str, dict]) -> List[str]:
    lines = [
        "| cell | status (stop) | best / last epoch | wall s | dev loss | dev nll | test2016 | test2017 | tok/s "
        "| device | precision |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in sorted(cells.values(), key=_order):
        lines.append(
            f"| `{c['cell']}` | {c['status']} ({c['stop']}) | {c['best_epoch']} / {c['epochs']} | {c['wall_s']:.0f} "
            f"| {_f(c['dev_loss'], 2)} | {_f(c['dev_nll'], 2)} | {_f(c['test2016_bleu'])} | {_f(c['test2017_bleu'])} "
            f"| {c['tokens_per_s'] or '-'} | {c['device']} | {c['precision']} |"
        )
    return lines


def regimes_table() -> List[str]:
    lines = ["| method | regime | settings on Multi30k | from |", "|---|---|---|---|"]
    for m in rg.METHODS:
        for r, spec in rg.regimes_of(m).items():
            if rg.canonical_regime(m, r) != r:
                lines.append(f"| {LABELS[m]} | common | = its paper regime | |")
                continue
            lines.append(f"| {LABELS[m]} | {r} | {spec.summary()} | {spec.source} |")
    return lines


def chunks_table(dim: int, jobs: int, epochs: Dict[int, float]) -> List[str]:
    lines = ["| chunk | cells | estimated H100 minutes | what |", "|---|---|---|---|"]
    total = 0.0
    for name, ch in rg.CHUNKS.items():
        minutes = est.estimate_chunk(ch.cells, dim, jobs, epochs)
        total += minutes if name != "smoke" else 0
        lines.append(f"| `{name}` | {len(ch.cells)} | {minutes:.0f} | {ch.description} |")
    lines.append(
        f"| all but smoke | {sum(len(c.cells) for n, c in rg.CHUNKS.items() if n != 'smoke')} | {total:.0f} | |"
    )
    return lines


def measured_epochs(cells: Dict[str, dict]) -> Dict[int, float]:
    """Mean epochs of the finished cells per depth (the estimate's epochs once measured)."""
    by: Dict[int, List[int]] = {}
    for c in cells.values():
        if c.get("device_type") != "cuda":
            continue
        by.setdefault(c["layers"], []).append(c["epochs"])
    return {d: statistics.mean(v) for d, v in by.items()}


def render(cells: Dict[str, dict], dim: int, jobs: int) -> str:
    """The generated block of docs/results.md."""
    sig = next((c["bleu_signature"] for c in cells.values() if c.get("bleu_signature")), None)
    devices = sorted({c["device"] for c in cells.values()})
    parts = [
        "Regimes (deepinit_tools/matrix/regimes.py; warm-up converted from the paper's epochs, batch 8,192 tokens):",
        "",
        *regimes_table(),
        "",
        f"Chunks and their estimated H100 minutes (--jobs {jobs}, d={dim}; epochs per cell: "
        + (
            ", ".join(f"{d}L {e:.0f}" for d, e in sorted(measured_epochs(cells).items())) + " measured, else "
            if measured_epochs(cells)
            else ""
        )
        + f"{est.EPOCHS_EXPECTED} assumed):",
        "",
        *chunks_table(dim, jobs, measured_epochs(cells)),
        "",
    ]
    if not cells:
        return (
            "\n".join(parts + ["No converged cell yet: run a chunk (commands above), then `report --converged`."])
            + "\n"
        )
    parts += [
        f"{len(cells)} cells, devices: {', '.join(devices)}. Cell: status, test2016 / test2017 sacreBLEU of the best "
        "checkpoint (beam 5), (best epoch / epochs trained). *ok* = converged (dev loss stopped improving for "
        "`patience` epochs); *capped* = still improving at the epoch cap; *cut* = stopped at a GPU session's "
        "deadline (its `label`: N epochs in M minutes, packed K at a time).",
        "",
        "Each method in its paper's regime:",
        "",
        *matrix_table(cells, "paper"),
        "",
        "All methods in the common regime:",
        "",
        *matrix_table(cells, "common"),
    ]
    seeds = seeds_table(cells)
    if len(seeds) > 2:
        parts += ["", "Seeds:", "", *seeds]
    parts += [
        "",
        "Per-paper verdicts from these cells (rules stated; `not run yet` until every cell a rule needs exists):",
        "",
        *verdict_table(cells),
        "",
        "Every cell:",
        "",
        *all_cells_table(cells),
    ]
    if sig:
        parts += ["", f"sacreBLEU signature: `{sig}`"]
    return "\n".join(parts) + "\n"


def write_between(path: Path, text: str) -> None:
    """Replace the block between BEGIN and END of ``path`` (appended at the end if the file has none)."""
    doc = path.read_text(encoding="utf-8") if path.exists() else ""
    if BEGIN not in doc and END not in doc:
        doc = doc + ("\n" if doc and not doc.endswith("\n") else "") + f"{BEGIN}\n{END}\n"
    if doc.count(BEGIN) != 1 or doc.count(END) != 1 or doc.index(BEGIN) > doc.index(END):
        raise ReportError(f"{path} needs exactly one {BEGIN} ... {END} block")
    head, rest = doc.split(BEGIN)
    path.write_text(f"{head}{BEGIN}\n{text}{END}{rest.split(END)[1]}", encoding="utf-8")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="multi30k_matrix.py report --converged",
        description="Merge converged cells (result files, packs, the existing docs/results/converged.json) and "
        "write docs/results/converged.json and the tables of docs/results.md.",
    )
    p.add_argument("--packs", type=Path, nargs="*", default=[], help="`converge --pack` files to merge (default: none)")
    p.add_argument(
        "--runs-dir",
        type=Path,
        default=REPO / "work-data" / "multi30k-matrix" / "converged",
        help="folder of cell folders with result.json, merged when it exists (default: %(default)s)",
    )
    p.add_argument(
        "--docs-dir",
        type=Path,
        default=REPO / "docs",
        help="writes DOCS_DIR/results/converged.json and the block of DOCS_DIR/results.md (default: %(default)s)",
    )
    p.add_argument("--dim", type=int, default=256, help="width the chunk estimate assumes (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=4, help="--jobs the chunk estimate assumes (default: %(default)s)")
    p.add_argument("--print", action="store_true", help="print the tables instead of writing the files")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        store_path = a.docs_dir / "results" / "converged.json"
        cells = collect(store_path, a.packs, a.runs_dir)
        text = render(cells, a.dim, a.jobs)
        if a.print:
            print(text, end="")
            return 0
        store_path.parent.mkdir(parents=True, exist_ok=True)
        store_path.write_text(json.dumps(sorted(cells.values(), key=_order), indent=1) + "\n")
        write_between(a.docs_dir / "results.md", text)
        log(f"{len(cells)} cells -> {store_path} and {a.docs_dir / 'results.md'}")
        return 0
    except (ReportError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
