#!/usr/bin/env python
"""What Admin's in-training profiling costs, as a share of one training epoch on Multi30k de-en.

One ``fairseq-train --task translation_admin`` run on the real Multi30k de-en training set (read
in place from ``--multi30k``, gzip and all) trains exactly one epoch; the task logs
how long profiling took (one extra forward pass without gradients on the first batch, cut to
``--admin-profile-max-tokens``, paper default 8192) and fairseq logs how long the epoch took. Both
numbers come from the same process and are printed side by side with their ratio (goal: < 1%).

The text is lower-cased and split into words and punctuation marks, then binarised once with
fairseq-preprocess (min count 2) into ``work-data/admin-bench/`` (git-ignored; ``--work-dir``);
the tokenised copy is deleted again after binarisation.

Usage::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/admin_profiling.py              # full epoch
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/admin_profiling.py --max-update 5  # smoke run
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from deepinit_tools import fairseq_argv as fa
from deepinit_tools import harness
from deepinit_tools.harness.fairseq_tools import run_tool
from deepinit_tools.multi30k import DEFAULT_MULTI30K, binarize_multi30k

# the plugin is reached only through fairseq's --user-dir (its one place in this script)
from deepinit_tools.paths import REPO, USER_DIR


def build_parser() -> harness.Parser:
    """Every option of admin_profiling.py, with its help and default."""
    p = harness.Parser(prog="admin_profiling.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--multi30k", type=Path, default=DEFAULT_MULTI30K, help="folder with Multi30k's *.gz (env MULTI30K_DIR)"
    )
    p.add_argument("--work-dir", type=Path, default=REPO / "work-data" / "admin-bench", help="binarised data and logs")
    p.add_argument("--arch", default="admin_iwslt_de_en", help="the plugin's Admin architecture")
    p.add_argument("--layers", type=harness.positive_int, default=6, help="encoder and decoder layers")
    p.add_argument("--dim", type=harness.positive_int, default=256, help="model dimension (FFN 4x)")
    p.add_argument(
        "--max-tokens", type=harness.positive_int, default=4096, help="training batch (Admin's IWSLT recipe)"
    )
    p.add_argument(
        "--max-update", type=harness.nonnegative_int, default=0, help="stop early (smoke run); 0 = the whole epoch"
    )
    p.add_argument("--json", type=Path, help="also write the numbers here")
    return p


def main(argv=None) -> int:
    """Train one epoch (or ``--max-update`` updates), print profiling time against epoch time."""
    a = build_parser().parse_args(argv)
    data = binarize_multi30k(a.multi30k, a.work_dir / "bin", {"train": ("train", None), "valid": ("val", None)})
    cmd = [
        str(data), "--user-dir", USER_DIR, "--task", "translation_admin",
        "-s", "de", "-t", "en", "--arch", a.arch, *fa.dims(a.layers, a.dim, 4 * a.dim, 4),
        "--share-decoder-input-output-embed", *fa.ADAM, "--lr", "7e-4",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "6000", "--dropout", "0.3", "--weight-decay", "1e-4",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", str(a.max_tokens),
        "--max-epoch", "1", "--disable-validation", "--no-save", "--cpu", "--num-workers", "0", "--seed", "1",
        "--log-format", "simple", "--log-interval", "20",
    ]  # fmt: skip
    if a.max_update:
        cmd += ["--max-update", str(a.max_update)]
    a.work_dir.mkdir(parents=True, exist_ok=True)
    log = run_tool("train", cmd, cwd=a.work_dir).output
    prof = re.search(r"admin: omega from profiling .*?, ([\d.]+) s\)", log)
    done = re.search(r"done training in ([\d.]+) seconds", log)
    updates = re.findall(r"\| train \| epoch 001 \|.*?num_updates (\d+)", log)
    shape = re.search(r"admin: profiling batch cut to (\d+) sentences", log)
    if not (prof and done and updates):
        print(log[-4000:], file=sys.stderr)
        raise SystemExit("could not find the profiling time, the epoch time or the update count in the log")
    t_prof, t_epoch, n = float(prof.group(1)), float(done.group(1)), int(updates[-1])
    meta = harness.environment("cpu", "admin_profiling.py", argv)
    result = {
        "date": meta["date"],
        "hardware": meta["device_name"],
        "model": f"{a.arch} {a.layers}+{a.layers} layers, d={a.dim}, FFN {4 * a.dim}, 4 heads",
        "max_tokens": a.max_tokens,
        "profiling_seconds": t_prof,
        "epoch_seconds": t_epoch,
        "updates": n,
        "whole_epoch": not a.max_update,
        "share": t_prof / t_epoch,
        "profile_batch_cut": bool(shape),
    }
    epoch = "one epoch" if not a.max_update else "smoke run, not a whole epoch"
    print(f"Admin profiling cost on Multi30k de-en ({result['model']}, --max-tokens {a.max_tokens})")
    print(harness.provenance(meta))
    print()
    rows = [
        ["profiling: 1 forward pass on the first batch", f"{t_prof:.3f}", f"{100 * t_prof / t_epoch:.3f}%"],
        [f"training: {epoch}, {n} updates", f"{t_epoch:.1f}", "100%"],
        ["one update (mean)", f"{t_epoch / n:.3f}", f"{100 / n:.3f}%"],
    ]
    print(harness.markdown_table(["", "seconds", "share of the epoch"], rows, right=(1, 2)))
    harness.write_json(a.json, result, meta)
    return 0
