"""``multi30k_matrix.py converge``: train cells to convergence on CPU or CUDA, resumably.

A cell trains with ``fairseq-train`` until its dev loss has not improved for ``--patience``
consecutive epochs (fairseq's ``--patience``, validation once per epoch) or until ``--max-epochs``.
Then its best checkpoint translates the dev set greedily (the source-blindness probe of the CPU
matrix) and test2016 / test2017 with beam 5 (sacreBLEU), and everything is written into the cell's
``result.json``; its checkpoints are deleted. Status, from the dev curve, the log and the probe:

- ``diverged``: non-finite loss or gradient (the diagnostics criterion's guard, or fairseq's
  minimum loss scale), or a non-finite dev loss;
- ``failed``: fairseq-train exited non-zero for another reason;
- ``stalled``: the best dev nll never got below the unigram model's (``--stall-bits``);
- ``source-blind``: fewer than 5 % distinct greedy dev translations;
- ``converged``: the dev loss stopped improving for ``patience`` epochs (or TwT's plateau schedule
  reached ``--stop-min-lr``);
- ``capped``: the epoch cap came first while the dev loss was still improving (not converged).

Resuming: a cell whose ``result.json`` exists is skipped; a cell killed while training restarts
from its ``checkpoint_last.pt`` (fairseq's own resume); one killed after training (``train.done``)
only decodes again. ``--deadline-min`` (or ``--deadline-at``) stops training and decoding processes
before a device command's time limit, leaving them resumable, and ``--pack FILE`` writes every
finished result of the selected cells into one JSON file, rewritten after every cell (what a GPU
session brings back, also from a command cut by its limit).

On CUDA the cells train in bf16 autocast (``--autocast-bf16``: fp32's exponent range, so no loss
scaling, and a divergence is the method's, not fp16's: fairseq's ``--fp16`` stops at its minimum loss
scale, which the status rules would count as diverged) on the plugin's fast path
(:func:`matrix.commands.fast_path_flags`; ``--no-fast-path`` for fairseq's attention and Adam).
``--jobs K`` trains K cells at once; ``--measure-jobs`` measures what K pays off and ``--plan`` turns
the measured rates into the expected wall time of the selected cells (:mod:`matrix.plan`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from deepinit_tools import multi30k, prepare_bible
from deepinit_tools.matrix import plan as plan_mod
from deepinit_tools.matrix import regimes as rg
from deepinit_tools.matrix.cells import last_line, merges_of, parse_log, unigram_bits
from deepinit_tools.matrix.commands import (
    PACK_FORMAT,
    ConvergeError,
    Options,
    precision_flags,
    printable,
    train_command,
)
from deepinit_tools.matrix.common import BLEU_RE, TEST_SETS, MatrixError, log
from deepinit_tools.matrix.decode import DecodeDeadline, translate
from deepinit_tools.matrix.logs import classify, train_wps, valid_curve
from deepinit_tools.multi30k import prepare_bpe as prepare
from deepinit_tools.paths import REPO

# ---------------------------------------------------------------------------------------------
# one cell


def device_name(device: str) -> str:
    """The GPU's name (torch.cuda.get_device_name) or the CPU model (/proc/cpuinfo)."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


_procs: Dict[int, subprocess.Popen] = {}
_lock = threading.Lock()


