"""Packing converged cells onto one GPU: ``converge --measure-jobs`` and ``converge --plan``.

Small models leave an H100 almost idle, so K cells train at once, each its own fairseq-train process.
How many pay off is measured, not assumed:

- ``--measure-jobs 1,8,12,16 --rates FILE`` starts K identical fairseq-train processes of a probe cell
  (``--measure-cells``, default ``preln:6:common``; its exact converge command plus ``--max-update``,
  no validation, no checkpoints) for every K, all at once, and records each process's target tokens/s
  (fairseq's ``wps``, the median of its ``train_inner`` records after the first) and their sum, the
  aggregate, and each process's peak memory (CUDA: ``max_memory_reserved``; CPU: peak RSS), read by a
  wrapper around ``fairseq_cli.train`` (:data:`PEAK_WRAPPER`). FILE (:data:`RATES_FORMAT`) is
  rewritten after every K.
- Memory: with measured peaks, ``converge --jobs K`` starts a cell only while the cells running fit
  in 90 % of the device's memory (:class:`MemoryGate`, cells still started in their order): a
  36-layer cell holds about six times the activations of a 6-layer one, so K 36-layer cells may
  not fit where K 6-layer ones do. A depth that was not measured: the nearest measured peak scaled
  linearly in depth, plus :data:`CONTEXT_MIB` for the CUDA context.
- ``--plan`` prints the expected wall time of the selected cells for every K of the rates: each cell
  trains ``epochs x`` Multi30k's 549,873 target tokens at the per-process rate of its depth at K jobs
  (a depth that was not measured: the nearest measured depth's rate scaled by the CPU-measured depth
  cost of :func:`deepinit_tools.matrix.budget.depth_cost`), plus the validation, process-start and decoding
  overheads of :func:`deepinit_tools.matrix.budget.estimate_cell_s`; the cells are then scheduled in their order
  onto K slots, as ``converge``'s thread pool takes them, and the plan says which finish within
  ``--budget-min`` and how many device commands of ``--command-min`` that is.

The rates come from ``--rates`` (a ``--measure-jobs`` file, or a ``converge --pack`` file, whose cells
record their tokens/s, ``--jobs`` and epochs); the plan labels each source with its device. Without
``--rates`` it falls back to :func:`deepinit_tools.matrix.budget.h100_tokens_per_s` (stock fairseq fp16 on an H100
scaled by CPU-measured depth and width costs, and an assumed sharing speed-up), labelled ESTIMATE.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

from deepinit_tools.matrix import budget as est
from deepinit_tools.matrix import regimes as rg
from deepinit_tools.matrix.cells import parse_log
from deepinit_tools.matrix.commands import PACK_FORMAT, ConvergeError, Options, train_command
from deepinit_tools.matrix.common import log
from deepinit_tools.paths import REPO

RATES_FORMAT = "deepinit-pack-rates/1"
DEFAULT_PROBE = "preln:6:common"
CONTEXT_MIB = 600.0  # a CUDA context, not in max_memory_reserved (about 500-600 MiB on an H100; assumed)
MEMORY_SHARE = 0.9  # of the device's memory that packed cells may fill
# fairseq_cli.train in-process, then its peak memory on stderr (the process's own: packed processes share the GPU)
PEAK_WRAPPER = (
    "import atexit, resource, runpy, sys\n"
    "def peak():\n"
    "    import torch\n"
    "    mib = torch.cuda.max_memory_reserved() / 2**20 if torch.cuda.is_initialized() else "
    "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024\n"
    "    print(f'PEAK_MIB {mib:.0f}', file=sys.stderr, flush=True)\n"
    "atexit.register(peak)\n"
    "sys.argv[0] = 'fairseq-train'\n"
    "runpy.run_module('fairseq_cli.train', run_name='__main__')\n"
)


@dataclasses.dataclass
class Rates:
    """Per-process target tokens/s by depth and jobs, where they come from, measured epochs by depth."""

    source: str
    per_process: Dict[int, Dict[int, float]]  # depth -> jobs -> tokens/s of one process
    epochs: Dict[int, float] = dataclasses.field(default_factory=dict)
    measured: bool = True
    peak_mib: Dict[int, float] = dataclasses.field(default_factory=dict)  # depth -> one process's peak
    device_mib: float | None = None  # the device's memory (CUDA measurements only)

    def jobs(self) -> List[int]:
        return sorted({j for per in self.per_process.values() for j in per})

    def rate(self, depth: int, jobs: int) -> Tuple[float, str]:
        """Tokens/s of one of ``jobs`` processes at ``depth`` and how it was had (measured / scaled)."""
        depths = sorted(d for d, per in self.per_process.items() if per)
        near = min(depths, key=lambda d: (abs(est.depth_cost(d) - est.depth_cost(depth)), d))
        per = self.per_process[near]
        j = jobs if jobs in per else min(per, key=lambda k: (abs(k - jobs), k))
        value = per[j] * est.depth_cost(near) / est.depth_cost(depth)
        exact = "measured" if self.measured else "estimate"
        how = exact if (near, j) == (depth, jobs) else f"from {near} layers x {j} jobs"
        if near != depth:
            how += ", scaled by the CPU-measured depth cost"
        return value, how

    def aggregate(self, depth: int, jobs: int) -> float:
        return jobs * self.rate(depth, jobs)[0]

    def memory_mib(self, depth: int) -> float | None:
        """One process's memory at ``depth`` (measured, or the nearest measured depth's scaled in depth)."""
        if not self.peak_mib:
            return None
        if depth in self.peak_mib:
            return self.peak_mib[depth] + CONTEXT_MIB
        near = min(self.peak_mib, key=lambda d: (abs(d - depth), d))
        return self.peak_mib[near] * depth / near + CONTEXT_MIB

    def memory_budget_mib(self) -> float | None:
        return None if self.device_mib is None or not self.peak_mib else MEMORY_SHARE * self.device_mib


def fallback_rates(dim: int) -> Rates:
    """The built-in estimate (no measurement): see :func:`deepinit_tools.matrix.budget.h100_tokens_per_s`."""
    per = {
        d: {j: est.h100_tokens_per_s(d, dim) * est.JOBS_SPEEDUP[j] / j for j in est.JOBS_SPEEDUP} for d in (6, 18, 36)
    }
    return Rates(
        "ESTIMATE, not measured: stock fairseq fp16 on an H100 (transformer base 6L 173k tokens/s) scaled by "
        "CPU-measured depth and width costs, sharing speed-up assumed (budget.JOBS_SPEEDUP); the cells run "
        "bf16 autocast + SDPA + adam_foreach. Measure with --measure-jobs on the GPU.",
        per,
        measured=False,
    )


def load_rates(path: Path) -> Rates:
    """Rates from a ``--measure-jobs`` file or a ``converge --pack`` file; ConvergeError if neither."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        msg = f"--rates {path}: cannot read it as JSON ({e}); give a --measure-jobs or --pack file"
        raise ConvergeError(msg) from None
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if fmt == RATES_FORMAT:
        per: Dict[int, Dict[int, float]] = {}
        peak: Dict[int, float] = {}
        for m in doc["measurements"]:
            if m.get("per_process"):
                per.setdefault(int(m["layers"]), {})[int(m["jobs"])] = statistics.median(m["per_process"])
            if m.get("peak_mib"):
                peak[int(m["layers"])] = max(peak.get(int(m["layers"]), 0.0), float(max(m["peak_mib"])))
        where = f"{doc['device']} ({doc['device_type']}, {doc['precision']}, fast path {doc['fast_path']})"
        source = f"measured by --measure-jobs on {where}, {doc['date']}, d={doc['dim']} ({path.name})"
        if doc["device_type"] != "cuda":
            source = "CPU-MEASURED, not a GPU plan: " + source
        if not per:
            raise ConvergeError(f"--rates {path} holds no finished measurement; run --measure-jobs again")
        cuda = doc["device_type"] == "cuda"
        return Rates(
            source, per, peak_mib=peak if cuda else {}, device_mib=doc.get("device_memory_mib") if cuda else None
        )
    if fmt == PACK_FORMAT:
        cells = [c for c in doc["cells"] if c.get("tokens_per_s")]
        if not cells:
            raise ConvergeError(f"--rates {path}: no cell of this pack recorded its tokens/s")
        rates: Dict[int, Dict[int, List[float]]] = {}
        epochs: Dict[int, List[float]] = {}
        for c in cells:
            rates.setdefault(int(c["layers"]), {}).setdefault(int(c["jobs"]), []).append(float(c["tokens_per_s"]))
            if c.get("status") in ("converged", "capped"):
                epochs.setdefault(int(c["layers"]), []).append(float(c["epochs"]))
        devices = sorted({f"{c['device']} ({c['device_type']})" for c in cells})
        source = f"measured by {len(cells)} converged cells on {', '.join(devices)} ({path.name})"
        if any(c["device_type"] != "cuda" for c in cells):
            source = "CPU-MEASURED, not a GPU plan: " + source
        per = {d: {j: statistics.median(v) for j, v in by.items()} for d, by in rates.items()}
        return Rates(source, per, {d: statistics.fmean(v) for d, v in epochs.items()})
    raise ConvergeError(f"--rates {path} is neither a --measure-jobs file ({RATES_FORMAT}) nor a --pack file")


