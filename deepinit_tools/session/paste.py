"""``gpu_session.py paste FOLDER``: a session's returned files into the docs.

From the folder the device returned (``files_at``):

1. every stage JSON but the cells' (``smoke.json``, ``gpu-*.json``, ``prof.json``) into
   ``docs/benchmarks/gpu.json`` (:func:`deepinit_tools.bench.gpu_results.merge`: one slot per kind, a
   newer file replacing its slot's), and ``session.json`` under ``sessions.<stages>``;
2. the cells' packs (``cells-*.json``) into ``docs/results/converged.json`` and the converged tables of
   ``docs/results.md`` (``multi30k_matrix.py report --converged --packs``);
3. the tables: the smoke test and the speed rows into ``docs/benchmarks.md`` between
   :data:`BENCH_BEGIN` and :data:`BENCH_END`, the cells' per-epoch curves and test BLEU into
   ``docs/results.md`` between :data:`CELLS_BEGIN` and :data:`CELLS_END`.

Results measured on the CPU (a rehearsal) are refused unless ``allow_cpu`` (the test pastes a
rehearsal's files into a copy of the docs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

from deepinit_tools import harness
from deepinit_tools.bench import gpu_results
from deepinit_tools.bench.gpu_matrix_report import markdown as matrix_markdown
from deepinit_tools.bench.gpu_smoke import summary as smoke_summary
from deepinit_tools.matrix import report as converged_report
from deepinit_tools.matrix.early_report import write_between_markers

BENCH_BEGIN, BENCH_END = "<!-- gpu session results: begin -->", "<!-- gpu session results: end -->"
CELLS_BEGIN, CELLS_END = "<!-- gpu session cells: begin -->", "<!-- gpu session cells: end -->"


class PasteError(RuntimeError):
    """A file that cannot be pasted; the message says which and why."""


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PasteError(f"{path}: cannot read it as JSON ({e})") from None


def session_line(doc: dict) -> str:
    """Device, date, command and every stage's status of a session."""
    meta = doc["meta"]
    stages = "; ".join(f"{r['name']} {r['status']}" + (f" ({r['seconds']:.0f} s)" if "seconds" in r else "")
                       for r in doc["stages"])  # fmt: skip
    when = f"{meta['date']} {meta.get('time_utc', '')} UTC"
    return (f"Session on {meta['device_name']}, {when}, torch {meta['torch']}, Python {meta['python']}: "
            f"`{meta['command']}` (budget {doc['budget_min']:g} min). Stages: {stages}.")  # fmt: skip


def bench_block(session: dict, results: Dict[str, dict]) -> str:
    """The smoke table and the speed tables of one session, for docs/benchmarks.md."""
    parts = [session_line(session), ""]
    smoke = results.get("smoke.json")
    if smoke:
        parts += [f"**CUDA smoke test**: {smoke['passed']} of {len(smoke['rows'])} passed"
                  + ("" if smoke.get("finished") else " (cut at its deadline: the rows it finished)") + ".", "",
                  smoke_summary(smoke["rows"]), ""]  # fmt: skip
    for name, doc in sorted(results.items()):
        if name.startswith("gpu-"):
            cut = "" if doc.get("finished") else " (cut at its deadline: the rounds it finished)"
            parts += [f"**Speed rows, `{name}`**{cut}:", "", matrix_markdown(doc), ""]
    if "prof.json" in results:
        parts += ["**Profile**: `docs/benchmarks/gpu.json` (`profile.prof`); operator tables in the session's "
                  "`extras.tar.gz` (`profile/prof.txt`).", ""]  # fmt: skip
    return "\n".join(parts)


