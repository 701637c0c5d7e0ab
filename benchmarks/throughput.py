#!/usr/bin/env python
"""Training throughput and peak memory of the plugin's schemes against stock fairseq ``transformer``.

Every configuration is built exactly as ``fairseq-train`` builds it (parsed arguments ->
``convert_namespace_to_omegaconf`` -> ``task.build_model`` / ``task.build_criterion`` -> fairseq's
optimizer, fp16 wrapper included) on the real Multi30k de-en translation task, and trained on the
*same* fixed batches. One training step is what fairseq's ``Trainer.train_step`` does: zero the
gradients, ``task.train_step`` (forward + backward through the criterion), ``multiply_grads``,
``clip_grad_norm`` and ``task.optimizer_step`` (Adam).

Timing is in-process and interleaved: every round times ``--steps`` steps of every configuration
in turn (the starting configuration rotates each round), so slow drifts of a shared machine hit
all configurations alike. Reported per configuration: the median tokens/s over the rounds
(tokens = target tokens, fairseq's ``wps``) with its min-max spread, and the median of the
per-round ratios against the stock ``transformer`` at the same norm position (paired within a
round) with their min-max spread. Peak memory is measured in a separate child process, one
configuration after another: on CPU the peak resident-set growth while building the model and
training a few steps (``VmHWM`` reset through ``/proc/self/clear_refs``; glibc's mmap threshold
fixed so freed tensors go back to the OS between configurations), on CUDA
``torch.cuda.max_memory_allocated``.

``--mode cli`` cross-checks with the real ``fairseq-train`` command line: one process per
configuration and round, tokens/s = the median ``wps`` of its ``train_inner`` log lines
(the first one, which contains start-up, dropped) and the process's peak RSS.

The script prints a ready-to-paste markdown table; ``--json`` also writes every number.
Usage (see benchmarks/README.md)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/throughput.py            # CPU, 6 and 18 layers
    .venv/bin/python benchmarks/throughput.py --device cuda --fp16        # GPU
    .venv/bin/python benchmarks/throughput.py --quick                     # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import gc
import gzip
import itertools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, List, Sequence

REPO = Path(__file__).resolve().parent.parent
USER_DIR = str(REPO / "fairseq_deepinit")
DEFAULT_MULTI30K = Path(os.environ.get("MULTI30K_DIR", REPO.parent / "shared" / "data" / "multi30k"))
DEFAULT_WORK = REPO / "work-data" / "bench"

# the checkout's package, never a stale installed copy (fairseq's --user-dir import relies on this)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@dataclasses.dataclass(frozen=True)
class Shape:
    """Model dimensions shared by every configuration of one table (identical dims and batch)."""

    layers: int
    dim: int
    ffn: int
    heads: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        """``LAYERSxDIMxFFNxHEADS``, e.g. ``6x256x1024x4``."""
        try:
            layers, dim, ffn, heads = (int(v) for v in text.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"shape {text!r} is not LAYERSxDIMxFFNxHEADS (e.g. 6x256x1024x4)"
            ) from None
        if min(layers, dim, ffn, heads) <= 0 or dim % heads:
            raise argparse.ArgumentTypeError(f"shape {text!r}: all sizes must be positive and heads must divide dim")
        return cls(layers, dim, ffn, heads)

    def __str__(self) -> str:
        return f"{self.layers}x{self.dim}x{self.ffn}x{self.heads}"

    def flags(self) -> List[str]:
        n, d, f, h = (str(v) for v in (self.layers, self.dim, self.ffn, self.heads))
        return [
            "--encoder-layers", n, "--decoder-layers", n,
            "--encoder-embed-dim", d, "--decoder-embed-dim", d,
            "--encoder-ffn-embed-dim", f, "--decoder-ffn-embed-dim", f,
            "--encoder-attention-heads", h, "--decoder-attention-heads", h,
        ]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Config:
    """One model configuration: a fairseq ``--arch`` plus flags, and what it is compared against."""

    name: str
    arch: str
    flags: tuple
    what: str
    ref: str = "stock"  # the stock configuration at the same norm position
    init_only: bool = False  # same computation as ``ref``, only the initial weights differ

    @property
    def plugin(self) -> bool:
        return not self.name.startswith("stock")


PRE = ("--encoder-normalize-before", "--decoder-normalize-before")
CONFIGS: Dict[str, Config] = {
    c.name: c
    for c in (
        Config("stock", "transformer", (), "fairseq `transformer`, Post-LN, LayerNorm", ref="stock"),
        Config("stock-preln", "transformer", PRE, "fairseq `transformer`, Pre-LN, LayerNorm", ref="stock-preln"),
        Config("postln", "postln_wmt_en_de", (), "Post-LN, xavier (0.8/0.9 baseline)", init_only=True),
        Config("lipschitz", "lipschitz_wmt_en_de", (), "Post-LN, Lipschitz init", init_only=True),
        Config("smallinit", "deepinit", ("--init-scheme", "smallinit"), "Post-LN, SmallInit", init_only=True),
        Config("ds-init", "dsinit_wmt_en_de", (), "Post-LN, DS-Init", init_only=True),
        Config("preln", "preln_wmt_en_de", (), "Pre-LN, LayerNorm, xavier", ref="stock-preln", init_only=True),
        Config(
            "preln-scalenorm",
            "preln_wmt_en_de",
            ("--norm-type", "scalenorm"),
            "Pre-LN, ScaleNorm, xavier",
            ref="stock-preln",
        ),
        Config(
            "preln-rmsnorm", "preln_wmt_en_de", ("--norm-type", "rmsnorm"), "Pre-LN, RMSNorm, xavier", ref="stock-preln"
        ),
        Config("deepnorm", "deepnorm_wmt_en_de", (), "DeepNorm: Post-LN, alpha-scaled residual"),
        Config("t-fixup", "tfixup_wmt_en_de", (), "T-Fixup: no norm"),
        Config("rezero", "rezero_wmt_en_de", (), "ReZero: no norm, x + a*f(x)"),
        Config(
            "twt", "twt_wmt_en_de", (), "TwT: Pre-norm ScaleNorm + FixNorm + SmallInit, tied output", ref="stock-preln"
        ),
    )
}
QUICK_CONFIGS = ("postln", "preln-scalenorm")
FULL_SHAPES = (Shape(6, 256, 1024, 4), Shape(18, 128, 512, 4))
QUICK_SHAPES = (Shape(2, 64, 128, 2),)
# (numerator, denominator, target ratio): ScaleNorm must be no slower than LayerNorm at the same position
NORM_COMPARISONS = (("preln-scalenorm", "preln", 1.0), ("preln-rmsnorm", "preln", None))
INIT_ONLY_TARGET = 0.98


# ---------------------------------------------------------------------------------------------
# data


def tokenize(line: str) -> str:
    """Lower-cased words and punctuation marks, space separated (Multi30k is raw text)."""
    return " ".join(re.findall(r"\w+|[^\w\s]", line.lower()))


def binarize_multi30k(raw_dir: Path, dest: Path, n_train: int | None) -> Path:
    """Binarise Multi30k de-en train (word level, min count 2) into ``dest`` once; returns ``dest``.

    The tokenised text is written next to the binary files only while fairseq-preprocess runs and
    deleted afterwards; the corpus is read in place, gzip and all.
    """
    stamp = dest / "STAMP.json"
    want = {"raw": str(raw_dir), "n_train": n_train, "tokenizer": "words+punct, lower", "threshold": 2}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return dest
    for lang in ("de", "en"):
        if not (raw_dir / f"train.{lang}.gz").exists():
            raise SystemExit(f"Multi30k not found: {raw_dir / f'train.{lang}.gz'} is missing; pass --multi30k DIR")
    from fairseq import options
    from fairseq_cli import preprocess

    dest.mkdir(parents=True, exist_ok=True)
    for lang in ("de", "en"):
        with gzip.open(raw_dir / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            lines = [tokenize(line) for line in itertools.islice(f, n_train)]
        (dest / f"tok.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    args = options.get_preprocessing_parser().parse_args(
        [
            "--source-lang",
            "de",
            "--target-lang",
            "en",
            "--trainpref",
            str(dest / "tok"),
            "--destdir",
            str(dest),
            "--workers",
            "1",
            "--thresholdsrc",
            "2",
            "--thresholdtgt",
            "2",
        ]  # fmt: skip
    )
    try:
        preprocess.main(args)
    finally:
        for lang in ("de", "en"):
            (dest / f"tok.{lang}").unlink(missing_ok=True)
    stamp.write_text(json.dumps(want))
    return dest


# ---------------------------------------------------------------------------------------------
# in-process training


def train_argv(data: Path, cfg: Config, shape: Shape, opts) -> List[str]:
    """fairseq-train arguments of ``cfg`` (shared by the in-process builder and ``--mode cli``)."""
    argv = [
        str(data), "--task", "translation", "-s", "de", "-t", "en", "--arch", cfg.arch, *cfg.flags, *shape.flags(),
        "--dropout", "0.1", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "5e-4", "--clip-norm", "0.0",
        "--max-tokens", str(opts.max_tokens), "--seed", str(opts.seed), "--num-workers", "0",
    ]  # fmt: skip
    if cfg.plugin:
        argv += ["--user-dir", USER_DIR]
    if opts.device == "cpu":
        argv.append("--cpu")
    if opts.fp16:
        argv.append("--fp16")
    if opts.amp:
        argv.append("--amp")
    return argv


def fairseq_config(data: Path, cfg: Config, shape: Shape, opts):
    """fairseq-train's parsed configuration of ``cfg`` (argparse, then omegaconf, as fairseq-train)."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(options.get_training_parser(), train_argv(data, cfg, shape, opts))
    return convert_namespace_to_omegaconf(args)


