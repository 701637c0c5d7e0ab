"""``throughput.py --gpu-matrix``: stock fairseq against the plugin's fast paths, side by side.

Identical dimensions and batches for every row: transformer base (d 512, FFN 2048, 8 heads) at 6,
18 and 36 layers per stack. At 6 layers the full matrix:

- stock ``transformer`` in fp32 and in fp16 (fairseq's ``FP16Optimizer``, as ``--fp16``), stock
  Pre-LN in fp16 (the reference of the Pre-LN rows);
- the plugin's model (``--arch deepinit --init-scheme fairseq``: stock's model and init) in fp16
  and in bf16 autocast (``--task translation_deepinit --autocast-bf16``: fp32 weights, forward and
  loss under ``torch.autocast(bfloat16)``), each with fairseq's and SDPA attention; the bf16 SDPA
  model with ``--optimizer adam_foreach`` (fairseq's Adam over all fp32 tensors at once: without
  apex, fairseq's ``adam`` loops over ~250 tensors), and that under ``torch.compile`` (guarded: a
  failure is recorded in its row);
- every init-only scheme and Pre-LN ScaleNorm in fp16.

At 18 and 36 layers: stock fp16 and the plugin's fp16 and bf16 SDPA paths. Per row: median target
tokens/s over interleaved rounds, the median per-round paired ratio to stock fp16 at the same
depth and norm position, peak memory, MFU (deepinit_tools/harness/flops.py). Then, at 6 layers, the
loss-curve check: stock fp16 and the fastest eager plugin path (a compiled row computes the same
function; checking it would compile a second time) train ``--loss-updates`` updates on the same
batches from the same initial weights; their final losses and the difference are recorded.

The matrix runs in passes that each fit a 10-minute device command (docs/benchmarks.md, "GPU run"):
``--layers 6 --no-compile`` (the 6-layer rows and their loss check, first), ``--layers 18 36``,
``--compile-only`` (the compiled row beside its eager twin and stock fp16 at 6 layers). Depths run
in ascending order. ``--deadline-min`` ends the timing rounds and skips the loss check once that
many minutes have passed. The JSON and markdown (``--json``/``--markdown``, or
``--out-dir``/``gpu-<pass>.json``/``.md``) are rewritten after every row built, every timing
round and the loss check, so a command cut by its limit still returns what finished.

Rows skipped on this device (fp16 and compile need CUDA) are recorded as skipped, so ``--quick``
runs the whole code path on a CPU. Rows of the JSON: config, layers, device, precision,
tokens_per_s, ratio_to_stock, peak_mem_gib, mfu; ``note`` when a row was not measured; top level:
``finished`` (false while the pass runs or after it was cut), ``details`` (every round, ``rounds`` done).
"""

from __future__ import annotations

import gc
import itertools
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping

from deepinit_tools import harness
from deepinit_tools.bench.gpu_matrix_report import markdown, table_rows, targets
from deepinit_tools.bench.gpu_matrix_rows import (
    BASE,
    LAYERS,
    LR,
    QUICK_DIMS,
    QUICK_LAYERS,
    Row,
    baseline,
    compile_pair,
    matrix,
    skip_reason,
)
from deepinit_tools.harness import flops
from deepinit_tools.harness.fairseq_train import (
    Run,
    Shape,
    Variant,
    fairseq_config,
    fixed_batches,
    setup_task,
    to_device,
)
from deepinit_tools.harness.fairseq_train import train_argv as _train_argv


