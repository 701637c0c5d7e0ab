#!/usr/bin/env python
"""Merge the files a GPU session brought back into ``docs/benchmarks/gpu.json`` .

Each file goes under a key of its kind, named by its file name: ``smoke.json`` (gpu_smoke.py) ->
``smoke``; ``gpu-<pass>.json`` (throughput.py --gpu-matrix --out-dir) -> ``matrix.gpu-<pass>``;
``prof*.json`` (gpu_profile.py) -> ``profile.<name>``. A newer file replaces the one stored under its
key; the others stay. Results measured on the CPU are refused (a CPU rehearsal is not a GPU result)
unless ``--allow-cpu``. Usage, here, after a device command::

    .venv/bin/python benchmarks/gpu_results.py <files_at>/smoke.json <files_at>/gpu-6l.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence, Tuple

from deepinit_tools import harness
from deepinit_tools.paths import REPO

DEFAULT_INTO = REPO / "docs" / "benchmarks" / "gpu.json"


def slot(path: Path) -> Tuple[str, str | None]:
    """(section, key) of a result file by its name; ValueError for a file this tool does not take."""
    stem = path.name.removesuffix(".json")
    if path.suffix != ".json":
        raise ValueError(f"{path}: not a JSON result")
    if stem == "smoke":
        return "smoke", None
    if stem.startswith("gpu-"):
        return "matrix", stem
    if stem.startswith("prof"):
        return "profile", stem
    raise ValueError(
        f"{path}: not smoke.json, gpu-<pass>.json or prof*.json (converged.json goes to "
        "`multi30k_matrix.py report --converged --packs`)"
    )


def on_cpu(doc: dict) -> bool:
    """Whether a result was measured on the CPU (its ``meta.device``, or gpu_profile's ``device``)."""
    meta = doc.get("meta") or {}
    return meta.get("device", doc.get("device")) == "cpu"


def merge(store: dict, files: Sequence[Path], allow_cpu: bool = False) -> dict:
    """``store`` with every file under its slot (ValueError naming the first file refused)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in store.items()}
    for path in files:
        section, key = slot(path)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: cannot read it as JSON ({e})") from None
        if on_cpu(doc) and not allow_cpu:
            raise ValueError(f"{path} was measured on the CPU; a GPU result is wanted here (--allow-cpu to keep it)")
        if key is None:
            out[section] = doc
        else:
            out.setdefault(section, {})[key] = doc
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.Parser(prog="gpu_results.py", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="the result files (default: none)")
    p.add_argument("--into", type=Path, default=DEFAULT_INTO, help="the file to merge into")
    p.add_argument("--allow-cpu", action="store_true", help="keep results measured on the CPU")
    a = p.parse_args(argv)
    try:
        store = json.loads(a.into.read_text()) if a.into.exists() else {}
        merged = merge(store, a.files, a.allow_cpu)
    except ValueError as e:
        harness.fail(str(e))
    a.into.parent.mkdir(parents=True, exist_ok=True)
    a.into.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"{a.into}: " + ", ".join(f"{k} ({len(v) if k != 'smoke' else 1})" for k, v in merged.items()))
    return 0