def _run_until(cmd: List[str], log_path: Path, env: dict, deadline: float | None) -> int | None:
    """Run ``cmd`` appending to ``log_path``; None when stopped at ``deadline`` (SIGTERM, then SIGKILL)."""
    with open(log_path, "a", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        with _lock:
            _procs[proc.pid] = proc
        try:
            while True:
                try:
                    return proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    if deadline is not None and time.time() > deadline:
                        proc.send_signal(signal.SIGTERM)
                        try:
                            proc.wait(timeout=20)
                        except subprocess.TimeoutExpired:
                            proc.kill()
                            proc.wait()
                        return None
        finally:
            with _lock:
                _procs.pop(proc.pid, None)


def _decode(o: Options, out: Path) -> dict:
    """Greedy dev probe and beam test2016/test2017 sacreBLEU of the cell's best checkpoint
    (:class:`DecodeDeadline` at ``o.deadline``; the translations finished before it are kept)."""
    bin_dir = o.data / "bin"
    gen = translate(bin_dir, out, "valid", "dev-greedy", 1, o.threads, device=o.device, deadline=o.deadline)
    hyps = prepare_bible.read_hypotheses(gen)
    dev = prepare_bible.score(gen, o.data / "raw" / "valid.en")
    found: dict = {"probe": {"distinct": len(set(hyps)), "sentences": len(hyps), "bleu": _bleu(dev)}}
    for subset, label in TEST_SETS.items():
        line = prepare_bible.score(
            translate(bin_dir, out, subset, label, o.beam, o.threads, device=o.device, deadline=o.deadline),
            o.data / "raw" / f"{subset}.en",
        )
        found[f"{label}_bleu"] = _bleu(line)
        found["bleu_signature"] = line.split("signature: ")[-1].rstrip(")") if "signature: " in line else None
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
        start = time.time()
        rc = _run_until(cmd, out / "train.log", env, o.deadline)
        attempts.append(
            {"wall_s": round(time.time() - start, 1), "resumed": resumed, "stopped_at_deadline": rc is None}
        )
        attempts_path.write_text(json.dumps(attempts, indent=1))
        if rc is None:
            log(f"{cell.name}: stopped at the deadline; resumes from checkpoint_last.pt next time")
            return None
        done_path.write_text(json.dumps({"returncode": rc}))
    rc = json.loads(done_path.read_text())["returncode"]
    text = (out / "train.log").read_text(encoding="utf-8")
    curve = valid_curve(text)
    decoded: dict = {"probe": None, "test2016_bleu": None, "test2017_bleu": None, "bleu_signature": None}
    if (out / "checkpoint_best.pt").exists():
        try:
            decoded = _decode(o, out)
        except DecodeDeadline as e:
            log(f"{cell.name}: decoding ({e}) stopped at the deadline; decodes again next time")
            return None
    status, stop = classify(curve, text, rc, o.patience, stall_bits, decoded["probe"], o.blind_fraction)
    finite = [c for c in curve if math.isfinite(c[1])]
    best = min(finite, key=lambda c: c[1]) if finite else None
    regime = cell.spec
    batch = o.max_tokens or regime.max_tokens
    per_forward, freq = rg.update_freq(batch, o.max_tokens_per_job)
    error = parse_log(text)["error"] or (None if rc == 0 else last_line(text))
    record = {
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
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(result_path)
    for ckpt in out.glob("*.pt"):
        ckpt.unlink()
    log(
        f"{cell.name}: {status} ({stop}), {record['epochs']} epochs, dev nll {record['dev_nll']}, "
        f"BLEU {record['test2016_bleu']} / {record['test2017_bleu']}, {record['wall_s']:.0f}s"
    )
    return record


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


# ---------------------------------------------------------------------------------------------
# command line


def select_cells(a: argparse.Namespace) -> Tuple[List[rg.Cell], rg.Chunk | None]:
    """The cells of ``--chunk`` or of ``--cells`` or of ``--methods x --depths x --regime x --seeds``."""
    if a.chunk:
        chunks = {**rg.CHUNKS, **rg.SESSIONS}
        if a.chunk not in chunks:
            raise ConvergeError(f"unknown --chunk {a.chunk!r}; choose from {', '.join(chunks)} (--list-chunks)")
        return list(chunks[a.chunk].cells), chunks[a.chunk]
    try:
        if a.cells:
            return [rg.Cell.parse(c) for c in a.cells.split(",") if c], None
        methods = a.methods.split(",")
        for m in methods:
            if m not in rg.PAPER_REGIMES:
                raise ValueError(f"unknown method {m!r} in --methods; choose from {', '.join(rg.METHODS)}")
        depths = _ints(a.depths, "--depths")
        seeds = _ints(a.seeds, "--seeds")
        return [c for d in depths for c in rg.cells_of(d, a.regime, methods, seeds)], None
    except ValueError as e:
        raise ConvergeError(str(e)) from None


def finished_cells(path: Path, device: str) -> set:
    """Names of the cells ``path`` holds a result of (docs/results/converged.json: a list of results; or
    a ``--pack`` file) trained on ``device``."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConvergeError(f"--skip-done {path}: cannot read it as JSON ({e})") from None
    cells = doc.get("cells") if isinstance(doc, dict) and doc.get("format") == PACK_FORMAT else doc
    if not isinstance(cells, list):
        raise ConvergeError(f"--skip-done {path}: neither docs/results/converged.json nor a --pack file")
    return {c["cell"] for c in cells if isinstance(c, dict) and c.get("device_type") == device and "cell" in c}


def _ints(text: str, flag: str) -> List[int]:
    if not all(x.strip().isdigit() for x in text.split(",")):
        raise ValueError(f"{flag} {text!r} is not a comma-separated list of integers (e.g. 6,18)")
    return [int(x) for x in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="multi30k_matrix.py converge",
        description="Train cells of the Multi30k matrix to convergence (patience or epoch cap), on CPU or CUDA, "
        "resumably; each cell ends as one small result.json (see docs/results.md, 'Converged reproduction').",
    )
    add = p.add_argument
    add(
        "--chunk",
        default=None,
        help="train this chunk of the matrix (--list-chunks shows them; default: none, "
        "use --cells or --methods/--depths/--regime/--seeds)",
    )
    add("--list-chunks", action="store_true", help="print the chunks, their cells and estimated GPU minutes, then exit")
    add("--cells", default="", help="comma-separated METHOD:DEPTH:REGIME[:sSEED] (default: none)")
    add("--methods", default=",".join(rg.METHODS), help="methods (default: %(default)s)")
    add("--depths", default="6,18,36", help="layers per stack (default: %(default)s)")
    add(
        "--regime",
        default="both",
        choices=("paper", "common", "both"),
        help="each method's paper regime(s), the common regime, or both (default: %(default)s)",
    )
    add("--seeds", default="1", help="seeds, comma-separated (default: %(default)s)")
    add(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where fairseq trains and decodes (default: %(default)s)",
    )
    add(
        "--precision",
        default=None,
        choices=("fp16", "bf16", "fp32"),
        help="fp16: fairseq --fp16; bf16: --task translation_deepinit --autocast-bf16 (fp32 weights); fp32\n"
        "(default: bf16 on cuda, fp32 on cpu)",
    )
    add(
        "--jobs",
        default="1",
        help="cells trained at the same time, sharing the device, or 'auto': the count of the highest measured\n"
        "aggregate tokens/s in --rates (default: %(default)s)",
    )
    add("--max-epochs", type=int, default=50, help="epoch cap of every cell (default: %(default)s)")
    add(
        "--patience",
        type=int,
        default=3,
        help="stop when the dev loss has not improved for this many epochs (default: %(default)s)",
    )
    add("--dim", type=int, default=256, help="embedding dimension (default: %(default)s)")
    add("--ffn", type=int, default=1024, help="FFN inner dimension (default: %(default)s)")
    add("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    add(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens per update instead of the regime's (default: the regime's, 8192)",
    )
    add(
        "--max-tokens-per-job",
        type=int,
        default=None,
        help="memory limit: tokens per forward of one job; a larger batch is split with --update-freq\n"
        "(default: the chunk's, else no limit)",
    )
    add(
        "--work-dir",
        type=Path,
        default=REPO / "work-data" / "multi30k-matrix",
        help="prepared data (bin/, raw/, bpe*/), made by `prepare` when missing (default: %(default)s)",
    )
    add(
        "--runs-dir",
        type=Path,
        default=None,
        help="one folder per cell (log, checkpoints until it finishes, result.json) (default: WORK_DIR/converged)",
    )
    add("--multi30k-dir", type=str, default=None, help="Multi30k raw files for `prepare` (default: as `prepare`)")
    add("--bpe-merges", type=int, default=8000, help="joint BPE merges when preparing (default: %(default)s)")
    add("--threads", type=int, default=1, help="OpenMP threads per job (default: %(default)s)")
    add("--beam", type=int, default=5, help="beam size for test2016/test2017 (default: %(default)s)")
    add(
        "--stall-bits",
        type=float,
        default=None,
        help="stalled = best dev nll never below this (default: the unigram model's)",
    )
    add(
        "--deadline-min",
        type=float,
        default=None,
        help="stop training this many minutes after the start, cells left resumable (default: none)",
    )
    add(
        "--pack",
        type=Path,
        default=None,
        help="write the selected cells' finished results into this one JSON file (default: none)",
    )
    add(
        "--deadline-at",
        type=float,
        default=None,
        help="as --deadline-min, at this Unix time (date +%%s): several steps in one device command (default: none)",
    )
    add(
        "--no-fast-path",
        action="store_true",
        help="on CUDA, train with fairseq's attention and per-tensor Adam instead of the plugin's fast path\n"
        "(--attention-impl sdpa, --optimizer adam_foreach where the regime uses Adam) (default: fast path)",
    )
    add(
        "--rates",
        type=Path,
        default=None,
        help="measured tokens/s: the file --measure-jobs writes, or a --pack file; read by --plan and --jobs auto\n"
        "(default: none; --plan then uses the built-in H100 estimate, labelled as such)",
    )
    add(
        "--measure-jobs",
        default=None,
        help="measure the aggregate tokens/s of K identical training processes for each K of this comma-separated\n"
        "list (e.g. 1,8,12,16) into --rates, then exit (default: none)",
    )
    add(
        "--measure-cells",
        default=plan_mod.DEFAULT_PROBE,
        help="--measure-jobs: the probe cell(s), comma-separated (default: %(default)s)",
    )
    add("--measure-updates", type=int, default=200, help="--measure-jobs: updates per process (default: %(default)s)")
    add(
        "--plan",
        action="store_true",
        help="print the expected wall time of the selected cells for every --jobs of the rates, then exit",
    )
    add("--plan-jobs", default=None, help="--plan: the job counts to plan for (default: those of --rates)")
    add("--budget-min", type=float, default=None, help="--plan: list the cells finished within this many minutes")
    add(
        "--command-min",
        type=float,
        default=8.5,
        help="--plan: usable minutes of one device command (its --deadline-min) (default: %(default)s)",
    )
    add(
        "--skip-done",
        type=Path,
        action="append",
        default=[],
        help="leave out the cells this file (docs/results/converged.json or a --pack file) holds a result of,\n"
        "trained on the same --device; may be repeated (default: none)",
    )
    add("--extra-args", default="", help="appended to every fairseq-train command (default: none)")
    add("--dry-run", action="store_true", help="print the commands and the estimated GPU minutes, train nothing")
    return p


ESTIMATE_NOTE = (
    "estimate from stock fairseq fp16 on an H100 scaled by CPU-measured depth/width costs, sharing speed-up "
    "assumed; `--plan --rates FILE` plans from measured rates"
)


def list_chunks(dim: int, jobs: int) -> str:
    lines = [f"estimated H100 minutes with --jobs {jobs}, d={dim}, {rg.EPOCHS_EXPECTED} epochs per cell"]
    lines.append(f"({ESTIMATE_NOTE}):")
    for name, ch in {**rg.CHUNKS, **rg.SESSIONS}.items():
        lines.append(
            f"  {name:<14} {len(ch.cells):>3} cells {rg.estimate_chunk(ch.cells, dim, jobs):6.1f} min  {ch.description}"
        )
    return "\n".join(lines)


def _jobs_list(text: str, flag: str) -> List[int]:
    values = _ints(text, flag)
    if min(values) < 1:
        raise ValueError(f"{flag} {text!r}: every count must be at least 1")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        auto = a.jobs == "auto"
        if not auto and not a.jobs.isdigit():
            raise ConvergeError(f"--jobs {a.jobs!r}: give a number of cells at a time, or 'auto' with --rates")
        jobs = 1 if auto else int(a.jobs)
        if jobs < 1 or a.patience < 1 or a.max_epochs < 1:
            raise ConvergeError("--jobs, --patience and --max-epochs must be at least 1")
        if a.list_chunks:
            print(list_chunks(a.dim, jobs))
            return 0
        try:
            measure = _jobs_list(a.measure_jobs, "--measure-jobs") if a.measure_jobs else None
            plan_jobs = _jobs_list(a.plan_jobs, "--plan-jobs") if a.plan_jobs else None
            probes = [rg.Cell.parse(c) for c in a.measure_cells.split(",") if c]
        except ValueError as e:
            raise ConvergeError(str(e)) from None
        if measure and not a.rates:
            raise ConvergeError("--measure-jobs writes its measurements into --rates FILE; add --rates")
        if measure and a.measure_updates < 10:
            raise ConvergeError("--measure-updates: give at least 10 updates (the first fifth is start-up)")
        cells, chunk = select_cells(a)
        done = set().union(*(finished_cells(path, a.device) for path in a.skip_done))
        if done:
            log(f"--skip-done: {sum(c.name in done for c in cells)} of the selected cells have a result already")
            cells = [c for c in cells if c.name not in done]
        if a.plan:
            rates = plan_mod.load_rates(a.rates) if a.rates else plan_mod.fallback_rates(a.dim)
            text, _ = plan_mod.plan(cells, rates, a.dim, plan_jobs or rates.jobs(), a.budget_min, a.command_min)
            print(text)
            return 0
        if auto and (not a.rates or not a.rates.exists()):
            raise ConvergeError("--jobs auto picks the measured best from --rates FILE; run --measure-jobs first")
        rates = plan_mod.load_rates(a.rates) if a.rates and not measure else None
        if auto:
            jobs = plan_mod.best_jobs(rates)
            log(f"--jobs auto: {jobs} (the highest measured aggregate tokens/s in {a.rates})")
        precision = a.precision or ("bf16" if a.device == "cuda" else "fp32")
        runs = a.runs_dir or a.work_dir / "converged"
        limit = a.max_tokens_per_job or (chunk.max_tokens_per_job if chunk else None)
        deadline = time.time() + 60 * a.deadline_min if a.deadline_min else None
        if a.deadline_at is not None:
            deadline = a.deadline_at if deadline is None else min(deadline, a.deadline_at)
        o = Options(
            a.work_dir,
            runs,
            a.device,
            precision,
            jobs,
            a.dim,
            a.ffn,
            a.heads,
            a.patience,
            a.max_epochs,
            a.max_tokens,
            limit,
            a.threads,
            a.beam,
            a.stall_bits,
            extra_args=a.extra_args,
            deadline=deadline,
            fast_path=not a.no_fast_path,
        )
        for c in [*cells, *probes]:
            precision_flags(c.method, o.device, o.precision)  # refuse bad combinations before anything runs
        if a.dry_run:
            for c in cells:
                print(f"# {c.name}: {c.spec.label}")
                print(printable(train_command(c, o)))
            print(
                f"# {len(cells)} cells, estimated {rg.estimate_chunk(cells, a.dim, jobs):.1f} H100 minutes with "
                f"--jobs {jobs} ({rg.EPOCHS_EXPECTED} epochs per cell; {ESTIMATE_NOTE})"
            )
            return 0
        if a.device == "cuda":
            try:
                import torch
            except ImportError:
                raise ConvergeError("--device cuda needs torch in this Python") from None
            if not torch.cuda.is_available():
                raise ConvergeError("--device cuda: no CUDA device is visible; use --device cpu")
        prepare(a.work_dir, a.bpe_merges, a.multi30k_dir)
        dev = device_name(a.device)
        if measure:
            plan_mod.measure_jobs(probes, o, measure, a.measure_updates, a.rates, dev)
            return 0
        stall = stall_bits_of(o)
        log(
            f"{len(cells)} cells on {dev} ({precision}), {jobs} at a time, patience {a.patience}, "
            f"at most {a.max_epochs} epochs; results in {runs}"
        )
        packing = threading.Lock()

        def repack() -> None:
            # after every cell, so that a command cut by its time limit returns every result finished so far
            if a.pack:
                with packing:
                    n = pack(runs, cells, a.pack)
                log(f"packed {n} results into {a.pack}")

        # measured peak memory: a cell starts once it fits beside the running ones (plan.MemoryGate)
        gate = plan_mod.MemoryGate(rates.memory_budget_mib() if rates and a.device == "cuda" else None)
        if gate.budget is not None:
            log(f"memory: cells start while they fit in {gate.budget:,.0f} MiB ({a.rates})")

        def one(i: int) -> dict | None:
            c = cells[i]
            with gate.hold(i, rates.memory_mib(c.depth) if rates else None):
                result = run_cell(c, o, dev, stall)
            if result is not None:
                repack()
            return result

        repack()
        with ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(one, range(len(cells))))
        left = [c.name for c, r in zip(cells, results, strict=True) if r is None]
        repack()
        if left:
            log(f"{len(left)} cells not finished (deadline); run the same command again to resume: {', '.join(left)}")
        return 0
    except (ConvergeError, MatrixError, prepare_bible.CorpusError, multi30k.Multi30kError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
