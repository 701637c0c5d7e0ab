"""One converged cell of the Multi30k matrix (:mod:`deepinit_tools.matrix.run`): train it with
``fairseq-train`` until it converges or the deadline, decode it (dev probe, test BLEU), classify it and
write its ``result.json``; :func:`pack` gathers finished results into one file.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import time
from pathlib import Path
from typing import Sequence

from deepinit_tools import prepare_bible
from deepinit_tools.matrix import budget as est
from deepinit_tools.matrix import regimes as rg
from deepinit_tools.matrix.cells import last_line, merges_of, parse_log, unigram_bits
from deepinit_tools.matrix.commands import (
    PACK_FORMAT,
    Options,
    printable,
    train_command,
)
from deepinit_tools.matrix.common import BLEU_RE, TEST_SETS, log
from deepinit_tools.matrix.decode import DecodeDeadline, translate
from deepinit_tools.matrix.logs import classify, train_wps, valid_curve
from deepinit_tools.paths import REPO
from fairseq_deepinit.compare.process import cpu_name, run_logged


def device_name(device: str) -> str:
    """The GPU's name (torch.cuda.get_device_name) or the CPU model (/proc/cpuinfo)."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return cpu_name()


EMPTY_DECODED = {"probe": None, "test2016_bleu": None, "test2017_bleu": None, "bleu_signature": None}


def decode_best(o: Options, out: Path, found: dict, tests_first: bool = False) -> dict:
    """Greedy dev probe and beam test2016/test2017 sacreBLEU of the cell's best checkpoint, filled into
    ``found`` (the keys of :data:`EMPTY_DECODED`) as each translation finishes, the probe first unless
    ``tests_first``. At ``o.deadline`` :class:`DecodeDeadline` is raised; ``found`` keeps what finished."""
    bin_dir = o.data / "bin"

    def probe() -> None:
        gen = translate(bin_dir, out, "valid", "dev-greedy", 1, o.threads, device=o.device, deadline=o.deadline)
        hyps = prepare_bible.read_hypotheses(gen)
        dev = prepare_bible.score(gen, o.data / "raw" / "valid.en")
        found["probe"] = {"distinct": len(set(hyps)), "sentences": len(hyps), "bleu": _bleu(dev)}

    def test(subset: str, label: str) -> None:
        line = prepare_bible.score(
            translate(bin_dir, out, subset, label, o.beam, o.threads, device=o.device, deadline=o.deadline),
            o.data / "raw" / f"{subset}.en",
        )
        found[f"{label}_bleu"] = _bleu(line)
        found["bleu_signature"] = line.split("signature: ")[-1].rstrip(")") if "signature: " in line else None

    tests = [lambda s=s, label=label: test(s, label) for s, label in TEST_SETS.items()]
    for step in [*tests, probe] if tests_first else [probe, *tests]:
        step()
    return found


def _bleu(line: str) -> float:
    m = BLEU_RE.search(line)
    return float(m.group(1)) if m else float("nan")


def stall_bits_of(o: Options) -> float:
    if o.stall_bits is not None:
        return o.stall_bits
    return unigram_bits(o.data / "bin", o.data / f"bpe{merges_of(o.data)}" / "valid.en")