# ---------------------------------------------------------------------------------------------
# the plan


def cell_seconds(cell: rg.Cell, rates: Rates, dim: int, jobs: int) -> float:
    """Expected seconds of ``cell`` while ``jobs`` processes share the device."""
    epochs = rates.epochs.get(cell.depth, est.EPOCHS_EXPECTED)
    if not rates.measured:
        # the built-in estimate (:func:`est.estimate_cell_s`), slowed by the assumed sharing speed-up
        return est.estimate_cell_s(cell, dim, epochs) * jobs / est.jobs_speedup(jobs)
    return est.estimate_cell_s(cell, dim, epochs, tokens_per_s=rates.rate(cell.depth, jobs)[0])


def schedule(
    durations: Sequence[float],
    slots: int,
    memory: Sequence[float] | None = None,
    budget: float | None = None,
) -> List[float]:
    """End times of jobs started in their order on ``slots`` workers (``converge``'s thread pool), each
    start also waiting until its ``memory`` fits in ``budget`` beside the jobs running (:class:`MemoryGate`)."""
    running: List[Tuple[float, float]] = []  # (end, memory) of the jobs started and not yet over
    t, ends = 0.0, []
    for i, d in enumerate(durations):
        need = memory[i] if memory is not None and budget is not None else 0.0
        while True:
            running = [(e, x) for e, x in running if e > t]
            used = sum(x for _, x in running)
            if len(running) < max(1, slots) and (not running or budget is None or used + need <= budget):
                break
            t = min(e for e, _ in running)
        running.append((t + d, need))
        ends.append(t + d)
    return ends


