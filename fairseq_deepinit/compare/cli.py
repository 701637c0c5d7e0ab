"""``deepinit-compare``: which deep-Transformer method trains on *your* data, at *your* depth and settings.

::

    deepinit-compare DATA-BIN --depth N [--methods a,b,c] [--max-update U] [--valid-every V]
        [--budget-min M] [--jobs J] [--size iwslt_de_en] --out DIR -- <fairseq-train arguments>

For each candidate (:mod:`.candidates`; default :data:`.candidates.DEFAULT`) it trains a real
``fairseq-train`` on DATA-BIN at depth N with the user's arguments (:mod:`.command`), the divergence guard
on and a validation every V updates, ``--jobs`` at a time; then ranks them (:mod:`.report`) and writes
``DIR/summary.json``, ``DIR/report.md``, ``DIR/valid_loss.png`` and ``DIR/grad_norm.png``. A second call
with the same configuration continues: finished candidates are not rerun, interrupted ones resume from
their ``checkpoint_last.pt`` (:mod:`.runner`). Statuses: :mod:`.verdict`; docs/compare.md.

Bad input (a missing data-bin, an unknown method, ``--depth`` < 1, an ``--out`` holding a comparison of
another configuration, an option the tool sets itself among the fairseq-train arguments) ends the command
with one line, ``deepinit-compare: error: ...``, and exit status 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import List, Sequence, Tuple

from ..errors import DeepInitConfigError
from . import candidates as cands
from . import plots, report, runner
from .command import Setting, check_user_args
from .process import cpu_name

PROG = "deepinit-compare"
CONFIG = "config.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train several deep-Transformer methods briefly on your data-bin with your fairseq-train "
        "arguments and rank them (docs/compare.md).",
        epilog="Everything after `--` is passed to every fairseq-train (width, batch, lr, warm-up, precision, "
        "--cpu ...).",
    )
    p.add_argument("data", type=Path, help="a fairseq-preprocess output folder (translation or language model)")
    p.add_argument("--depth", type=int, required=True, help="layers per stack (encoder and decoder, or the LM's)")
    p.add_argument(
        "--methods",
        default=",".join(cands.DEFAULT),
        help=f"comma-separated candidates (default: {','.join(cands.DEFAULT)}; known: {', '.join(cands.CANDIDATES)})",
    )
    p.add_argument("--max-update", type=int, default=150, help="updates per candidate (default: 150)")
    p.add_argument("--valid-every", type=int, default=None, help="validate every V updates (default: max-update/6)")
    p.add_argument(
        "--budget-min",
        type=float,
        default=None,
        help="stop training M minutes after the start; the next call continues (default: no limit)",
    )
    p.add_argument("--jobs", type=int, default=1, help="candidates trained at once (default: 1)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per job (default: cores / jobs)")
    p.add_argument(
        "--size",
        default=None,
        help="the --arch size of every candidate: <family>_<size> (default: iwslt_de_en for translation, lm for a "
        "language model); the fairseq-train arguments override its dimensions",
    )
    p.add_argument("--out", type=Path, required=True, help="the comparison's folder (created; reused to resume)")
    return p


def split_argv(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def device_name(cpu: bool) -> str:
    """The CPU model (/proc/cpuinfo) and core count, or the first GPU's name."""
    if not cpu:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
    return cpu_name()


def configuration(a: argparse.Namespace, fairseq_args: Sequence[str], task: cands.Task, size: str) -> dict:
    """What makes two calls the same comparison (the methods may differ: new ones are added)."""
    return {
        "data": str(a.data.resolve()),
        "depth": a.depth,
        "max_update": a.max_update,
        "valid_every": a.valid_every,
        "size": size,
        "task": task.kind,
        "fairseq_args": list(fairseq_args),
    }