def _error(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return f"error: {type(e).__name__}: {first}"


class Builder:
    """Builds rows on one task per precision mode (bf16 autocast needs the plugin's task)."""

    def __init__(self, data: Path, opts, configs: Mapping) -> None:
        self.data, self.opts, self.configs, self.tasks = data, opts, configs, {}

    def shape(self, layers: int) -> Shape:
        return Shape(layers, *(QUICK_DIMS if self.opts.quick else BASE))

    def build(self, row: Row) -> Run:
        cfg = self.configs[row.config]
        argv = _train_argv(self.data, cfg.arch, cfg.flags, self.shape(row.layers), row.variant, cfg.plugin, self.opts)
        fcfg = fairseq_config(argv)
        key = row.variant.precision == "bf16-autocast"
        if key not in self.tasks:
            self.tasks[key] = setup_task(fcfg)
        return Run(fcfg, self.tasks[key], row.variant, self.opts.device, self.opts.seed)

    def task(self):
        return next(iter(self.tasks.values()))


class _Deadline(Exception):
    """The ``--deadline-min`` passed: no more timing rounds."""


def past_deadline(opts) -> bool:
    deadline = getattr(opts, "deadline", None)
    return deadline is not None and time.time() > deadline


def measure_depth(
    rows: List[Row], builder: Builder, batches: list, opts, out: dict, on_update: Callable[[], None] = lambda: None
) -> None:
    """Build, warm up and time (interleaved) every row of one depth; fills ``out[row]``.

    ``on_update()`` is called after every row built and every timing round (``out`` then holds
    the rounds so far), so that the caller can rewrite its results; past ``opts.deadline`` no
    further round starts.
    """
    import torch

    runs: Dict[Row, Run] = {}
    for row in rows:
        try:
            with harness.peak(opts.device) as box:
                run = builder.build(row)
                # compile: every distinct batch once, so recompilations happen before the timing
                for s in itertools.islice(
                    itertools.cycle(batches), max(opts.warmup, len(batches) if row.variant.compile else 0)
                ):
                    run.step(s)
            runs[row] = run
            out[row] = {"peak_mib": box.mib, "params": run.n_params}
        except Exception as e:  # noqa: BLE001  (compile, OOM...: recorded in the row, the run goes on)
            out[row] = {"note": _error(e)}
            if opts.device == "cuda":
                torch.cuda.empty_cache()
        print(f"  built {row.key}: {out[row].get('note', 'ok')}", file=sys.stderr, flush=True)
        on_update()
    if not runs:
        return
    errors: Dict[Row, str] = {}

    def trial(row: Row, run: Run):
        def one() -> float:
            if row in errors:
                return math.nan
            try:
                return sum(run.step(s) for s in itertools.islice(itertools.cycle(batches), opts.steps))
            except Exception as e:  # noqa: BLE001
                errors[row] = _error(e)
                return math.nan

        return one

    shape = builder.shape(rows[0].layers)
    pad = builder.task().target_dictionary.pad()
    dims = flops.Dims(shape.layers, shape.layers, shape.dim, shape.ffn, len(builder.task().target_dictionary))
    trial_batches = list(itertools.islice(itertools.cycle(batches), opts.steps))
    flops_per_trial = sum(flops.step_flops(dims, flops.BatchLengths.of_sample(b, pad)) for b in trial_batches)

    def fill(rounds: harness.Rounds) -> None:
        for row, run in runs.items():
            rec = out[row]
            rec.update(rates=rounds.rates(row.key), flops_per_trial=flops_per_trial, fp16_overflows=run.overflows)
            rec["seconds"] = rounds.wall[row.key]
            rec["rounds"] = len(rounds.orders)
            if row in errors:
                rec["note"] = errors[row]
            base = baseline(row, runs, builder.configs)
            if base is not None and base not in errors:
                rec["baseline"] = base.key
                rec["ratios"] = rounds.ratios(row.key, base.key)
        # ScaleNorm against LayerNorm at the same (Pre-norm) position, paired per round
        sn, ln = (Row(n, Variant("fp16"), rows[0].layers) for n in ("preln-scalenorm", "preln"))
        if sn in runs and ln in runs:
            out[sn]["ratios_to_preln"] = rounds.ratios(sn.key, ln.key)

    latest: List[harness.Rounds] = []

    def on_round(r: int, rounds: harness.Rounds) -> None:
        latest[:] = [rounds]
        fill(rounds)
        on_update()
        if r + 1 < opts.repeats and past_deadline(opts):
            raise _Deadline

    sync = torch.cuda.synchronize if opts.device == "cuda" else (lambda: None)
    try:
        harness.interleave(
            {r.key: trial(r, run) for r, run in runs.items()},
            opts.repeats,
            clocks=harness.Clocks(sync=sync),
            on_round=on_round,
        )
    except _Deadline:
        print(f"  --deadline-min reached after {len(latest[0].orders)} rounds", file=sys.stderr, flush=True)
    runs.clear()  # the models go before the next depth is built
    gc.collect()
    if opts.device == "cuda":
        torch.cuda.empty_cache()


def lr_at(update: int, warmup: int) -> float:
    """Linear warm-up then inverse square root (fairseq's ``inverse_sqrt``), the same for both models."""
    u = update + 1
    return LR * min(u / warmup, math.sqrt(warmup / u))


def loss_check(stock: Row, fast: Row, builder: Builder, opts) -> dict:
    """Train ``stock`` and ``fast`` ``--loss-updates`` updates on the same batches; final losses.

    Both start from the same seed (the same initial weights: the plugin's model here is built with
    fairseq's own init) and see the same batches in the same order. Final loss: fairseq's training
    loss (label-smoothed, base 2, per target token) averaged over the last tenth of the updates.
    """
    n = opts.loss_updates
    batches = to_device(fixed_batches(builder.task(), opts.max_tokens, opts.seed, n), opts.device)
    warmup, last = max(1, n // 4), max(1, n // 10)
    out: dict = {
        "updates": n,
        "batches": "the same for both, in the same order",
        "lr": f"{LR} peak, {warmup} warm-up updates, then inverse sqrt",
    }
    for name, row in (("stock", stock), ("fast", fast)):
        try:
            run = builder.build(row)
            losses, t0 = [], time.perf_counter()
            for u, sample in enumerate(batches):
                run.optimizer.set_lr(lr_at(u, warmup))
                before = run.overflows
                run.step(sample)
                losses.append(math.nan if run.overflows > before else run.last_loss)
            tail = [x for x in losses[-last:] if math.isfinite(x)]
            out[f"{name}_config"] = row.key
            out[f"{name}_final_loss"] = statistics.fmean(tail) if tail else math.nan
            out[f"{name}_curve"] = [round(x, 4) for x in losses[:: max(1, n // 20)]]
            out[f"{name}_seconds"] = time.perf_counter() - t0
            del run
        except Exception as e:  # noqa: BLE001
            out[f"{name}_config"], out[f"{name}_final_loss"], out[f"{name}_note"] = row.key, math.nan, _error(e)
    diff = out["fast_final_loss"] - out["stock_final_loss"]
    out["difference"] = diff
    out["relative_difference"] = diff / out["stock_final_loss"] if out["stock_final_loss"] else math.nan
    return out


def pass_name(opts) -> str:
    """The name of this pass's files under ``--out-dir``: ``gpu-6l``, ``gpu-18l-36l``, ``gpu-compile``."""
    if opts.compile_only:
        return "gpu-compile"
    return "gpu-" + "-".join(f"{n}l" for n in opts.layers)


def plan_rows(opts) -> tuple[List[Row], int]:
    """This pass's rows and the depth of the full matrix (6; quick 1)."""
    full = (QUICK_LAYERS if opts.quick else LAYERS)[0]
    if opts.compile_only:
        return compile_pair(full), full
    return matrix(opts.layers, compile_row=not opts.no_compile, full=full), full


def run(opts, data: Path, meta: dict, configs: Mapping) -> dict:
    """Run this pass of the matrix; rewrites ``--json`` / ``--markdown`` as it goes; returns the document."""
    rows, full = plan_rows(opts)
    layers = sorted({r.layers for r in rows})
    meta.update(
        max_tokens=opts.max_tokens, batches=opts.batches, steps=opts.steps, repeats=opts.repeats, warmup=opts.warmup,
        layers=layers, compile_only=opts.compile_only, no_compile=opts.no_compile,
    )  # fmt: skip
    name = meta["device_name"].split(",")[0]
    _, peak_note = flops.peak_flops(name) if opts.device == "cuda" else (None, "CPU: no bf16 peak, mfu is null")
    builder = Builder(data, opts, configs)
    results: Dict[Row, dict] = {r: {"note": skip_reason(r, opts.device)} for r in rows if skip_reason(r, opts.device)}
    state: dict = {"loss": None, "finished": False}

    def write() -> dict:
        ordered = {r: results[r] for r in rows if r in results}
        doc = {"device": name, "date": meta["date"], "command": meta["command"], "peak_note": peak_note,
               "finished": state["finished"], "rows": table_rows(ordered, name), "loss_check": state["loss"],
               "targets": targets(ordered, state["loss"], full),
               "details": {r.key: {k: v for k, v in rec.items() if k != "note"}
                           for r, rec in ordered.items()}}  # fmt: skip
        harness.write_json(opts.json, doc, meta)
        harness.write_markdown(opts.markdown, markdown({**doc, "meta": meta}))
        return doc

    write()
    batches: list = []
    for depth in layers:
        todo = [r for r in rows if r.layers == depth and r not in results]
        print(f"gpu matrix: {len(todo)} rows at {depth} layers ...", file=sys.stderr, flush=True)
        if not todo:
            continue
        if not batches:
            builder.build(todo[0])  # sets up the task (dictionaries) the batches come from
            batches = to_device(fixed_batches(builder.task(), opts.max_tokens, opts.seed, opts.batches), opts.device)
        measure_depth(todo, builder, batches, opts, results, on_update=write)
        if depth == full and not opts.compile_only:
            fast = [r for r in todo if r.config == "plugin" and not r.variant.compile and results[r].get("rates")]
            stock = baseline(
                Row("plugin", Variant("fp16"), depth), {r: 1 for r in todo if results[r].get("rates")}, configs
            )
            if fast and stock and past_deadline(opts):
                state["loss"] = {"note": "skipped: --deadline-min reached before the loss-curve check"}
            elif fast and stock:
                best = max(fast, key=lambda r: harness.median(results[r]["rates"]))
                print(f"gpu matrix: loss-curve check, {stock.key} vs {best.key} ...", file=sys.stderr, flush=True)
                state["loss"] = loss_check(stock, best, builder, opts)
        write()
    state["finished"] = True
    doc = write()
    print(markdown({**doc, "meta": meta}))
    return {"meta": meta, **doc}
