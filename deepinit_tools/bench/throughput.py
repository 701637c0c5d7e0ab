#!/usr/bin/env python
"""Training throughput and peak memory of the plugin's schemes against stock fairseq ``transformer``.

Every configuration is built exactly as ``fairseq-train`` builds it (deepinit_tools/harness/
fairseq_train.py) on the real Multi30k de-en task and trained on the *same* fixed batches.
Timing is in-process and interleaved (deepinit_tools/harness/timing.py): every round times ``--steps``
steps of every configuration in turn, the start rotating each round. Reported per configuration:
median target tokens/s (fairseq's ``wps``) [min-max], and the median of the per-round ratios
against the stock ``transformer`` at the same norm position; on CPU also over process CPU time.
Peak memory: CPU, peak RSS growth in a forked child per configuration; CUDA, the growth of
``torch.cuda.max_memory_allocated`` while a configuration is built and warmed up.

``--mode cli`` cross-checks with the real ``fairseq-train``: one process per configuration and
round, tokens/s = median ``wps`` of its ``train_inner`` lines (the first dropped), its peak RSS.
``--gpu-matrix`` runs the GPU matrix instead (deepinit_tools/bench/gpu_matrix.py).

Usage (see benchmarks/README.md)::

    OMP_NUM_THREADS=1 python benchmarks/throughput.py                  # CPU, 6 and 18 layers
    python benchmarks/throughput.py --device cuda --fp16              # GPU
    python benchmarks/throughput.py --gpu-matrix --device cuda --json gpu.json
    python benchmarks/throughput.py --quick                           # smoke run (seconds)
"""

from __future__ import annotations

import gc
import itertools
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, List, Sequence

from deepinit_tools import harness
from deepinit_tools.bench.configs import (
    CONFIGS,
    FULL_SHAPES,
    NORM_COMPARISONS,
    QUICK_CONFIGS,
    QUICK_SHAPES,
    TABLE_CONFIGS,
    Config,
    train_argv,
    variant_of,
)
from deepinit_tools.bench.throughput_report import markdown
from deepinit_tools.harness import fairseq_tools
from deepinit_tools.harness.fairseq_train import (
    Run,
    Shape,
    fairseq_config,
    fixed_batches,
    setup_task,
    to_device,
)
from deepinit_tools.harness.timing import median  # noqa: F401  (tests read medians through this module)
from deepinit_tools.multi30k import DEFAULT_MULTI30K, binarize_multi30k
from deepinit_tools.paths import REPO, import_plugin

DEFAULT_WORK = REPO / "work-data" / "bench"


# ---------------------------------------------------------------------------------------------
# in-process timing


def time_shape(plan: Dict[str, tuple], task, batches: list, opts) -> dict:
    """Interleaved timing of every configuration of one shape; returns per-config samples.

    ``plan`` maps a name to ``(Config, fairseq cfg)``. On CUDA the peak memory of each
    configuration is measured while it is built and warmed up (the other, idle models are constant).
    """
    import torch

    variant, runs, peak = variant_of(opts), {}, {}
    for name, (_, fcfg) in plan.items():
        with harness.peak(opts.device) as box:
            runs[name] = Run(fcfg, task, variant, opts.device, opts.seed)
            for sample in itertools.islice(itertools.cycle(batches), opts.warmup):
                runs[name].step(sample)
        if opts.device == "cuda":
            peak[name] = box.mib

    def trial(run: Run):
        return lambda: sum(run.step(s) for s in itertools.islice(itertools.cycle(batches), opts.steps))

    def progress(r: int, rounds: harness.Rounds) -> None:
        if opts.verbose:
            rates = ", ".join(f"{n} {rounds.rates(n)[-1]:.0f}" for n in rounds.names)
            print(f"  round {r + 1}/{opts.repeats}: {rates}", flush=True)

    sync = torch.cuda.synchronize if opts.device == "cuda" else (lambda: None)
    rounds = harness.interleave(
        {n: trial(r) for n, r in runs.items()}, opts.repeats, clocks=harness.Clocks(sync=sync), on_round=progress
    )
    cpu = opts.device == "cpu"
    out = {}
    for name, run in runs.items():
        ref = plan[name][0].ref
        has_ref = ref in runs
        out[name] = {
            "tokens_per_s": rounds.rates(name),
            "ratio_to_ref": rounds.ratios(name, ref) if has_ref else [],
            # tokens per second of process CPU time: insensitive to time-slicing by other processes
            # on a shared machine (CPU only; on CUDA the host mostly waits)
            "tokens_per_cpu_s": rounds.rates(name, "cpu") if cpu else [],
            "cpu_ratio_to_ref": rounds.ratios(name, ref, "cpu") if cpu and has_ref else [],
            "tokens_per_trial": int(rounds.work[name][0]),
            "params": run.n_params,
            "fp16_overflows": run.overflows,
            **run.describe_info,
        }
        if name in peak:
            out[name]["peak_mib"] = peak[name]
    # paired ratios between plugin configurations (ScaleNorm vs LayerNorm at the same position)
    for num, den, _ in NORM_COMPARISONS:
        if num in runs and den in runs:
            out[num][f"ratio_to_{den}"] = rounds.ratios(num, den)
            if cpu:
                out[num][f"cpu_ratio_to_{den}"] = rounds.ratios(num, den, "cpu")
    del runs
    gc.collect()
    return out