class Run:
    """One configuration built the way fairseq-train builds it, ready to take training steps."""

    def __init__(self, cfg: Config, fcfg, task, opts) -> None:
        import torch
        from fairseq import optim

        self.cfg, self.task = cfg, task
        torch.manual_seed(opts.seed)
        model = task.build_model(fcfg.model)
        self.criterion = task.build_criterion(fcfg.criterion).to(opts.device)
        if opts.fp16:
            model = model.half()
        self.model = model.to(opts.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.n_params = sum(p.numel() for p in {id(p): p for p in params}.values())
        if opts.fp16:
            self.optimizer = optim.FP16Optimizer.build_optimizer(fcfg, params)
        elif opts.amp:
            self.optimizer = optim.AMPOptimizer.build_optimizer(fcfg, params)
        else:
            self.optimizer = optim.build_optimizer(fcfg.optimizer, params)
        self.updates = 0
        self.overflows = 0

    def step(self, sample: dict) -> int:
        """fairseq ``Trainer.train_step`` for one batch, without its logging; returns target tokens."""
        self.optimizer.zero_grad()
        try:
            _, sample_size, _ = self.task.train_step(sample, self.model, self.criterion, self.optimizer, self.updates)
            self.optimizer.multiply_grads(1.0 / (sample_size or 1.0))
            self.optimizer.clip_grad_norm(0.0)
            self.task.optimizer_step(self.optimizer, self.model, self.updates)
        except OverflowError:  # fp16 loss-scale overflow: fairseq skips the update too
            self.overflows += 1
        self.updates += 1
        return int(sample["ntokens"])

    def describe(self) -> dict:
        """What was actually built: model class, norm and residual module classes (for checks)."""
        kinds = {type(m).__name__ for m in self.model.modules()}
        norms = set()
        for stack in (self.model.encoder, self.model.decoder):
            for layer in stack.layers:
                for attr in ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm"):
                    if getattr(layer, attr, None) is not None:
                        norms.add(type(getattr(layer, attr)).__name__)
        return {
            "model_class": type(self.model).__name__,
            "norm_classes": sorted(norms),
            "residual_classes": sorted(k for k in kinds if k.endswith("Residual")),
            "fixnorm": "FixNormEmbedding" in kinds,
        }


def fixed_batches(task, opts, n: int) -> list:
    """The first ``n`` batches of a seeded shuffled epoch of Multi30k train (on the CPU)."""
    task.load_dataset("train")
    itr = task.get_batch_iterator(
        dataset=task.dataset("train"),
        max_tokens=opts.max_tokens,
        max_positions=task.max_positions(),
        ignore_invalid_inputs=True,
        seed=opts.seed,
    ).next_epoch_itr(shuffle=True)
    batches = list(itertools.islice(itr, n))
    if len(batches) < n:
        raise SystemExit(f"only {len(batches)} batches of --max-tokens {opts.max_tokens} in the data; lower --batches")
    return batches


def to_device(batches: list, device: str) -> list:
    if device != "cuda":
        return batches
    from fairseq import utils

    return [utils.move_to_cuda(b) for b in batches]


def synchronize(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def time_shape(plan: Dict[str, tuple], task, batches: list, opts) -> dict:
    """Interleaved timing of every configuration of one shape; returns per-config samples.

    ``plan`` maps a configuration name to ``(Config, fairseq cfg)``. On CUDA the peak memory of
    each configuration is measured here too, while it is built and warmed up:
    ``max_memory_allocated`` minus what was allocated before (the other, idle models are constant).
    """
    import torch

    runs: Dict[str, Run] = {}
    peak: Dict[str, float] = {}
    for name, (cfg, fcfg) in plan.items():
        if opts.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        runs[name] = run = Run(cfg, fcfg, task, opts)
        # Adam state, allocator, lazy kernels: all before the timed rounds
        for sample in itertools.islice(itertools.cycle(batches), opts.warmup):
            run.step(sample)
        if opts.device == "cuda":
            torch.cuda.synchronize()
            peak[name] = (torch.cuda.max_memory_allocated() - base) / 2**20

    names = list(plan)
    cpu = opts.device == "cpu"
    tps: Dict[str, List[float]] = {n: [] for n in names}
    cpu_tps: Dict[str, List[float]] = {n: [] for n in names}
    ratios: Dict[str, List[float]] = {n: [] for n in names}
    cpu_ratios: Dict[str, List[float]] = {n: [] for n in names}
    tokens: Dict[str, int] = {}
    for r in range(opts.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        wall, proc = {}, {}
        for name in order:
            run, ntok = runs[name], 0
            synchronize(opts.device)
            t0, c0 = time.perf_counter(), time.process_time()
            for sample in itertools.islice(itertools.cycle(batches), opts.steps):
                ntok += run.step(sample)
            synchronize(opts.device)
            wall[name] = ntok / (time.perf_counter() - t0)
            proc[name] = ntok / (time.process_time() - c0)
            tokens[name] = ntok
        for name in names:
            tps[name].append(wall[name])
            cpu_tps[name].append(proc[name])
            ref = plan[name][0].ref
            if ref in wall:
                ratios[name].append(wall[name] / wall[ref])
                cpu_ratios[name].append(proc[name] / proc[ref])
        if opts.verbose:
            print(f"  round {r + 1}/{opts.repeats}: " + ", ".join(f"{n} {wall[n]:.0f}" for n in names), flush=True)
    out = {}
    for name in names:
        run = runs[name]
        out[name] = {
            "tokens_per_s": tps[name],
            "ratio_to_ref": ratios[name],
            # tokens per second of process CPU time: insensitive to time-slicing by other processes
            # on a shared machine (CPU only; on CUDA the host mostly waits)
            "tokens_per_cpu_s": cpu_tps[name] if cpu else [],
            "cpu_ratio_to_ref": cpu_ratios[name] if cpu else [],
            "tokens_per_trial": tokens[name],
            "params": run.n_params,
            "fp16_overflows": run.overflows,
            **run.describe(),
        }
        if name in peak:
            out[name]["peak_mib"] = peak[name]
    # paired ratios between plugin configurations (ScaleNorm vs LayerNorm at the same position)
    for num, den, _ in NORM_COMPARISONS:
        if num in tps and den in tps:
            out[num][f"ratio_to_{den}"] = [a / b for a, b in zip(tps[num], tps[den], strict=True)]
            if cpu:
                out[num][f"cpu_ratio_to_{den}"] = [a / b for a, b in zip(cpu_tps[num], cpu_tps[den], strict=True)]
    del runs
    gc.collect()
    return out


# ---------------------------------------------------------------------------------------------
# peak memory on CPU (one forked child per configuration)


def _proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to give back
        pass


def _fixed_mmap_threshold(nbytes: int) -> None:
    """glibc: allocations above ``nbytes`` are mmap'ed and unmapped on free (no dynamic threshold)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    except OSError:  # not glibc
        pass


def cpu_peak_memory(cfg: Config, fcfg, task, batches: list, opts) -> float:
    """Peak RSS growth (MiB) of building ``cfg`` and training ``--memory-steps`` steps, in a fork.

    The child starts from the parent's state (imports, dictionaries, batches loaded). It first
    builds and trains the configuration once unmeasured (one-off costs: lazy imports, kernel and
    allocator set-up), frees it, then resets its peak-RSS mark (``/proc/self/clear_refs``,
    Linux >= 4.0) and reports ``VmHWM - VmRSS`` over a second, measured build and training run.
    glibc's mmap threshold is fixed in the child so that freed tensors leave the RSS instead of
    staying in the heap: the figure is close to the peak of live allocations. The parent must not
    have run a multi-threaded torch op yet (OpenMP does not survive fork): the caller forks all
    children before it builds any model.
    """
    gc.collect()
    _malloc_trim()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_fd)
        code, msg = 0, ""
        try:
            _fixed_mmap_threshold(64 * 1024)
            for measured in (False, True):
                if measured:
                    gc.collect()
                    _malloc_trim()
                    with open("/proc/self/clear_refs", "w") as f:
                        f.write("5")
                    base = _proc_status_kb("VmRSS")
                run = Run(cfg, fcfg, task, opts)
                for sample in itertools.islice(itertools.cycle(batches), opts.memory_steps if measured else 1):
                    run.step(sample)
                del run
            msg = json.dumps({"mib": (_proc_status_kb("VmHWM") - base) / 1024})
        except BaseException as e:  # the parent reports it; a child must never return into main()
            code, msg = 1, json.dumps({"error": f"{type(e).__name__}: {e}"})
        finally:
            os.write(write_fd, msg.encode())
            os.close(write_fd)
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        msg = f.read()
    os.waitpid(pid, 0)
    rec = json.loads(msg) if msg else {"error": "the child died without a word (killed for memory?)"}
    if "error" in rec:
        raise SystemExit(f"peak-memory measurement of {cfg.name} failed: {rec['error']}")
    return rec["mib"]


# ---------------------------------------------------------------------------------------------
# fairseq-train cross-check


def cli_run(cfg: Config, shape: Shape, data: Path, opts) -> dict:
    """One ``fairseq-train`` process: median train_inner wps (first interval dropped), peak RSS."""
    argv = [
        sys.executable, "-m", "fairseq_cli.train", *train_argv(data, cfg, shape, opts),
        "--max-update", str(opts.cli_updates), "--log-format", "json", "--log-interval", str(opts.cli_log_interval),
        "--no-save", "--disable-validation",
    ]  # fmt: skip
    import torch

    # fairseq-train takes its intra-op threads from the environment: the same count as in-process
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"fairseq-train failed for {cfg.name}:\n{' '.join(argv)}\n{output[-4000:]}")
    wps = [float(json.loads(m)["wps"]) for m in re.findall(r"\| train_inner \| (\{.*\})", output)]
    if len(wps) < 2:
        raise SystemExit(f"fairseq-train logged {len(wps)} train_inner lines for {cfg.name}; raise --cli-updates")
    return {"wps": statistics.median(wps[1:]), "peak_rss_mib": usage.ru_maxrss / 1024}


def cli_shape(shape: Shape, configs: Sequence[Config], data: Path, opts) -> dict:
    names = [c.name for c in configs]
    tps: Dict[str, List[float]] = {n: [] for n in names}
    ratios: Dict[str, List[float]] = {n: [] for n in names}
    rss: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(opts.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        this_round = {}
        for name in order:
            res = cli_run(CONFIGS[name], shape, data, opts)
            this_round[name] = res["wps"]
            rss[name].append(res["peak_rss_mib"])
        for cfg in configs:
            tps[cfg.name].append(this_round[cfg.name])
            if cfg.ref in this_round:
                ratios[cfg.name].append(this_round[cfg.name] / this_round[cfg.ref])
        if opts.verbose:
            print(f"  cli round {r + 1}/{opts.repeats}: " + ", ".join(f"{n} {this_round[n]:.0f}" for n in names))
    out = {
        n: {"tokens_per_s": tps[n], "ratio_to_ref": ratios[n], "peak_rss_mib": statistics.median(rss[n])} for n in names
    }
    for num, den, _ in NORM_COMPARISONS:
        if num in tps and den in tps:
            out[num][f"ratio_to_{den}"] = [a / b for a, b in zip(tps[num], tps[den], strict=True)]
    return out


# ---------------------------------------------------------------------------------------------
# report


def spread(values: Sequence[float], fmt: str) -> str:
    return f"{fmt.format(min(values))}-{fmt.format(max(values))}" if values else "n/a"


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _ratio_text(row: dict, key: str) -> str:
    """``0.995 [0.981-1.010]`` for the paired ratios under ``key`` (median [min-max])."""
    values = row.get(key) or []
    return f"{median(values):.3f} [{spread(values, '{:.3f}')}]" if values else "n/a"


def verdicts(results: dict) -> List[str]:
    """Targets on the median paired wall-clock ratios: init-only >= 0.98x stock, ScaleNorm >= LayerNorm.

    The CPU-time ratio is printed beside it: on a shared machine it is the steadier of the two.
    """
    lines = []
    for shape, rows in results["shapes"].items():
        checks = [(name, CONFIGS[name].ref, "", INIT_ONLY_TARGET) for name in rows if CONFIGS[name].init_only]
        checks += [(num, den, f"_to_{den}", target) for num, den, target in NORM_COMPARISONS if num in rows]
        for name, ref, suffix, target in checks:
            row = rows[name]
            wall_key = f"ratio{suffix}" if suffix else "ratio_to_ref"
            if not row.get(wall_key):
                continue
            med = median(row[wall_key])
            text = f"{shape} {name} vs {ref}: wall {_ratio_text(row, wall_key)}"
            cpu_key = f"cpu_{wall_key}"
            if row.get(cpu_key):
                text += f", CPU time {_ratio_text(row, cpu_key)}"
            if target is not None:
                text += f"; target >= {target:.2f}: {'MET' if med >= target else 'MISSED'}"
            lines.append(text)
    return lines


def markdown(results: dict) -> str:
    meta = results["meta"]
    inprocess = meta["mode"] == "inprocess"
    cpu_cols = inprocess and meta["device"] == "cpu"
    if inprocess:
        how = f"in-process timing, {meta['steps']} steps per trial"
    else:
        how = (
            f"fairseq-train timing, --max-update {meta['cli_updates']}, median wps of the train_inner lines "
            f"(--log-interval {meta['cli_log_interval']}, the first dropped)"
        )
    out = [
        f"{meta['device_name']}, {meta['threads']} torch thread(s), {meta['precision']}; {how}, --max-tokens "
        f"{meta['max_tokens']}, {meta['repeats']} interleaved rounds; torch {meta['torch']}, fairseq "
        f"{meta['fairseq']}; {meta['date']}.",
        f"Command: `{meta['command']}`",
        "",
        "tok/s: target tokens per second (fairseq's wps), median over rounds [min-max]. x ref: median of the "
        "per-round ratios to the stock `transformer` at the same norm position (the `ref` column) [min-max]"
        + ("; CPU: the same ratio over process CPU time, insensitive to other processes." if cpu_cols else ".")
        + (" Peak: memory growth while building and training the model." if inprocess else " Peak: process RSS."),
        "",
    ]
    for shape, rows in results["shapes"].items():
        head = "| config | what | ref | params | tok/s | x ref (wall) |"
        rule = "|---|---|---|---:|---:|---:|"
        if cpu_cols:
            head, rule = head + " x ref (CPU) |", rule + "---:|"
        head += " peak MiB | mem x ref |"
        rule += "---:|---:|"
        out += [f"**{shape}** (layers x d x FFN x heads, encoder and decoder)", "", head, rule]
        for name, row in rows.items():
            cfg = CONFIGS[name]
            mem = row.get("peak_mib", row.get("peak_rss_mib"))
            ref_row = rows.get(cfg.ref, {})
            ref_mem = ref_row.get("peak_mib", ref_row.get("peak_rss_mib"))
            params = f"{row['params'] / 1e6:.2f}M" if "params" in row else "n/a"
            tps = row["tokens_per_s"]
            cells = [
                name,
                cfg.what,
                "-" if cfg.ref == name else cfg.ref,
                params,
                f"{median(tps):.0f} [{spread(tps, '{:.0f}')}]",
                _ratio_text(row, "ratio_to_ref"),
            ]
            if cpu_cols:
                cells.append(_ratio_text(row, "cpu_ratio_to_ref"))
            cells.append("n/a" if mem is None else f"{mem:.0f}")
            cells.append("n/a" if mem is None or not ref_mem else f"{mem / ref_mem:.2f}")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    out += ["Targets (median paired ratios, wall clock):", ""] + [f"- {line}" for line in verdicts(results)]
    return "\n".join(out)


def fairseq_version() -> str:
    try:
        from importlib.metadata import version

        return version("ve-fairseq")
    except Exception:  # noqa: BLE001  (any packaging oddity: the version is informative only)
        import fairseq

        return getattr(fairseq, "__version__", "unknown")


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    try:
        out = subprocess.run(["lscpu"], stdout=subprocess.PIPE, text=True).stdout
        model = re.search(r"Model name:\s*(.+)", out)
        return f"{model.group(1).strip() if model else platform.processor()}, {os.cpu_count()} cores"
    except OSError:
        return f"{platform.processor()}, {os.cpu_count()} cores"


# ---------------------------------------------------------------------------------------------
# command line


def parse_args(argv: Sequence[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny shape, few configs/steps, 2000 sentences")
    p.add_argument(
        "--mode", choices=("inprocess", "cli"), default="inprocess", help="in-process timing, or time fairseq-train"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--fp16", action="store_true", help="fairseq --fp16 (CUDA only)")
    p.add_argument("--amp", action="store_true", help="fairseq --amp (CUDA only)")
    p.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: OMP_NUM_THREADS or torch's)"
    )
    p.add_argument(
        "--shapes", type=Shape.parse, nargs="+", help="LAYERSxDIMxFFNxHEADS (default 6x256x1024x4 18x128x512x4)"
    )
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), help="configurations (default: all)")
    p.add_argument("--max-tokens", type=int, help="tokens per batch (default 1024; quick 512)")
    p.add_argument("--batches", type=int, help="distinct fixed batches (default 2; quick 2)")
    p.add_argument("--steps", type=int, help="training steps per timed trial (default 2; quick 2)")
    p.add_argument("--repeats", type=int, help="interleaved rounds (default 5; quick 2)")
    p.add_argument("--warmup", type=int, help="untimed steps per configuration first (default 2; quick 1)")
    p.add_argument("--memory-steps", type=int, default=2, help="training steps while measuring peak memory")
    p.add_argument("--no-memory", action="store_true", help="CPU: skip the peak-memory measurement (forked children)")
    p.add_argument("--cli-updates", type=int, default=40, help="--mode cli: --max-update of every fairseq-train run")
    p.add_argument("--cli-log-interval", type=int, default=10, help="--mode cli: --log-interval")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--multi30k", type=Path, default=DEFAULT_MULTI30K, help="folder with train.{de,en}.gz")
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK, help="where the binarised corpus is cached")
    p.add_argument("--train-sentences", type=int, help="sentences to binarise (default all 29000; quick 2000)")
    p.add_argument("--json", type=Path, help="also write every measurement as JSON here")
    p.add_argument("--markdown", type=Path, help="also write the markdown table here")
    p.add_argument("--verbose", action="store_true", help="print every round's tokens/s")
    opts = p.parse_args(argv)
    opts.passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]

    quick = opts.quick
    defaults = dict(max_tokens=(512, 1024), batches=(2, 2), steps=(2, 2), repeats=(2, 5), warmup=(1, 2))
    for key, (q, full) in defaults.items():
        if getattr(opts, key) is None:
            setattr(opts, key, q if quick else full)
    if opts.train_sentences is None:
        opts.train_sentences = 2000 if quick else None
    opts.shapes = opts.shapes or list(QUICK_SHAPES if quick else FULL_SHAPES)
    names = opts.configs or (QUICK_CONFIGS if quick else tuple(CONFIGS))
    if opts.mode == "cli" and quick:
        opts.cli_updates, opts.cli_log_interval = 6, 2
    # the references of every chosen configuration are always measured, first
    refs = [CONFIGS[n].ref for n in names]
    for num, den, _ in NORM_COMPARISONS:
        if num in names:
            refs.append(den)
    ordered = list(dict.fromkeys([*refs, *names]))
    opts.configs = [CONFIGS[n] for n in sorted(ordered, key=list(CONFIGS).index)]

    if (opts.fp16 or opts.amp) and opts.device != "cuda":
        p.error("--fp16/--amp need --device cuda (fairseq has no CPU half-precision training)")
    if opts.fp16 and opts.amp:
        p.error("choose one of --fp16 and --amp")
    for key in ("max_tokens", "batches", "steps", "repeats", "memory_steps"):
        if getattr(opts, key) <= 0:
            p.error(f"--{key.replace('_', '-')} must be positive")
    if opts.warmup < 0:
        p.error("--warmup must be >= 0")
    return opts


def main(argv: Sequence[str] | None = None) -> dict:
    opts = parse_args(argv)
    import logging

    logging.disable(logging.WARNING)  # fairseq's per-model INFO lines would drown the table
    warnings.filterwarnings("ignore")  # hydra/torch deprecation notices, once per model built
    import torch

    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch")
    import fairseq_deepinit

    if not Path(fairseq_deepinit.__file__).resolve().is_relative_to(REPO):
        raise SystemExit(f"imported {fairseq_deepinit.__file__}, not this checkout's package; run from {REPO}")

    size = "all" if opts.train_sentences is None else str(opts.train_sentences)
    data = binarize_multi30k(opts.multi30k, opts.work_dir / f"multi30k-de-en-word-{size}", opts.train_sentences)
    precision = "fp16" if opts.fp16 else "amp" if opts.amp else "fp32"
    results = {
        "meta": {
            "date": datetime.date.today().isoformat(),
            "mode": opts.mode,
            "device": opts.device,
            "device_name": device_name(opts.device),
            "threads": torch.get_num_threads(),
            "precision": precision,
            "max_tokens": opts.max_tokens,
            "batches": opts.batches,
            "steps": opts.steps,
            "repeats": opts.repeats,
            "warmup": opts.warmup,
            "cli_updates": opts.cli_updates,
            "cli_log_interval": opts.cli_log_interval,
            "torch": torch.__version__,
            "fairseq": fairseq_version(),
            "python": platform.python_version(),
            "command": " ".join(["benchmarks/throughput.py", *opts.passthrough]),
            "data": str(data),
        },
        "shapes": {},
    }
    if opts.mode == "cli":
        for shape in opts.shapes:
            print(f"timing fairseq-train for {len(opts.configs)} configurations at {shape} ...", file=sys.stderr)
            results["shapes"][str(shape)] = cli_shape(shape, opts.configs, data, opts)
    else:
        import torch._dynamo  # noqa: F401  (torch.optim imports it lazily: once here, not in every fork)
        from fairseq import tasks

        # parse every configuration up front (fairseq's argparse -> omegaconf is slow; done once)
        plans = {
            shape: {c.name: (c, fairseq_config(data, c, shape, opts)) for c in opts.configs} for shape in opts.shapes
        }
        task = tasks.setup_task(next(iter(plans[opts.shapes[0]].values()))[1].task)
        batches = fixed_batches(task, opts, opts.batches)
        memory: Dict[Shape, Dict[str, float]] = {}
        if opts.device == "cpu" and not opts.no_memory:
            # all forks before the parent builds a model or runs a multi-threaded op
            print(f"measuring peak memory of {len(opts.configs)} configurations ...", file=sys.stderr, flush=True)
            for shape, plan in plans.items():
                memory[shape] = {n: cpu_peak_memory(c, f, task, batches, opts) for n, (c, f) in plan.items()}
        batches = to_device(batches, opts.device)
        for shape, plan in plans.items():
            print(f"timing {len(plan)} configurations at {shape} ...", file=sys.stderr, flush=True)
            rows = time_shape(plan, task, batches, opts)
            for name, mib in memory.get(shape, {}).items():
                rows[name]["peak_mib"] = mib
            results["shapes"][str(shape)] = rows
    table = markdown(results)
    print(table)
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=1))
    if opts.markdown:
        opts.markdown.write_text(table + "\n")
    return results


if __name__ == "__main__":
    main()