def run_cell(cell: rg.Cell, o: Options, device: str, stall_bits: float) -> dict | None:
    """Train, decode and record one cell; returns its result, or None when the deadline stopped it."""
    out = o.runs / cell.dirname
    result_path = out / "result.json"
    if result_path.exists():
        log(f"{cell.name}: finished before ({result_path}), skipped")
        return json.loads(result_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    cmd = train_command(cell, o)
    attempts_path = out / "attempts.json"
    attempts = json.loads(attempts_path.read_text()) if attempts_path.exists() else []
    done_path = out / "train.done"
    if not done_path.exists():
        if o.deadline is not None and time.time() > o.deadline:
            return None
        threads = str(o.threads)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
        resumed = (out / "checkpoint_last.pt").exists()
        log(f"train {cell.name}" + (" (resuming from checkpoint_last.pt)" if resumed else ""))
        done = run_logged(cmd, out / "train.log", env, o.deadline, cwd=REPO)
        rc = done.returncode
        attempts.append({"wall_s": done.wall_s, "resumed": resumed, "stopped_at_deadline": rc is None})
        attempts_path.write_text(json.dumps(attempts, indent=1))
        if rc is None:
            log(f"{cell.name}: stopped at the deadline; resumes from checkpoint_last.pt next time")
            return None
        done_path.write_text(json.dumps({"returncode": rc}))
    rc = json.loads(done_path.read_text())["returncode"]
    text = (out / "train.log").read_text(encoding="utf-8")
    decoded = dict(EMPTY_DECODED)
    if (out / "checkpoint_best.pt").exists():
        try:
            decode_best(o, out, decoded)
        except DecodeDeadline as e:
            log(f"{cell.name}: decoding ({e}) stopped at the deadline; decodes again next time")
            return None
    record = result_record(cell, o, device, stall_bits, text, rc, decoded, attempts, cmd)
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(result_path)
    for ckpt in out.glob("*.pt"):
        ckpt.unlink()
    log(
        f"{cell.name}: {record['status']} ({record['stop']}), {record['epochs']} epochs, dev nll {record['dev_nll']}, "
        f"BLEU {record['test2016_bleu']} / {record['test2017_bleu']}, {record['wall_s']:.0f}s"
    )
    return record


def result_record(
    cell: rg.Cell,
    o: Options,
    device: str,
    stall_bits: float,
    text: str,
    rc: int,
    decoded: dict,
    attempts: Sequence[dict],
    cmd: Sequence[str],
) -> dict:
    """The ``result.json`` record of a trained cell: its status (:func:`matrix.logs.classify`), dev
    curve, decoding results (``decoded``: probe, test BLEU, signature), settings and command."""
    curve = valid_curve(text)
    status, stop = classify(curve, text, rc, o.patience, stall_bits, decoded["probe"], o.blind_fraction)
    finite = [c for c in curve if math.isfinite(c[1])]
    best = min(finite, key=lambda c: c[1]) if finite else None
    regime = cell.spec
    batch = o.max_tokens or regime.max_tokens
    per_forward, freq = est.update_freq(batch, o.max_tokens_per_job)
    error = parse_log(text)["error"] or (None if rc == 0 else last_line(text))
    return {
        "cell": cell.name,
        "method": cell.method,
        "layers": cell.depth,
        "regime": cell.regime,
        "seed": cell.seed,
        "status": status,
        "stop": stop,
        "test2016_bleu": decoded["test2016_bleu"],
        "test2017_bleu": decoded["test2017_bleu"],
        "bleu_signature": decoded["bleu_signature"],
        "epochs": curve[-1][0] if curve else 0,
        "best_epoch": best[0] if best else None,
        "updates": curve[-1][3] if curve else 0,
        "wall_s": round(sum(a["wall_s"] for a in attempts), 1),
        "dev_loss": best[1] if best else None,
        "dev_nll": best[2] if best else None,
        "probe": decoded["probe"],
        "tokens_per_s": train_wps(text),
        "device": device,
        "device_type": o.device,
        "precision": o.precision,
        "jobs": o.jobs,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "regime_label": regime.label,
        "regime_source": regime.source,
        "settings": {
            "patience": o.patience,
            "max_epochs": o.max_epochs,
            "dim": o.dim,
            "ffn": o.ffn,
            "heads": o.heads,
            "max_tokens": batch,
            "tokens_per_forward": per_forward,
            "update_freq": freq,
            "stall_bits": round(stall_bits, 3),
            "beam": o.beam,
            "fast_path": o.fast_path and o.device == "cuda",
        },
        "valid": [list(c) for c in curve],
        "attempts": len(attempts),
        "error": error,
        "command": printable(cmd),
    }


def pack(runs: Path, cells: Sequence[rg.Cell], path: Path) -> int:
    """Write the finished results of ``cells`` under ``runs`` into one JSON file (atomically: a
    command killed while writing leaves the previous pack); returns how many."""
    found = []
    for c in cells:
        p = runs / c.dirname / "result.json"
        if p.exists():
            found.append(json.loads(p.read_text()))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"format": PACK_FORMAT, "cells": found}, indent=1))
    tmp.replace(path)
    return len(found)