class MemoryGate:
    """Cells start in their order, each once its memory fits beside the running ones (a cell larger than
    the budget runs alone). ``hold(index, mib)`` is the context of one cell."""

    def __init__(self, budget_mib: float | None) -> None:
        self.budget, self.used, self.turn, self.running = budget_mib, 0.0, 0, 0
        self.cond = threading.Condition()

    def _fits(self, need: float) -> bool:
        return self.budget is not None and self.used + need <= self.budget

    @contextlib.contextmanager
    def hold(self, index: int, mib: float | None) -> Iterator[None]:
        need = mib if self.budget is not None and mib is not None else 0.0
        with self.cond:
            self.cond.wait_for(lambda: self.turn == index and (not need or not self.running or self._fits(need)))
            self.used, self.turn, self.running = self.used + need, self.turn + 1, self.running + 1
            self.cond.notify_all()
        try:
            yield
        finally:
            with self.cond:
                self.used, self.running = self.used - need, self.running - 1
                self.cond.notify_all()


def plan(
    cells: Sequence[rg.Cell],
    rates: Rates,
    dim: int,
    jobs: Sequence[int],
    budget_min: float | None,
    command_min: float,
) -> Tuple[str, int]:
    """The plan's text and the K with the shortest wall time."""
    lines = [f"rates: {rates.source}"]
    epochs = ", ".join(f"{d} layers {rates.epochs[d]:.1f}" for d in sorted(rates.epochs)) or "none measured"
    lines.append(f"epochs per cell: {est.EPOCHS_EXPECTED} assumed; measured mean: {epochs}")
    depths = sorted({c.depth for c in cells})
    per_depth = ", ".join(f"{sum(c.depth == d for c in cells)} at {d}L" for d in depths)
    lines.append(f"{len(cells)} cells ({per_depth})")
    head = f"{'jobs':>5} {'aggregate tok/s (6L)':>21} {'x one job':>10} {'wall min':>9} {'commands':>9}"
    if budget_min:
        head += f" {'cells in ' + format(budget_min, 'g') + ' min':>14}"
    budget = rates.memory_budget_mib()
    mems = [rates.memory_mib(c.depth) or 0.0 for c in cells]
    if budget is not None:
        per = ", ".join(f"{d}L {rates.memory_mib(d):,.0f}" for d in depths)
        lines.append(f"memory per process (MiB; unmeasured depths scaled in depth): {per}; budget {budget:,.0f} MiB")
    lines += ["", head]
    best, best_wall = jobs[0], math.inf
    one = rates.aggregate(6, 1)
    for k in jobs:
        ends = schedule([cell_seconds(c, rates, dim, k) for c in cells], k, mems, budget)
        wall = max(ends, default=0.0) / 60
        row = f"{k:>5} {rates.aggregate(6, k):>21,.0f} {rates.aggregate(6, k) / one:>10.2f} {wall:>9.1f} "
        row += f"{math.ceil(wall / command_min):>9}"
        if budget_min:
            row += f" {sum(e <= 60 * budget_min for e in ends):>14}"
        lines.append(row)
        if wall < best_wall:
            best, best_wall = k, wall
    lines.append("")
    lines.append(f"best: --jobs {best}, about {best_wall:.0f} device minutes in {command_min:g}-minute commands")
    for d in depths:
        value, how = rates.rate(d, best)
        lines.append(f"  {d} layers: {value:,.0f} tokens/s per process at {best} jobs ({how})")
    if budget_min:
        ends = schedule([cell_seconds(c, rates, dim, best) for c in cells], best, mems, budget)
        done = [c.name for c, e in zip(cells, ends, strict=True) if e <= 60 * budget_min]
        lines.append(f"finished within {budget_min:g} minutes at --jobs {best}: {len(done)} cells")
        lines += [f"  {n}" for n in done]
    lines.append(
        "(a cut command costs each running cell a process start and the epoch in progress: it resumes from its "
        "checkpoint_last.pt)"
    )
    return "\n".join(lines), best


