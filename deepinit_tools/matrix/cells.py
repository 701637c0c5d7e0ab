"""The early-training study's cells (``multi30k_matrix.py matrix``): names, budgets, the fairseq-train
command, and the analysis of a finished cell. The log parsing and the status rules (diverged / stalled /
source-blind / converging) are the plugin's, shared with ``deepinit-compare``
(:mod:`fairseq_deepinit.compare.verdict`), and so is the child-process runner
(:func:`fairseq_deepinit.compare.process.run_logged`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Sequence

from deepinit_tools import fairseq_argv as fa
from deepinit_tools.matrix.common import (
    METHODS,
    MatrixError,
    cell_dir,
    cell_name,
    log,
    parse_cell,
)
from deepinit_tools.matrix.decode import probe_cell
from deepinit_tools.paths import REPO
from fairseq_deepinit.compare.process import run_logged
from fairseq_deepinit.compare.verdict import BLIND_FRACTION, PLATEAU_BITS, classify, gnorm_profile, last_line, parse_log


def budget_of(spec: str, depth: int) -> tuple:
    """(updates, validation interval) of ``depth`` in a ``DEPTH:UPDATES:VALID_EVERY,...`` spec."""
    for item in spec.split(","):
        parts = item.split(":")
        if len(parts) != 3 or not all(x.isdigit() for x in parts):
            raise MatrixError(f"--budget item {item!r} is not DEPTH:UPDATES:VALID_EVERY (e.g. 18:250:25)")
        if int(parts[0]) == depth:
            return int(parts[1]), int(parts[2])
    raise MatrixError(f"--budget {spec!r} has no entry for depth {depth}; add {depth}:UPDATES:VALID_EVERY")


def train_command(bin_dir: Path, save_dir: Path, name: str, a: argparse.Namespace) -> List[str]:
    """The exact fairseq-train command line of a cell."""
    method, depth, regime = parse_cell(name)
    cmd = fa.command("train", bin_dir, *fa.dims(depth, a.dim, a.ffn, a.heads))
    cmd += ["--dropout", str(a.dropout), "--share-decoder-input-output-embed"]
    cmd += ["--criterion", "label_smoothed_cross_entropy_diagnostics", "--label-smoothing", "0.1"]
    updates, every = budget_of(a.budget, depth)
    cmd += ["--diagnostics-interval", str(every), "--diagnostics-stats", "grad"]
    cmd += [*fa.adam_for(method), "--weight-decay", "0.0001"]
    if regime == "warmup":
        cmd += ["--lr", str(a.lr), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(a.warmup)]
        cmd += ["--warmup-init-lr", "1e-07"]
    else:
        cmd += ["--lr", str(a.lr_nowarmup), "--lr-scheduler", "tfixup"]
    cmd += ["--max-tokens", str(a.max_tokens), "--max-update", str(updates), "--seed", str(a.seed)]
    cmd += ["--validate-interval-updates", str(every), "--save-interval-updates", str(every)]
    cmd += ["--keep-interval-updates", "1", "--no-epoch-checkpoints", "--no-last-checkpoints"]
    cmd += ["--save-dir", str(save_dir), "--cpu", "--num-workers", "0"]
    cmd += ["--log-format", "json", "--log-interval", str(every)]
    # the method's flags after the set-up's, so that a method may set a width (SwiGLU at equal parameters) or
    # the optimizer (Muon, whose AdamW part takes the set-up's --adam-betas)
    return cmd + METHODS[method][1] + shlex.split(a.extra_args)


def unigram_bits(bin_dir: Path, valid_target: Path) -> float:
    """Cross-entropy (bits/token, end of sentence included) of the dev targets under the training
    set's unigram distribution: what a model that ignores the source and the prefix achieves."""
    counts = {}
    with open(bin_dir / "dict.en.txt", encoding="utf-8") as f:
        for line in f:
            word, count = line.split()[:2]
            if int(count) > 0:
                counts[word] = int(count)
    with open(bin_dir.parent / "raw" / "train.en", encoding="utf-8") as f:
        counts["</s>"] = sum(1 for _ in f)
    total = sum(counts.values())
    bits = n = 0
    with open(valid_target, encoding="utf-8") as f:
        for line in f:
            for tok in line.split() + ["</s>"]:
                bits -= math.log2(counts.get(tok, 1) / total)
                n += 1
    return bits / n


