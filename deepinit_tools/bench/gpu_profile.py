#!/usr/bin/env python
"""What holds the GPU idle in a fairseq training step: phases and torch.profiler.

For stock fairseq fp16 and the plugin's fast paths (fp16 SDPA; bf16 SDPA with fairseq's ``adam``
and with ``adam_foreach``; that compiled) at transformer base, 6 layers, on the GPU matrix's fixed
Multi30k batches:

- **phases**: wall time per step of forward + backward (``task.train_step``) and of the update
  (``multiply_grads`` + ``clip_grad_norm`` + ``optimizer_step``), each closed by a device sync;
- **profiler**: ``torch.profiler`` over ``--steps`` steps: the GPU's kernel time against the wall
  time (busy fraction), kernel launches per step, and the top operators by device and by host time.

Writes ``--json`` (figures) and ``--text`` (the operator tables), both rewritten after every row, so a
command cut by its time limit keeps the rows it finished. ``--no-compile`` leaves out the compiled row
(its compilation takes 1-2 minutes). Usage (on the GPU machine)::

    python benchmarks/gpu_profile.py --device cuda --no-compile --json prof.json --text prof.txt
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
import time
import warnings
from pathlib import Path

from deepinit_tools import harness
from deepinit_tools.bench import gpu_matrix, throughput
from deepinit_tools.harness.fairseq_train import Variant, fixed_batches, to_device
from deepinit_tools.multi30k import DEFAULT_MULTI30K, binarize_multi30k

ROWS = (
    ("stock", Variant("fp16")),
    ("plugin", Variant("fp16", "sdpa")),
    ("plugin", Variant("bf16-autocast", "sdpa")),
    ("plugin", Variant("bf16-autocast", "sdpa", optimizer="adam_foreach")),
    ("plugin", Variant("bf16-autocast", "sdpa", compile=True, optimizer="adam_foreach")),
)


def _device_us(evt) -> float:
    """Self device time of a profiler average in microseconds (the attribute was renamed in torch 2.4)."""
    return float(getattr(evt, "self_device_time_total", getattr(evt, "self_cuda_time_total", 0.0)))


def profile_row(run, batches, steps: int, device: str) -> tuple[dict, str]:
    """Phase times and profiler figures of one built configuration."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fb, upd, wall = [], [], []
    for s in itertools.islice(itertools.cycle(batches), steps):
        sync()
        t0 = time.perf_counter()
        size, _ = run.forward_backward(s)
        sync()
        t1 = time.perf_counter()
        run.update(size)
        sync()
        t2 = time.perf_counter()
        fb.append(t1 - t0), upd.append(t2 - t1), wall.append(t2 - t0)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    sync()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        ntok = sum(run.step(s) for s in itertools.islice(itertools.cycle(batches), steps))
        sync()
    prof_wall = time.perf_counter() - t0
    avgs = prof.key_averages()
    kernel_us = sum(_device_us(e) for e in avgs if e.device_type == torch.autograd.DeviceType.CUDA)
    launches = sum(e.count for e in avgs if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    syncs = sum(e.count for e in avgs if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync"))
    fig = {
        "forward_backward_ms": 1e3 * harness.median(fb),
        "update_ms": 1e3 * harness.median(upd),
        "step_ms": 1e3 * harness.median(wall),
        "profiled_step_ms": 1e3 * prof_wall / steps,
        "gpu_kernel_ms_per_step": kernel_us / 1e3 / steps,
        "gpu_busy_fraction": (kernel_us / 1e6) / prof_wall if prof_wall else None,
        "kernel_launches_per_step": launches / steps,
        "sync_or_copy_calls_per_step": syncs / steps,
        "target_tokens_per_step": ntok / steps,
    }
    tables = [avgs.table(sort_by="self_cpu_time_total", row_limit=15)]
    if device == "cuda":
        try:  # torch >= 2.4 names the column "device"; older ones "cuda"
            tables.insert(0, avgs.table(sort_by="self_device_time_total", row_limit=25))
        except (KeyError, AttributeError):
            tables.insert(0, avgs.table(sort_by="self_cuda_time_total", row_limit=25))
    text = "\n".join(tables)
    return fig, text


def build_parser() -> harness.Parser:
    """gpu_profile.py's options (the data and batch options are throughput.py's, same defaults)."""
    pos = harness.positive_int
    p = harness.Parser(prog="gpu_profile.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to train")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 layer, d 64, 2000 sentences, 2 steps")
    p.add_argument("--max-tokens", type=pos, help="tokens per batch (default: 16384, as the GPU matrix; quick 512)")
    p.add_argument("--batches", type=pos, help="distinct fixed batches (default: 8; quick 2)")
    p.add_argument("--steps", type=pos, help="steps timed per phase and profiled (default: 10; quick 2)")
    p.add_argument("--warmup", type=harness.nonnegative_int, default=3, help="untimed steps per configuration")
    p.add_argument("--seed", type=int, default=1, help="model and batch-order seed")
    p.add_argument("--multi30k", type=Path, default=DEFAULT_MULTI30K, help="train.{de,en}.gz folder (env MULTI30K_DIR)")
    p.add_argument("--work-dir", type=Path, default=throughput.DEFAULT_WORK, help="binarised corpus cache")
    p.add_argument("--train-sentences", type=pos, help="sentences to binarise (default: all 29000; quick 2000)")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile row")
    p.add_argument("--json", type=Path, help="write the figures here (default: none)")
    p.add_argument("--text", type=Path, help="write the operator tables here (default: none)")
    return p


def main(argv: list[str] | None = None) -> None:
    opts = build_parser().parse_args(argv)
    opts.max_tokens = opts.max_tokens or (512 if opts.quick else 16384)
    opts.batches = opts.batches or (2 if opts.quick else 8)
    opts.steps = opts.steps or (2 if opts.quick else 10)
    if opts.train_sentences is None and opts.quick:
        opts.train_sentences = 2000
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    import torch

    if opts.device == "cuda" and not torch.cuda.is_available():
        harness.fail("--device cuda: no CUDA device is visible to torch")
    throughput.import_plugin()
    size = "all" if opts.train_sentences is None else str(opts.train_sentences)
    data = binarize_multi30k(opts.multi30k, opts.work_dir / f"multi30k-de-en-word-{size}",
                             {"train": ("train", opts.train_sentences)})  # fmt: skip
    builder = gpu_matrix.Builder(data, opts, throughput.CONFIGS)
    layers = 1 if opts.quick else 6
    out, texts, batches = {"device": torch.cuda.get_device_name() if opts.device == "cuda" else "cpu",
                           "torch": torch.__version__, "command": " ".join(["gpu_profile.py", *(argv or sys.argv[1:])]),
                           "finished": False, "rows": {}}, [], None  # fmt: skip
    for config, variant in ROWS:
        row = gpu_matrix.Row(config, variant, layers)
        if gpu_matrix.skip_reason(row, opts.device) or (variant.compile and opts.no_compile):
            continue
        run = None
        try:
            run = builder.build(row)
            if batches is None:
                batches = fixed_batches(builder.task(), opts.max_tokens, opts.seed, opts.batches)
                batches = to_device(batches, opts.device)
            # compile: every distinct batch once, so recompilations happen before the profile
            warm = max(opts.warmup, len(batches) if variant.compile else 0)
            for s in itertools.islice(itertools.cycle(batches), warm):
                run.step(s)
            fig, text = profile_row(run, batches, opts.steps, opts.device)
        except Exception as e:  # noqa: BLE001  (recorded, the next row runs)
            fig, text = {"note": f"{type(e).__name__}: {str(e)[:300]}"}, ""
        out["rows"][row.key] = fig
        texts.append(f"===== {row.key} =====\n{json.dumps(fig, indent=1)}\n{text}")
        print(row.key, json.dumps(fig), flush=True)
        del run
        if opts.device == "cuda":
            torch.cuda.empty_cache()
        write(opts, out, texts)
    out["finished"] = True
    write(opts, out, texts)


def write(opts, out: dict, texts: list[str]) -> None:
    """The figures and tables so far (rewritten after every row)."""
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(out, indent=1) + "\n")
    if opts.text:
        opts.text.parent.mkdir(parents=True, exist_ok=True)
        opts.text.write_text("\n".join(texts))
