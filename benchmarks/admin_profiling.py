#!/usr/bin/env python
"""What Admin's in-training profiling costs, as a share of one training epoch on Multi30k de-en.

One ``fairseq-train --task translation_admin`` run on the real Multi30k de-en training set (read
in place from ``../shared/data/multi30k``, gzip and all) trains exactly one epoch; the task logs
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

import argparse
import datetime
import gzip
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
USER_DIR = str(REPO / "fairseq_deepinit")
DEFAULT_MULTI30K = Path(os.environ.get("MULTI30K_DIR", REPO.parent / "shared" / "data" / "multi30k"))


def tokenize(line: str) -> str:
    return " ".join(re.findall(r"\w+|[^\w\s]", line.lower()))


def binarize(raw_dir: Path, dest: Path) -> Path:
    """Multi30k de-en train and val, word level, min count 2, binarised into ``dest`` (once)."""
    stamp = dest / "STAMP.json"
    want = {"raw": str(raw_dir.resolve()), "tokenizer": "words+punct, lower", "threshold": 2}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    for split, name in (("train", "train"), ("val", "valid")):
        for lang in ("de", "en"):
            src = raw_dir / f"{split}.{lang}.gz"
            if not src.exists():
                raise SystemExit(f"Multi30k not found: {src} is missing; pass --multi30k DIR")
            with gzip.open(src, "rt", encoding="utf-8") as f:
                (dest / f"{name}.tok.{lang}").write_text("".join(tokenize(x) + "\n" for x in f), encoding="utf-8")
    cmd = [sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "de", "--target-lang", "en",
           "--trainpref", str(dest / "train.tok"), "--validpref", str(dest / "valid.tok"), "--destdir", str(dest),
           "--thresholdsrc", "2", "--thresholdtgt", "2", "--workers", "2"]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for tok in dest.glob("*.tok.*"):
        tok.unlink()  # never keep a text copy of the corpus
    stamp.write_text(json.dumps(want))
    return dest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--multi30k", type=Path, default=DEFAULT_MULTI30K)
    p.add_argument("--work-dir", type=Path, default=REPO / "work-data" / "admin-bench")
    p.add_argument("--arch", default="admin_iwslt_de_en")
    p.add_argument("--layers", type=int, default=6, help="encoder and decoder layers (default 6)")
    p.add_argument("--dim", type=int, default=256, help="model dimension (default 256; FFN 4x)")
    p.add_argument("--max-tokens", type=int, default=4096, help="training batch (default 4096, Admin's IWSLT recipe)")
    p.add_argument("--max-update", type=int, default=0, help="stop early (smoke run); 0 = the whole epoch")
    p.add_argument("--json", type=Path, help="also write the numbers here")
    a = p.parse_args(argv)

    data = binarize(a.multi30k, a.work_dir / "bin")
    d = str(a.dim)
    cmd = [
        sys.executable, "-m", "fairseq_cli.train", str(data), "--user-dir", USER_DIR, "--task", "translation_admin",
        "-s", "de", "-t", "en", "--arch", a.arch, "--encoder-layers", str(a.layers), "--decoder-layers",
        str(a.layers), "--encoder-embed-dim", d, "--decoder-embed-dim", d, "--encoder-ffn-embed-dim", str(4 * a.dim),
        "--decoder-ffn-embed-dim", str(4 * a.dim), "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
        "--share-decoder-input-output-embed", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "7e-4",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "6000", "--dropout", "0.3", "--weight-decay", "1e-4",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", str(a.max_tokens),
        "--max-epoch", "1", "--disable-validation", "--no-save", "--cpu", "--num-workers", "0", "--seed", "1",
        "--log-format", "simple", "--log-interval", "20",
    ]  # fmt: skip
    if a.max_update:
        cmd += ["--max-update", str(a.max_update)]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(cmd, env=env, cwd=a.work_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = proc.stdout
    if proc.returncode:
        print(log[-4000:], file=sys.stderr)
        return proc.returncode
    prof = re.search(r"admin: omega from profiling .*?, ([\d.]+) s\)", log)
    done = re.search(r"done training in ([\d.]+) seconds", log)
    updates = re.findall(r"\| train \| epoch 001 \|.*?num_updates (\d+)", log)
    shape = re.search(r"admin: profiling batch cut to (\d+) sentences", log)
    if not (prof and done and updates):
        print(log[-4000:], file=sys.stderr)
        raise SystemExit("could not find the profiling time, the epoch time or the update count in the log")
    t_prof, t_epoch, n = float(prof.group(1)), float(done.group(1)), int(updates[-1])
    import torch

    result = {
        "date": datetime.date.today().isoformat(),
        "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores visible, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, torch {torch.__version__}",
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
    print(f"{result['hardware']}; {result['date']}")
    print()
    print("| | seconds | share of the epoch |")
    print("|---|---:|---:|")
    print(f"| profiling: 1 forward pass on the first batch | {t_prof:.3f} | {100 * t_prof / t_epoch:.3f}% |")
    print(f"| training: {epoch}, {n} updates | {t_epoch:.1f} | 100% |")
    print(f"| one update (mean) | {t_epoch / n:.3f} | {100 / n:.3f}% |")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