# ---------------------------------------------------------------------------------------------
# the measurement


def measure_jobs(
    probes: Sequence[rg.Cell], o: Options, jobs: Sequence[int], updates: int, path: Path, device: str
) -> dict:
    """Run ``k`` identical training processes of every probe cell at once, for every ``k`` in ``jobs``;
    write the rates file after every measurement (see the module docstring)."""
    import datetime

    doc = {
        "format": RATES_FORMAT,
        "device": device,
        "device_type": o.device,
        "precision": o.precision,
        "fast_path": o.fast_path and o.device == "cuda",
        "dim": o.dim,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "updates": updates,
        "measurements": [],
    }
    if o.device == "cuda":
        import torch

        doc["device_memory_mib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**20)
    interval = max(1, updates // 5)
    threads = str(o.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
    for probe in probes:
        for k in jobs:
            if o.deadline is not None and time.time() > o.deadline:
                log(f"measure: deadline reached before {probe.name} x {k}")
                break
            logs, procs = [], []
            start = time.time()
            for i in range(k):
                save = o.runs / "measure" / f"{probe.dirname}-j{k}-{i}"
                save.mkdir(parents=True, exist_ok=True)
                cmd = train_command(probe, dataclasses.replace(o, runs=save.parent))
                cmd = [*cmd[: cmd.index("--save-dir") + 1], str(save), *cmd[cmd.index("--save-dir") + 2 :]]
                cmd = [sys.executable, "-c", PEAK_WRAPPER, *cmd[3:]]  # fairseq_cli.train, then its peak memory
                cmd += ["--max-update", str(updates), "--disable-validation", "--no-save"]
                cmd += ["--log-interval", str(interval)]
                log_path = save / "train.log"
                logs.append(log_path)
                with open(log_path, "w", encoding="utf-8") as f:
                    procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO))
            codes = [p.wait() for p in procs]
            rates, peaks = [], []
            for log_path in logs:
                text = log_path.read_text(encoding="utf-8")
                wps = [float(r["wps"]) for r in parse_log(text)["train"]]
                if len(wps) >= 2:
                    rates.append(statistics.median(wps[1:]))  # the first interval holds the start-up
                peaks += [float(x) for x in re.findall(r"^PEAK_MIB (\d+)$", text, flags=re.M)]
            m = {"cell": probe.name, "layers": probe.depth, "jobs": k, "wall_s": round(time.time() - start, 1),
                 "per_process": [round(r) for r in rates], "aggregate": round(sum(rates)) if rates else None,
                 "peak_mib": [round(x) for x in peaks], "failed_processes": sum(c != 0 for c in codes)}  # fmt: skip
            if len(rates) < k:
                m["note"] = f"{k - len(rates)} of {k} processes logged no rate; see {logs[0].parent.parent}"
                m["per_process"] = []  # an incomplete pack does not measure the pack
            doc["measurements"].append(m)
            log(f"measure {probe.name} x {k}: aggregate {m['aggregate']} tokens/s, {m['wall_s']} s")
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(doc, indent=1))
            tmp.replace(path)
    return doc


def best_jobs(rates: Rates) -> int:
    """The K of the highest aggregate tokens/s at the most measured depth (ties: fewer jobs). Memory
    does not cap K here: :class:`MemoryGate` holds back the cells that would not fit."""
    depth = max(rates.per_process, key=lambda d: (len(rates.per_process[d]), -d))
    per = rates.per_process[depth]
    return max(per, key=lambda k: (k * per[k], -k))