def check_out(out: Path, config: dict) -> None:
    """Create ``out`` with ``config.json``, or check that it holds a comparison of ``config``."""
    path = out / CONFIG
    if out.exists() and not out.is_dir():
        raise DeepInitConfigError(f"--out {out} is a file; give a folder")
    if path.exists():
        old = json.loads(path.read_text())
        diff = [k for k in config if old.get(k) != config[k]]
        if diff:
            raise DeepInitConfigError(
                f"--out {out} holds a comparison with another {', '.join(diff)} ({CONFIG}); give a new --out, or "
                f"the same settings to continue it"
            )
        return
    if out.exists() and any(out.iterdir()):
        raise DeepInitConfigError(f"--out {out} is not empty and holds no {CONFIG}; give a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1))


def slot_env(cpu: bool, jobs: int, threads: int | None):
    """(threads, GPU) of each running slot: on the CPU the cores divided among the jobs; on GPUs one
    visible device per slot, round robin (the user's CUDA_VISIBLE_DEVICES kept when one job runs)."""
    if cpu:
        n = threads or max(1, (os.cpu_count() or 1) // jobs)
        return lambda slot: (n, None)
    if jobs == 1:
        return lambda slot: (threads, None)
    import torch

    gpus = max(1, torch.cuda.device_count())
    return lambda slot: (threads, slot % gpus)


def main(argv: Sequence[str] | None = None) -> int:
    own, fairseq_args = split_argv(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(own)
    try:
        names = cands.parse_methods(a.methods)
        if a.depth < 1:
            raise DeepInitConfigError(f"--depth {a.depth}: give at least 1 layer per stack")
        if a.max_update < 1 or a.jobs < 1 or (a.threads is not None and a.threads < 1):
            raise DeepInitConfigError("--max-update, --jobs and --threads must be at least 1")
        if a.budget_min is not None and a.budget_min <= 0:
            raise DeepInitConfigError(f"--budget-min {a.budget_min}: give a positive number of minutes")
        a.valid_every = a.valid_every or max(1, a.max_update // 6)
        if not 1 <= a.valid_every <= a.max_update:
            raise DeepInitConfigError(
                f"--valid-every {a.valid_every}: give 1 to --max-update ({a.max_update}), or no candidate is validated"
            )
        if not a.data.is_dir():
            raise DeepInitConfigError(f"data-bin {a.data} not found; give a fairseq-preprocess output folder")
        user, task = check_user_args(fairseq_args, lambda t, s, g: cands.detect_task(a.data, t, s, g))
        size = a.size or cands.DEFAULT_SIZE[task.kind]
        cands.check_sizes(names, size)
        check_out(a.out, configuration(a, fairseq_args, task, size))
        from .unigram import unigram_bits

        stall = unigram_bits(a.data, task)
    except DeepInitConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    s = Setting(a.data.resolve(), a.depth, a.max_update, a.valid_every, size, task, user, a.out.resolve())
    deadline = time.time() + 60 * a.budget_min if a.budget_min else None
    device = device_name(user.cpu)
    runner.say(
        f"{len(names)} candidates ({', '.join(names)}) at depth {a.depth}, {a.max_update} updates, {a.jobs} at a "
        f"time on {device}; unigram threshold {stall:.3f} bits; results in {a.out}"
    )
    records = runner.run_all(names, s, stall, deadline, a.jobs, slot_env(user.cpu, a.jobs, a.threads))
    ranked = report.rank(records)
    meta = {
        "format": "deepinit-compare/1",
        "data": str(s.data),
        "task": task.kind,
        "depth": a.depth,
        "max_update": a.max_update,
        "valid_every": a.valid_every,
        "size": size,
        "user_args": shlex.join(fairseq_args),
        "stall_bits": round(stall, 4),
        "device": device,
        "jobs": a.jobs,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    stacks = ["decoder"] if task.kind == cands.LM else ["encoder", "decoder"]
    pngs = [
        plots.valid_curves(ranked, a.out / "valid_loss.png", stall).name,
        plots.gradient_profiles(ranked, a.out / "grad_norm.png", stacks).name,
    ]
    report.write_summary(a.out / "summary.json", ranked, meta)
    (a.out / "report.md").write_text(report.report_md(ranked, meta, pngs) + "\n", encoding="utf-8")
    for r in ranked:
        runner.say(
            f"#{r['rank']} {r['method']}: {r['status']}, best valid loss {report._num(r['loss_at_horizon'])}, "
            f"{r['updates']} updates" + ("" if r["finished"] else " (unfinished: run again to continue)")
        )
    runner.say(f"ranking in {a.out / 'summary.json'}, report in {a.out / 'report.md'}")
    return 0