@dataclass(frozen=True)
class Rules:
    """How a finished cell is judged (``classify``): stall threshold (None: the unigram model's),
    plateau gain and the per-depth dev-nll targets (``DEPTH:BITS,...``)."""

    stall_bits: float | None
    target_spec: str
    plateau_bits: float = PLATEAU_BITS
    blind_fraction: float = BLIND_FRACTION

    @classmethod
    def of(cls, a: argparse.Namespace) -> Rules:
        return cls(a.stall_bits, a.target_bits, a.plateau_bits, a.blind_fraction)

    def for_work(self, work: Path) -> Rules:
        """These rules with the stall threshold filled in: the unigram model of ``work``'s data,
        computed once per report, not once per cell."""
        if self.stall_bits is not None:
            return self
        return replace(self, stall_bits=unigram_bits(work / "bin", work / f"bpe{merges_of(work)}" / "valid.en"))


def train_cell(bin_dir: Path, work: Path, name: str, a: argparse.Namespace) -> dict:
    """Train one cell (skipped when its ``result.json`` exists); returns its analysed result."""
    out = cell_dir(work, name)
    result_path = out / "result.json"
    if not result_path.exists():
        out.mkdir(parents=True, exist_ok=True)
        cmd = train_command(bin_dir, out, name, a)
        threads = str(a.threads)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
        log(f"train {name}")
        (out / "train.log").unlink(missing_ok=True)  # a cell killed before its result.json starts again
        done = run_logged(cmd, out / "train.log", env, cwd=REPO)
        method, depth, regime = parse_cell(name)
        record = dict(
            cell=name,
            method=method,
            depth=depth,
            regime=regime,
            returncode=done.returncode,
            wall_s=done.wall_s,
            command=fa.printable(cmd),
            settings={
                **{k: getattr(a, k) for k in ("dim", "ffn", "heads", "lr", "lr_nowarmup", "warmup", "max_tokens")},
                "seed": a.seed,
                "updates": budget_of(a.budget, depth)[0],
            },
        )
        result_path.write_text(json.dumps(record, indent=1))
    if (out / "checkpoint_best.pt").exists() and not (out / "probe.json").exists():
        probe_cell(bin_dir, work, name, a.threads)
    r = analyse(out, Rules.of(a).for_work(work))
    log(f"{name}: {r['status']}, best dev nll {r['best_dev_nll']}, {r['wall_s']:.0f}s")
    return r


def analyse(out: Path, rules: Rules) -> dict:
    """A finished cell's record (``result.json``) plus what its training log says (status, dev
    curve, per-layer gradient norms); the log is the source of truth, re-read every time.
    ``rules`` must be resolved (:meth:`Rules.for_work`)."""
    r = json.loads((out / "result.json").read_text())
    text = (out / "train.log").read_text(encoding="utf-8")
    parsed = parse_log(text)
    target_bits = target_of(rules.target_spec, r["depth"])
    probe = json.loads((out / "probe.json").read_text()) if (out / "probe.json").exists() else None
    status = classify(
        parsed, r["returncode"], rules.stall_bits, target_bits, rules.plateau_bits, probe, rules.blind_fraction
    )
    r.update(status, probe=probe)
    r.update(
        stall_bits=rules.stall_bits,
        target_bits=target_bits,
        valid=parsed["valid"],
        updates_done=max((int(float(t["num_updates"])) for t in parsed["train"]), default=0),
        gnorm_layers=gnorm_profile(parsed["train"]),
        error=parsed["error"] or (None if r["returncode"] == 0 else last_line(text)),
    )
    return r


def merges_of(work: Path) -> str:
    found = sorted(p.name[3:] for p in work.glob("bpe*") if p.is_dir())
    if not found:
        raise MatrixError(f"no BPE folder under {work}: run `prepare` first")
    return found[0]


def target_of(spec: str, depth: int) -> float | None:
    """The dev-nll target (bits/token) of ``depth`` in a ``DEPTH:BITS,...`` spec (None if absent)."""
    for item in spec.split(","):
        d, _, bits = item.partition(":")
        try:
            if int(d) == depth:
                return float(bits)
        except ValueError:
            raise MatrixError(f"--target-bits item {item!r} is not DEPTH:BITS (e.g. 18:6.0)") from None
    return None


def expand(methods: Sequence[str], depths: Sequence[int], regimes: Sequence[str]) -> List[str]:
    return [cell_name(m, d, r) for d in depths for m in methods for r in regimes]