def cpu_peak_memory(fcfg, task, batches: list, opts) -> float:
    """Peak RSS growth (MiB) of building a configuration and training ``--memory-steps`` steps, in a fork."""

    def work(measured: bool) -> None:
        run = Run(fcfg, task, variant_of(opts), opts.device, opts.seed)
        for sample in itertools.islice(itertools.cycle(batches), opts.memory_steps if measured else 1):
            run.step(sample)

    return harness.cpu_peak_in_fork(work)


# ---------------------------------------------------------------------------------------------
# fairseq-train cross-check


def cli_shape(shape: Shape, configs: Sequence[Config], data: Path, opts) -> dict:
    """``--mode cli``: one fairseq-train process per configuration and round, interleaved."""
    import torch

    # fairseq-train takes its intra-op threads from the environment: the same count as in-process
    env = {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    rss: Dict[str, List[float]] = {c.name: [] for c in configs}

    def trial(cfg: Config):
        def one() -> float:
            argv = [
                *train_argv(data, cfg, shape, opts),
                "--max-update",
                str(opts.cli_updates),
                "--log-format",
                "json",
                "--log-interval",
                str(opts.cli_log_interval),
                "--no-save",
                "--disable-validation",
            ]
            res = fairseq_tools.run_tool("train", argv, env=env)
            wps = [r["wps"] for r in fairseq_tools.train_inner(res.output)]
            if len(wps) < 2:
                raise SystemExit(
                    f"fairseq-train logged {len(wps)} train_inner lines for {cfg.name}; raise --cli-updates"
                )
            rss[cfg.name].append(res.peak_rss_mib)
            return median(wps[1:])  # "work" of one second: the rate itself

        return one

    # each trial returns its median wps; a clock that ticks once per reading makes every trial
    # last exactly one "second", so rates() are those medians unchanged
    unit = harness.Clocks(wall=itertools.count().__next__, cpu=itertools.count().__next__)
    rounds = harness.interleave({c.name: trial(c) for c in configs}, opts.repeats, clocks=unit)
    tps = {n: rounds.work[n] for n in rounds.names}
    out = {}
    for cfg in configs:
        ratios = harness.paired_ratios(tps[cfg.name], tps[cfg.ref]) if cfg.ref in tps else []
        out[cfg.name] = {"tokens_per_s": tps[cfg.name], "ratio_to_ref": ratios, "peak_rss_mib": median(rss[cfg.name])}
    for num, den, _ in NORM_COMPARISONS:
        if num in tps and den in tps:
            out[num][f"ratio_to_{den}"] = harness.paired_ratios(tps[num], tps[den])
    return out


# ---------------------------------------------------------------------------------------------
# report


# ---------------------------------------------------------------------------------------------
# command line


def build_parser() -> harness.Parser:
    """Every option of throughput.py, with its help and default."""
    pos, nonneg = harness.positive_int, harness.nonnegative_int
    quick = " ".join(QUICK_CONFIGS)
    p = harness.Parser(prog="throughput.py", description=__doc__.split("\n\n")[0])
    # fmt: off
    p.add_argument("--quick", action="store_true", help="smoke run: tiny shapes, few configs and steps, 2000 sentences")
    p.add_argument("--gpu-matrix", action="store_true", help="run the GPU matrix (stock vs plugin x "
                   "precision x attention x compile, 6/18/36 layers, loss check; gpu_matrix.py), not the table")
    p.add_argument("--mode", choices=("inprocess", "cli"), default="inprocess", help="in-process, or fairseq-train")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to train")
    p.add_argument("--fp16", action="store_true", help="fairseq --fp16 (CUDA only)")
    p.add_argument("--amp", action="store_true", help="fairseq --amp (CUDA only)")
    p.add_argument("--threads", type=pos, help="torch intra-op threads (default: OMP_NUM_THREADS or torch's)")
    p.add_argument("--shapes", type=Shape.parse, nargs="+",
                   help="LAYERSxDIMxFFNxHEADS (default: 6x256x1024x4 18x128x512x4; quick 2x64x128x2)")
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS),
                   help=f"configurations, their references added (default: all but plugin; quick {quick})")
    p.add_argument("--max-tokens", type=pos, help="tokens per batch (default: 1024; quick 512; gpu matrix 16384)")
    p.add_argument("--batches", type=pos, help="distinct fixed batches (default: 2; gpu matrix 8)")
    p.add_argument("--steps", type=pos, help="training steps per timed trial (default: 2; gpu matrix 10)")
    p.add_argument("--repeats", type=pos, help="interleaved rounds (default: 5; quick 2)")
    p.add_argument("--warmup", type=nonneg, help="untimed steps per configuration (default: 2; quick 1; gpu matrix 3)")
    p.add_argument("--memory-steps", type=pos, default=2, help="CPU: training steps while measuring peak memory")
    p.add_argument("--no-memory", action="store_true", help="CPU: skip the peak-memory measurement (forked children)")
    p.add_argument("--cli-updates", type=pos, default=40, help="--mode cli: --max-update of each run (quick 6)")
    p.add_argument("--cli-log-interval", type=pos, default=10, help="--mode cli: --log-interval (quick 2)")
    p.add_argument("--loss-updates", type=pos, help="gpu matrix: loss-check updates (default: 300; quick 2)")
    p.add_argument("--no-compile", action="store_true", help="gpu matrix: leave out the torch.compile row")
    p.add_argument("--layers", type=pos, nargs="+", help="gpu matrix: the depths of this pass, run in ascending "
                   "order; 6 is the full matrix with its loss check (default: 6 18 36; quick 1 2)")
    p.add_argument("--compile-only", action="store_true", help="gpu matrix: only the torch.compile row, beside its "
                   "eager twin and stock fp16 at 6 layers (no loss check)")
    p.add_argument("--out-dir", type=Path, help="gpu matrix: write <pass>.json and <pass>.md here, rewritten as rows "
                   "finish (gpu-6l, gpu-18l-36l, gpu-compile; default: none, or --json/--markdown)")
    p.add_argument("--deadline-min", type=float, help="gpu matrix: start no timing round and no loss check after "
                   "this many minutes (default: none)")
    p.add_argument("--seed", type=int, default=1, help="model and batch-order seed")
    p.add_argument("--multi30k", type=Path, default=DEFAULT_MULTI30K, help="train.{de,en}.gz folder (env MULTI30K_DIR)")
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK, help="where the binarised corpus is cached")
    p.add_argument("--train-sentences", type=pos, help="sentences to binarise (default: all 29000; quick 2000)")
    p.add_argument("--json", type=Path, help="also write every measurement as JSON here")
    p.add_argument("--markdown", type=Path, help="also write the markdown report here")
    p.add_argument("--verbose", action="store_true", help="print every round's tokens/s")
    # fmt: on
    return p