def _f(x, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def cells_block(session: dict, packs: Dict[str, dict]) -> str:
    """Per pack: its label, and per cell its status, per-epoch dev loss / greedy dev BLEU and test BLEU."""
    parts = [session_line(session), ""]
    for name, pack in sorted(packs.items()):
        meta = pack["meta"]
        first = pack["cells"][0] if pack["cells"] else {"precision": "?", "settings": {}}
        how = first["precision"] + (" on the plugin's fast path" if first["settings"].get("fast_path") else "")
        parts += [f"**{name}**: {pack['label']}. {meta['layers']} layers, d {meta['dim']}, FFN {meta['ffn']}, "
                  f"{meta['heads']} heads, {how}, each cell in its paper's regime; dev loss in bits; dev BLEU "
                  f"{pack['dev_bleu']}; test BLEU: sacreBLEU, beam 5, the best checkpoint (by dev loss) when "
                  "training stopped.", ""]  # fmt: skip
        rows = []
        for c in pack["cells"]:
            curve = " ".join(f"{e['dev_loss']:.2f}/{_f(e['dev_bleu'], 1)}" for e in c.get("dev_curve", []))
            rows.append([c["method"], c["status"], c["label"], curve or "-", _f(c.get("best_dev_bleu"), 1),
                         _f(c["test2016_bleu"], 1), _f(c["test2017_bleu"], 1)])  # fmt: skip
        header = ["method", "status", "what it is", "dev loss / greedy dev BLEU per epoch", "best dev BLEU",
                  "test2016", "test2017"]  # fmt: skip
        parts += [harness.markdown_table(header, rows, right=(4, 5, 6)), ""]
        if pack.get("training") or pack.get("not_started"):
            left = [t["cell"] for t in pack.get("training", [])] + pack.get("not_started", [])
            parts += [f"Not finished when the command ended: {', '.join(left)}.", ""]
    return "\n".join(parts)


def paste(files_at: Path, docs: Path, allow_cpu: bool = False) -> List[str]:
    """Paste every file of ``files_at`` (see the module docstring); returns what was written."""
    session = _load(files_at / "session.json")
    if session["meta"]["device"] == "cpu" and not allow_cpu:
        raise PasteError(f"{files_at}/session.json ran on the CPU (a rehearsal); a GPU session is wanted here")
    stage_files = {r["result"] for r in session["stages"]}
    found = {p.name: p for p in sorted(files_at.glob("*.json")) if p.name in stage_files}
    packs = {n: _load(p) for n, p in found.items() if n.startswith("cells-")}
    results = {n: _load(p) for n, p in found.items() if not n.startswith("cells-")}
    written = []
    into = docs / "benchmarks" / "gpu.json"
    store = _load(into) if into.exists() else {}
    try:
        store = gpu_results.merge(store, [found[n] for n in results], allow_cpu)
    except ValueError as e:
        raise PasteError(str(e)) from None
    key = ",".join(r["name"] for r in session["stages"])
    store.setdefault("sessions", {})[key] = session
    into.parent.mkdir(parents=True, exist_ok=True)
    into.write_text(json.dumps(store, indent=1) + "\n")
    written.append(f"{into}: {', '.join(results) or 'no stage result'}, session {key}")
    if packs:
        cpu = [n for n, p in packs.items() if any(c.get("device_type") == "cpu" for c in p["cells"])]
        if cpu and not allow_cpu:
            raise PasteError(f"{', '.join(cpu)} trained on the CPU (a rehearsal); a GPU session is wanted here")
        argv = ["--packs", *(str(found[n]) for n in packs), "--docs-dir", str(docs), "--runs-dir", str(files_at / "-")]
        if converged_report.main(argv) != 0:
            raise PasteError("report --converged failed (its message is above)")
        written.append(f"{docs / 'results' / 'converged.json'} and {docs / 'results.md'}: {', '.join(packs)}")
        write_between_markers(docs / "results.md", cells_block(session, packs), CELLS_BEGIN, CELLS_END)
        written.append(f"{docs / 'results.md'}: the cells' per-epoch table")
    if results:
        write_between_markers(docs / "benchmarks.md", bench_block(session, results), BENCH_BEGIN, BENCH_END)
        written.append(f"{docs / 'benchmarks.md'}: {', '.join(results)}")
    return written
