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
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Sequence, Tuple

from deepinit_tools import multi30k, prepare_bible
from deepinit_tools.matrix import budget as est
from deepinit_tools.matrix import plan as plan_mod
from deepinit_tools.matrix import regimes as rg
from deepinit_tools.matrix.cell import device_name, pack, run_cell, stall_bits_of
from deepinit_tools.matrix.commands import (
    PACK_FORMAT,
    ConvergeError,
    Options,
    precision_flags,
    printable,
    train_command,
)
from deepinit_tools.matrix.common import MatrixError, log
from deepinit_tools.matrix.converge_args import build_parser
from deepinit_tools.multi30k import prepare_bpe as prepare

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


ESTIMATE_NOTE = (
    "estimate from stock fairseq fp16 on an H100 scaled by CPU-measured depth/width costs, sharing speed-up "
    "assumed; `--plan --rates FILE` plans from measured rates"
)


def list_chunks(dim: int, jobs: int) -> str:
    lines = [f"estimated H100 minutes with --jobs {jobs}, d={dim}, {est.EPOCHS_EXPECTED} epochs per cell"]
    lines.append(f"({ESTIMATE_NOTE}):")
    for name, ch in {**rg.CHUNKS, **rg.SESSIONS}.items():
        minutes = est.estimate_chunk(ch.cells, dim, jobs)
        lines.append(f"  {name:<14} {len(ch.cells):>3} cells {minutes:6.1f} min  {ch.description}")
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
                f"# {len(cells)} cells, estimated {est.estimate_chunk(cells, a.dim, jobs):.1f} H100 minutes with "
                f"--jobs {jobs} ({est.EPOCHS_EXPECTED} epochs per cell; {ESTIMATE_NOTE})"
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