def parse_args(argv: Sequence[str] | None = None):
    """Parsed options, defaults resolved (quick / full / gpu matrix), references added."""
    p = build_parser()
    opts = p.parse_args(argv)
    opts.passthrough = list(argv if argv is not None else sys.argv[1:])
    quick, matrix = opts.quick, opts.gpu_matrix
    defaults = dict(max_tokens=(512, 1024, 16384), batches=(2, 2, 8), steps=(2, 2, 10), repeats=(2, 5, 5),
                    warmup=(1, 2, 3), loss_updates=(2, 300, 300))  # fmt: skip
    for key, (q, full, gpu) in defaults.items():
        if getattr(opts, key) is None:
            setattr(opts, key, q if quick else gpu if matrix else full)
    if opts.train_sentences is None and quick:
        opts.train_sentences = 2000
    if matrix:
        if opts.mode != "inprocess" or opts.fp16 or opts.amp or opts.shapes or opts.configs:
            p.error(
                "--gpu-matrix sets its own precisions, shapes and configurations "
                "(drop --mode/--fp16/--amp/--shapes/--configs)"
            )
        from deepinit_tools.bench import gpu_matrix

        opts.configs = []
        if opts.compile_only and (opts.no_compile or opts.layers):
            p.error("--compile-only runs the 6-layer compile row and its references; drop --no-compile/--layers")
        opts.layers = sorted(set(opts.layers or (gpu_matrix.QUICK_LAYERS if quick else gpu_matrix.LAYERS)))
        if opts.deadline_min is not None and opts.deadline_min <= 0:
            p.error(f"--deadline-min {opts.deadline_min}: give a positive number of minutes")
        opts.deadline = None if opts.deadline_min is None else time.time() + 60 * opts.deadline_min
        if opts.out_dir is not None:
            name = gpu_matrix.pass_name(opts)
            opts.json = opts.json or opts.out_dir / f"{name}.json"
            opts.markdown = opts.markdown or opts.out_dir / f"{name}.md"
        return opts
    given = [f for f, v in (("--layers", opts.layers), ("--compile-only", opts.compile_only),
                            ("--out-dir", opts.out_dir), ("--deadline-min", opts.deadline_min)) if v]  # fmt: skip
    if given:
        p.error(f"{' / '.join(given)} belong to --gpu-matrix; add --gpu-matrix or drop them")
    opts.shapes = opts.shapes or list(QUICK_SHAPES if quick else FULL_SHAPES)
    names = opts.configs or (QUICK_CONFIGS if quick else TABLE_CONFIGS)
    if opts.mode == "cli" and quick:
        opts.cli_updates, opts.cli_log_interval = 6, 2
    # the references of every chosen configuration are always measured, first
    refs = [CONFIGS[n].ref for n in names] + [den for num, den, _ in NORM_COMPARISONS if num in names]
    ordered = list(dict.fromkeys([*refs, *names]))
    opts.configs = [CONFIGS[n] for n in sorted(ordered, key=list(CONFIGS).index)]
    if (opts.fp16 or opts.amp) and opts.device != "cuda":
        p.error("--fp16/--amp need --device cuda (fairseq has no CPU half-precision training)")
    if opts.fp16 and opts.amp:
        p.error("choose one of --fp16 and --amp")
    return opts


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark the options ask for; prints the report, returns the results."""
    opts = parse_args(argv)
    logging.disable(logging.WARNING)  # fairseq's per-model INFO lines would drown the table
    warnings.filterwarnings("ignore")  # hydra/torch deprecation notices, once per model built
    import torch

    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    if opts.device == "cuda" and not torch.cuda.is_available():
        harness.fail("--device cuda: no CUDA device is visible to torch")
    import_plugin()
    size = "all" if opts.train_sentences is None else str(opts.train_sentences)
    data = binarize_multi30k(opts.multi30k, opts.work_dir / f"multi30k-de-en-word-{size}",
                             {"train": ("train", opts.train_sentences)})  # fmt: skip
    meta = harness.environment(opts.device, "throughput.py", opts.passthrough)
    if opts.gpu_matrix:
        from deepinit_tools.bench import gpu_matrix

        return gpu_matrix.run(opts, data, meta, CONFIGS)
    precision = variant_of(opts).precision
    meta.update(mode=opts.mode, precision=precision, max_tokens=opts.max_tokens, batches=opts.batches,
                steps=opts.steps, repeats=opts.repeats, warmup=opts.warmup, cli_updates=opts.cli_updates,
                cli_log_interval=opts.cli_log_interval, data=str(data))  # fmt: skip
    results = {"meta": meta, "shapes": {}}
    if opts.mode == "cli":
        for shape in opts.shapes:
            print(f"timing fairseq-train for {len(opts.configs)} configurations at {shape} ...", file=sys.stderr)
            results["shapes"][str(shape)] = cli_shape(shape, opts.configs, data, opts)
    else:
        import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: once here, not in every fork)

        # parse every configuration up front (fairseq's argparse -> omegaconf is slow; done once)
        plans = {
            s: {c.name: (c, fairseq_config(train_argv(data, c, s, opts))) for c in opts.configs} for s in opts.shapes
        }
        task = setup_task(next(iter(plans[opts.shapes[0]].values()))[1])
        batches = fixed_batches(task, opts.max_tokens, opts.seed, opts.batches)
        memory: Dict[Shape, Dict[str, float]] = {}
        if opts.device == "cpu" and not opts.no_memory:
            # all forks before the parent builds a model or runs a multi-threaded op
            print(f"measuring peak memory of {len(opts.configs)} configurations ...", file=sys.stderr, flush=True)
            try:
                memory = {s: {n: cpu_peak_memory(f, task, batches, opts) for n, (_, f) in plan.items()}
                          for s, plan in plans.items()}  # fmt: skip
            except RuntimeError as e:
                harness.fail(f"peak-memory measurement failed: {e}")
        batches = to_device(batches, opts.device)
        for shape, plan in plans.items():
            print(f"timing {len(plan)} configurations at {shape} ...", file=sys.stderr, flush=True)
            rows = time_shape(plan, task, batches, opts)
            for name, mib in memory.get(shape, {}).items():
                rows[name]["peak_mib"] = mib
            results["shapes"][str(shape)] = rows
    table = markdown(results)
    print(table)
    harness.write_json(opts.json, {"shapes": results["shapes"]}, meta)
    harness.write_markdown(opts.markdown, table)
    return results
