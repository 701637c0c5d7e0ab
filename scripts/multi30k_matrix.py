#!/usr/bin/env python
"""Stability matrix and BLEU table of every scheme on Multi30k de-en (``docs/results.md``).

Each *cell* is one method at one depth (layers per stack) under one learning-rate regime, trained
for a fixed number of updates with fairseq-train and validated at a fixed interval:

- ``warmup``: Adam, peak ``--lr`` reached by linear warm-up over ``--warmup`` updates, then
  inverse-sqrt decay (fairseq's ``inverse_sqrt``, what every paper's baseline uses);
- ``nowarmup``: a higher ``--lr-nowarmup`` from the first update, decaying as sqrt(P / (P + t)) with
  P = 4000 (T-Fixup's warm-up-free ``tfixup`` schedule, Huang et al. 2020, sec. 4), for every method.

Deeper cells cost more per update, so ``--budget`` gives each depth its own number of updates and
validation interval (``DEPTH:UPDATES:VALID_EVERY``); updates-to-target compare within a depth.

Status of a cell, from its dev nll (bits/token) curve: *diverged* when fairseq-train stopped on a
non-finite loss or gradient (the diagnostics criterion's guard names the update and the first
layer); *stalled* when its best dev nll never got below a unigram model's (``--stall-bits``; 7.93
on Multi30k's dev set with the default BPE) or when the second half of the run improved it by less
than 0.1 bits (it stopped learning); *source-blind* when its best checkpoint, translating the dev
set greedily (``probe``), gives fewer than 5 % distinct translations (a target-side language model
only); else *converging*. "Updates to target" is the first validation
at or below the depth's ``--target-bits``. Every cell logs fairseq's per-layer gradient norms
(``diag_gnorm/*``) at each validation, which the report shows for a failing cell.

Subcommands (all resumable: a finished cell keeps its ``result.json`` and is skipped):

- ``prepare``: Multi30k read in place (gzip; ``--multi30k-dir`` / ``MULTI30K_DIR``, else the local copy,
  else the pinned public release, downloaded once: ``multi30k_data.py``) -> tokenised, joint BPE,
  binarised under the work dir;
- ``matrix``: train the cells of ``--methods x --depths x --regimes`` (``--jobs`` at a time), then probe them;
- ``probe``: greedy dev translation of given cells (``--cells all``: every trained cell not probed yet);
- ``bleu``: translate test2016 and test2017 with each given cell's best checkpoint (``--cells select``:
  the 6-layer and deepest converging cell of each method); sacreBLEU;
- ``report``: the Markdown tables of ``docs/results.md`` from the results found;
- ``converge`` and ``report --converged``: the converged matrix of issue #17 (each method trained to
  convergence in its paper's regime and a common one, on CPU or CUDA, in resumable chunks), in the
  package ``scripts/matrix/`` (``regimes.py``, ``run.py``, ``report.py``).

Cells are named ``METHOD:DEPTH:REGIME`` (``postln:18:nowarmup``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate_progress  # noqa: E402  (sentences-done lines while fairseq-generate runs)
import multi30k_data  # noqa: E402  (MULTI30K_DIR, the local copy, or the pinned public release)
import prepare_bible  # noqa: E402  (the tokeniser, BPE and scorer of the quickstart, shared)

REPO = Path(__file__).resolve().parent.parent
USER_DIR = REPO / "fairseq_deepinit"
SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr", "test1": "test_2017_flickr"}
TEST_SETS = {"test": "test2016", "test1": "test2017"}

# method -> (label in the tables, fairseq-train flags that select it)
METHODS: Dict[str, tuple] = {
    "postln": ("Post-LN", ["--arch", "postln_iwslt_de_en"]),
    "preln": ("Pre-LN", ["--arch", "preln_iwslt_de_en"]),
    "lipschitz": ("Lipschitz Post-LN", ["--arch", "lipschitz_iwslt_de_en"]),
    "tfixup": ("T-Fixup (no LN)", ["--arch", "tfixup_iwslt_de_en"]),
    "admin": ("Admin", ["--arch", "admin_iwslt_de_en", "--task", "translation_admin"]),
    "dsinit": ("DS-Init", ["--arch", "dsinit_iwslt_de_en"]),
    "dsinit_matt": ("DS-Init+MAtt", ["--arch", "dsinit_matt_iwslt_de_en"]),
    "twt": ("PreNorm+ScaleNorm+FixNorm", ["--arch", "twt_iwslt_de_en"]),
    "deepnorm": ("DeepNorm", ["--arch", "deepnorm_iwslt_de_en"]),
    # successors (issue #16); their cells are not run yet (docs/results.md)
    "admin_closed": ("Admin closed-form (admin-torch)", ["--arch", "admin_closed_iwslt_de_en"]),
    "subln": ("Sub-LN (Magneto)", ["--arch", "subln_iwslt_de_en"]),
    "b2t": ("B2T connection", ["--arch", "b2t_iwslt_de_en"]),
    "deepnorm_torchscale": ("DeepNorm (torchscale)", ["--arch", "deepnorm_torchscale_iwslt_de_en"]),
    "normformer": ("NormFormer", ["--arch", "normformer_iwslt_de_en"]),
}
REGIMES = ("warmup", "nowarmup")
_BLEU = re.compile(r"BLEU = ([0-9.]+)")
BLIND_FRACTION = 0.05  # fewer distinct dev translations than this share of sentences: the source is ignored
PLATEAU_BITS = 0.1  # a cell whose second half gains less than this (bits/token) stopped learning


class MatrixError(RuntimeError):
    """An expected failure (missing data, unknown cell); the message says what to do."""


def log(msg: str) -> None:
    print(f"[multi30k] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# data


def prepare(work: Path, merges: int, multi30k_dir: str | Path | None = None) -> Path:
    """Multi30k de-en -> ``work/bin`` (fairseq binarised; test = test2016, test1 = test2017).
    The corpus is looked up (and downloaded if need be) only when ``work/bin`` is not there yet."""
    bin_dir = work / "bin"
    if (bin_dir / ".done").exists():
        log(f"data already prepared: {bin_dir}")
        return bin_dir
    corpus = multi30k_data.locate(multi30k_dir)
    log(f"Multi30k from {corpus}")
    raw = work / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for out, split in SPLITS.items():
        for lang in ("de", "en"):
            src = corpus / f"{split}.{lang}.gz"
            with gzip.open(src, "rt", encoding="utf-8") as f, open(raw / f"{out}.{lang}", "w", encoding="utf-8") as g:
                for line in f:
                    g.write(" ".join(line.split()) + "\n")
    bpe = work / f"bpe{merges}"
    log(f"joint BPE ({merges} merges) on the tokenised training text")
    prepare_bible.learn_apply_bpe(raw, bpe, merges, splits=tuple(SPLITS))
    cmd = [sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "de", "--target-lang", "en"]
    cmd += ["--trainpref", str(bpe / "train"), "--validpref", str(bpe / "valid")]
    cmd += ["--testpref", f"{bpe / 'test'},{bpe / 'test1'}", "--destdir", str(bin_dir), "--workers", "2"]
    log_path = work / "preprocess.log"
    with open(log_path, "w", encoding="utf-8") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
            raise MatrixError(f"fairseq-preprocess failed: see {log_path}, then re-run `prepare`")
    (bin_dir / ".done").write_text("ok\n")
    return bin_dir


# ---------------------------------------------------------------------------------------------
# cells


def parse_cell(name: str) -> tuple:
    try:
        method, depth, regime = name.split(":")
        depth_i = int(depth)
    except ValueError:
        raise MatrixError(f"cell {name!r} is not METHOD:DEPTH:REGIME (e.g. postln:18:nowarmup)") from None
    if method not in METHODS:
        raise MatrixError(f"unknown method {method!r} in {name!r}; choose from {', '.join(METHODS)}")
    if regime not in REGIMES:
        raise MatrixError(f"unknown regime {regime!r} in {name!r}; choose from {', '.join(REGIMES)}")
    return method, depth_i, regime


def cell_name(method: str, depth: int, regime: str) -> str:
    return f"{method}:{depth}:{regime}"


def cell_dir(work: Path, name: str) -> Path:
    return work / "runs" / name.replace(":", "-")


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
    cmd = [sys.executable, "-m", "fairseq_cli.train", str(bin_dir), "--user-dir", str(USER_DIR)]
    cmd += METHODS[method][1]
    cmd += ["--encoder-layers", str(depth), "--decoder-layers", str(depth)]
    for side in ("encoder", "decoder"):
        cmd += [f"--{side}-embed-dim", str(a.dim), f"--{side}-ffn-embed-dim", str(a.ffn)]
        cmd += [f"--{side}-attention-heads", str(a.heads)]
    cmd += ["--dropout", str(a.dropout), "--share-decoder-input-output-embed"]
    cmd += ["--criterion", "label_smoothed_cross_entropy_diagnostics", "--label-smoothing", "0.1"]
    updates, every = budget_of(a.budget, depth)
    cmd += ["--diagnostics-interval", str(every), "--diagnostics-stats", "grad"]
    cmd += ["--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.0001"]
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
    return cmd + shlex.split(a.extra_args)


_JSON_LINE = re.compile(r"\| (train_inner|valid|train) \| (\{.*\})\s*$")
# the guard's message runs over several lines (stop, first non-finite layer, weights) before its advice
_FAILURES = (
    re.compile(r"DivergenceError: (.*?)(?:\nNo checkpoint|$)", re.DOTALL),
    re.compile(r"FloatingPointError: (.*)"),
)


def parse_log(text: str) -> dict:
    """Validation curve ``[(update, loss, nll_loss)]``, train log records and the failure message
    of a fairseq-train ``--log-format json`` log."""
    valid: List[tuple] = []
    train: List[dict] = []
    for line in text.splitlines():
        m = _JSON_LINE.search(line)
        if not m:
            continue
        rec = json.loads(m.group(2))
        if m.group(1) == "valid":
            update = int(float(rec["valid_num_updates"]))
            if not valid or valid[-1][0] != update:  # fairseq validates twice when an epoch ends on an interval
                valid.append((update, float(rec["valid_loss"]), float(rec["valid_nll_loss"])))
        elif m.group(1) == "train_inner":
            train.append(rec)
    error = None
    for pattern in _FAILURES:
        m = pattern.search(text)
        if m:
            error = " ".join(m.group(1).split())
            break
    return {"valid": valid, "train": train, "error": error}


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


def classify(
    parsed: dict,
    returncode: int,
    stall_bits: float,
    target_bits: float | None,
    plateau_bits: float = PLATEAU_BITS,
    probe: dict | None = None,
    blind_fraction: float = BLIND_FRACTION,
) -> dict:
    """Status, best dev nll and updates to ``target_bits`` of a finished cell (module docstring):
    ``diverged`` (non-finite), ``failed`` (crashed otherwise), ``stalled`` (never below ``stall_bits``,
    or the second half of the run improved the best dev nll by less than ``plateau_bits``: it stopped
    learning), ``source-blind`` (its greedy dev translations, ``probe``, are fewer than
    ``blind_fraction`` of its sentences), else ``converging``."""
    finite = [(u, nll) for u, loss, nll in parsed["valid"] if math.isfinite(loss) and math.isfinite(nll)]
    best = min(finite, key=lambda un: un[1]) if finite else None
    reached = next((u for u, nll in finite if target_bits is not None and nll <= target_bits), None)
    first_half = [nll for u, nll in finite if u <= finite[-1][0] / 2] if finite else []
    plateau = bool(first_half) and min(first_half) - best[1] < plateau_bits
    if parsed["error"] or len(finite) < len(parsed["valid"]):
        status = "diverged"
    elif returncode != 0:
        status = "failed"
    elif best is None or best[1] >= stall_bits or plateau:
        status = "stalled"
    elif probe and probe["distinct"] < blind_fraction * probe["sentences"]:
        status = "source-blind"
    else:
        status = "converging"
    return {
        "status": status,
        "best_dev_nll": best[1] if best else None,
        "best_update": best[0] if best else None,
        "updates_to_target": reached,
    }


def gnorm_profile(train: List[dict]) -> Dict[str, float]:
    """Per-layer gradient norms of the last train log record that has them."""
    for rec in reversed(train):
        layers = {k[len("diag_gnorm/") :]: float(v) for k, v in rec.items() if k.startswith("diag_gnorm/")}
        if layers:
            return {"update": int(float(rec["num_updates"])), **layers}
    return {}


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
        return replace(self, stall_bits=unigram_bits(work / "bin", work / f"bpe{_merges(work)}" / "valid.en"))


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
        start = time.time()
        with open(out / "train.log", "w", encoding="utf-8") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        method, depth, regime = parse_cell(name)
        record = dict(
            cell=name,
            method=method,
            depth=depth,
            regime=regime,
            returncode=proc.returncode,
            wall_s=round(time.time() - start, 1),
            command="fairseq-train " + shlex.join(cmd[3:]).replace(str(REPO) + "/", ""),
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
        error=parsed["error"] or (None if r["returncode"] == 0 else _last_line(text)),
    )
    return r


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][-300:] if lines else "no output"


def _merges(work: Path) -> str:
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


# ---------------------------------------------------------------------------------------------
# BLEU


def translate(bin_dir: Path, out: Path, subset: str, label: str, beam: int, threads: int, device: str = "cpu") -> Path:
    """``fairseq-generate`` of ``subset`` with the cell's best checkpoint (skipped when up to date),
    logging sentences done of the total every tenth of the set; its stderr goes to a log beside it.
    ``device`` "cuda" decodes on the GPU (fp32), "cpu" with ``--cpu``."""
    ckpt = out / "checkpoint_best.pt"
    gen = out / f"generate-{label}.txt"
    if not (gen.exists() and gen.stat().st_mtime > ckpt.stat().st_mtime):
        cmd = [sys.executable, "-m", "fairseq_cli.generate", str(bin_dir), "--user-dir", str(USER_DIR)]
        cmd += ["--path", str(ckpt), "--gen-subset", subset, "--beam", str(beam), "--remove-bpe"]
        cmd += ["--max-len-a", "1.2", "--max-len-b", "10", "--batch-size", "128"]
        cmd += ["--required-batch-size-multiple", "1"] + (["--cpu"] if device == "cpu" else [])
        # unbuffered, so that hypotheses (and the progress counted from them) arrive batch by batch
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        tmp, err = gen.with_suffix(".tmp"), gen.with_suffix(".log")
        name = f"{out.name} {label}"
        with open(tmp, "wb") as f, open(err, "wb") as e:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=e, env=env)
            raw = bin_dir.parent / "raw" / f"{subset}.en"  # prepare's untokenised copy: one line per sentence
            total = sum(1 for _ in open(raw, "rb")) if raw.exists() else None
            with proc.stdout:
                generate_progress.relay(proc.stdout, f, log, total=total, label=name)
            if proc.wait() != 0:
                raise MatrixError(f"fairseq-generate failed on {name} (exit {proc.returncode}): see {err}")
        tmp.replace(gen)
    return gen


def _trained_cell_dir(work: Path, name: str) -> Path:
    out = cell_dir(work, name)
    if not (out / "checkpoint_best.pt").exists():
        raise MatrixError(f"{out / 'checkpoint_best.pt'} not found: train the cell first (`matrix --cells {name}`)")
    return out


def bleu_cell(bin_dir: Path, work: Path, name: str, beam: int, threads: int) -> dict:
    """sacreBLEU of the cell's best checkpoint on test2016 and test2017 (``bleu.json``)."""
    out = _trained_cell_dir(work, name)
    scores = {}
    for subset, label in TEST_SETS.items():
        gen = translate(bin_dir, out, subset, label, beam, threads)
        scores[label] = prepare_bible.score(gen, work / "raw" / f"{subset}.en")
    (out / "bleu.json").write_text(json.dumps(scores, indent=1))
    return scores


def probe_cell(bin_dir: Path, work: Path, name: str, threads: int) -> dict:
    """Greedy translation of the dev set with the cell's best checkpoint (``probe.json``): how many
    distinct hypotheses it produces and its BLEU. A model that emits (nearly) the same sentence for
    every input has learnt a target-side language model and ignores the source; its dev loss alone
    does not show that (about 5.2 bits/token here)."""
    out = _trained_cell_dir(work, name)
    gen = translate(bin_dir, out, "valid", "dev-greedy", 1, threads)
    hyps = prepare_bible.read_hypotheses(gen)
    bleu = prepare_bible.score(gen, work / "raw" / "valid.en")
    result = {"distinct": len(set(hyps)), "sentences": len(hyps), "bleu": float(_BLEU.search(bleu).group(1))}
    (out / "probe.json").write_text(json.dumps(result, indent=1))
    return result


# ---------------------------------------------------------------------------------------------
# report


def load_results(work: Path, rules: Rules) -> Dict[str, dict]:
    """Every finished cell under ``work/runs``, analysed, with its BLEU scores when translated."""
    results = {}
    records = sorted((work / "runs").glob("*/result.json"))
    if records:
        rules = rules.for_work(work)
    for p in records:
        r = analyse(p.parent, rules)
        bleu = p.parent / "bleu.json"
        if bleu.exists():
            r["bleu"] = json.loads(bleu.read_text())
        results[r["cell"]] = r
    return results


def select_for_bleu(results: Dict[str, dict]) -> List[str]:
    """Per method: the better regime at the shallowest and at the deepest depth where it was converging."""
    chosen = []
    for m in METHODS:
        ok = [r for r in results.values() if r["method"] == m and r["status"] == "converging"]
        for depth in sorted({min((r["depth"] for r in ok), default=0), max((r["depth"] for r in ok), default=0)}):
            at = [r for r in ok if r["depth"] == depth]
            if at:
                chosen.append(min(at, key=lambda r: r["best_dev_nll"])["cell"])
    return chosen


def fmt_cell(r: dict | None) -> str:
    if r is None:
        return "not run"
    nll = f"{r['best_dev_nll']:.2f}" if r["best_dev_nll"] is not None else "-"
    if r["status"] == "diverged":
        return f"**diverged** at {r['updates_done']}" + (f" (best {nll})" if r["best_dev_nll"] is not None else "")
    if r["status"] in ("stalled", "failed", "source-blind"):
        return f"**{r['status']}** {nll}"
    reach = f" @{r['updates_to_target']}" if r["updates_to_target"] is not None else " @-"
    return f"ok {nll}{reach}"


def _grid(results: Dict[str, dict], depths: List[int], fmt: Callable, empty: str) -> List[str]:
    """Markdown table, a row per method and a column per (depth, regime); rows with nothing run are left out."""
    lines = [
        "| method | " + " | ".join(f"{d}L warmup | {d}L no warmup" for d in depths) + " |",
        "|---|" + "---|" * (2 * len(depths)),
    ]
    for m, (label, _) in METHODS.items():
        row = [fmt(results.get(cell_name(m, d, r))) for d in depths for r in REGIMES]
        if any(x != empty for x in row):
            lines.append(f"| {label} | " + " | ".join(row) + " |")
    return lines


def _fmt_probe(r: dict | None) -> str:
    if r is None or not r.get("probe"):
        return "-"
    return f"{r['probe']['bleu']:.1f} ({r['probe']['distinct']})"


def _layer_summary(g: Dict[str, float]) -> str:
    """Gradient norms of the embeddings and of the bottom and top layer of each stack."""
    if not g:
        return "no per-layer gradient norms logged"
    parts = []
    for stack in ("encoder", "decoder"):
        layers = sorted(int(k.split(".")[2]) for k in g if k.startswith(f"{stack}.layers."))
        if layers:
            lo, hi = g[f"{stack}.layers.{layers[0]}"], g[f"{stack}.layers.{layers[-1]}"]
            parts.append(
                f"{stack} layer 1 {lo:.3g}, layer {layers[-1] + 1} {hi:.3g} (top/bottom {hi / max(lo, 1e-30):.3g})"
            )
    return f"update {g['update']}: " + "; ".join(parts)


def report(work: Path, rules: Rules) -> str:
    """The Markdown tables of ``docs/results.md``: stability matrix, BLEU, failing cells."""
    results = load_results(work, rules)
    if not results:
        raise MatrixError(f"no results under {work / 'runs'}: run `matrix` first")
    depths = sorted({r["depth"] for r in results.values()})
    any_r = next(iter(results.values()))
    targets = ", ".join(f"{d}L {target_of(rules.target_spec, d)}" for d in depths)
    lines = [
        f"Cell: status, best dev nll (bits/token), `@U` = first validation with dev nll <= the depth's target "
        f"({targets}); `@-`: not reached. Stalled: never below the unigram model's {any_r['stall_bits']:.2f} bits, "
        f"or less than {rules.plateau_bits} bits gained in the second half of the run.",
        "",
        *_grid(results, depths, fmt_cell, "not run"),
    ]
    n_dev = next((r["probe"]["sentences"] for r in results.values() if r.get("probe")), None)
    if n_dev:
        lines += [
            "",
            "Dev BLEU of each cell's best checkpoint (greedy, sacreBLEU) and, in brackets, the number of distinct "
            f"translations of the {n_dev} dev sentences:",
            "",
            *_grid(results, depths, _fmt_probe, "-"),
        ]
    bleu_rows = [r for r in results.values() if "bleu" in r]
    if bleu_rows:
        lines += [
            "",
            "| method | layers | regime | status | best update | test2016 BLEU | test2017 BLEU | best dev nll |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(bleu_rows, key=lambda r: (list(METHODS).index(r["method"]), r["depth"], r["regime"])):
            b = {k: _BLEU.search(v).group(1) for k, v in r["bleu"].items()}
            lines.append(
                f"| {METHODS[r['method']][0]} | {r['depth']} | {r['regime']} | {r['status']} | {r['best_update']} "
                f"| {b['test2016']} | {b['test2017']} | {r['best_dev_nll']:.2f} |"
            )
        sig = next(iter(bleu_rows[0]["bleu"].values())).split("signature: ")[-1].rstrip(")")
        lines += ["", f"sacreBLEU signature: `{sig}`"]
    failing = [r for r in results.values() if r["status"] != "converging"]
    if failing:
        lines += ["", "Cells that were not converging, and why:", ""]
        for r in sorted(failing, key=lambda r: (r["depth"], list(METHODS).index(r["method"]), r["regime"])):
            step = max(1, -(-len(r["valid"]) // 8))  # at most about 8 points, the last one always shown
            points = r["valid"][::step] + ([r["valid"][-1]] if (len(r["valid"]) - 1) % step else [])
            curve = ", ".join(f"{u}: {nll:.2f}" for u, _, nll in points) or "no validation"
            why = f"{r['error']}; " if r["error"] else ""
            lines.append(
                f"- `{r['cell']}` ({r['status']}): {why}dev nll by update {curve}; gradient norms at the last "
                f"logged update, {_layer_summary(r['gnorm_layers'])}"
            )
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- multi30k_matrix report: begin -->", "<!-- multi30k_matrix report: end -->"


def write_between_markers(path: Path, text: str) -> None:
    """Replace the generated block of ``path`` (between ``BEGIN`` and ``END``), keeping the prose around it."""
    doc = path.read_text(encoding="utf-8") if path.exists() else f"{BEGIN}\n{END}\n"
    if doc.count(BEGIN) != 1 or doc.count(END) != 1 or doc.index(BEGIN) > doc.index(END):
        raise MatrixError(f"{path} needs exactly one {BEGIN} ... {END} block to write the report into")
    head, rest = doc.split(BEGIN)
    tail = rest.split(END)[1]
    path.write_text(f"{head}{BEGIN}\n{text}{END}{tail}", encoding="utf-8")


# ---------------------------------------------------------------------------------------------


COMMANDS = {
    "prepare": "Multi30k -> tokenised, joint BPE, binarised under --work-dir",
    "matrix": "train every cell (--methods x --depths x --regimes, or --cells), then probe it",
    "probe": "greedy dev translation of --cells (all: every trained cell not probed yet)",
    "bleu": "test2016 / test2017 sacreBLEU of --cells (select: 6-layer and deepest converging per method)",
    "report": "the Markdown tables of docs/results.md (to stdout, or into --output); `report --converged`:\n"
    "  the converged matrix (merges result files and packs into docs/results/converged.json and docs/results.md;\n"
    "  `report --converged --help`)",
    "converge": "train cells to convergence on CPU or CUDA, resumably, in chunks (`converge --help`)",
}


def build_parser() -> argparse.ArgumentParser:
    """The command line (every option says what it does, which subcommands read it, and its default)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "command",
        choices=tuple(COMMANDS),
        help="\n".join(f"{name}: {what}" for name, what in COMMANDS.items()),
    )
    add = p.add_argument
    add(
        "--work-dir",
        type=Path,
        default=REPO / "work-data" / "multi30k-matrix",
        help="data, runs and results of every subcommand (default: %(default)s)",
    )
    add(
        "--multi30k-dir",
        type=str,  # not Path: an empty value means "not given", as an empty MULTI30K_DIR does
        default=None,
        help="prepare: folder with Multi30k's task1 raw files (train.de.gz, ...), read in place (default:\n"
        f"$MULTI30K_DIR, else {multi30k_data.LOCAL_DEFAULT} if present, else the pinned public\n"
        f"release downloaded once into {multi30k_data.CACHE})",
    )
    add("--bpe-merges", type=int, default=8000, help="prepare: joint BPE merge operations (default: %(default)s)")
    add(
        "--methods", default=",".join(METHODS), help="matrix/probe/bleu: comma-separated methods (default: %(default)s)"
    )
    add(
        "--depths",
        default="6,18,36",
        help="matrix/probe/bleu: layers per stack, comma-separated (default: %(default)s)",
    )
    add("--regimes", default=",".join(REGIMES), help="matrix/probe/bleu: learning-rate regimes (default: %(default)s)")
    add(
        "--cells",
        default="",
        help="comma-separated METHOD:DEPTH:REGIME instead of the product of the three above; probe: 'all',\n"
        "bleu: 'select' (default: empty, the product)",
    )
    add("--dim", type=int, default=64, help="matrix: embedding dimension (default: %(default)s)")
    add("--ffn", type=int, default=256, help="matrix: FFN inner dimension (default: %(default)s)")
    add("--heads", type=int, default=4, help="matrix: attention heads (default: %(default)s)")
    add("--dropout", type=float, default=0.1, help="matrix: dropout (default: %(default)s)")
    add("--lr", type=float, default=1e-3, help="matrix: peak learning rate of the warmup regime (default: %(default)s)")
    add(
        "--lr-nowarmup",
        type=float,
        default=2e-3,
        help="matrix: learning rate of the no-warmup regime (default: %(default)s)",
    )
    add("--warmup", type=int, default=100, help="matrix: warm-up updates of the warmup regime (default: %(default)s)")
    add(
        "--budget",
        default="6:600:50,18:250:25,36:150:25,100:40:20",
        help="matrix: DEPTH:UPDATES:VALID_EVERY,... updates and validation interval per depth\n(default: %(default)s)",
    )
    add("--max-tokens", type=int, default=2048, help="matrix: tokens per batch (default: %(default)s)")
    add("--seed", type=int, default=1, help="matrix: random seed of every cell (default: %(default)s)")
    add(
        "--stall-bits",
        type=float,
        default=None,
        help="stalled = best dev nll (bits/token) never below this (default: the unigram model's)",
    )
    add(
        "--plateau-bits",
        type=float,
        default=PLATEAU_BITS,
        help="stalled = the second half of the run gains less than this, bits (default: %(default)s)",
    )
    add(
        "--blind-fraction",
        type=float,
        default=BLIND_FRACTION,
        help="source-blind = fewer distinct dev translations than this share of sentences (default: %(default)s)",
    )
    add(
        "--target-bits",
        default="6:5.0,18:6.0,36:7.0,100:7.5",
        help="DEPTH:BITS,... dev-nll targets for 'updates to target' (default: %(default)s)",
    )
    add(
        "--extra-args",
        default="",
        help="matrix: appended to every fairseq-train command, last, so they win (default: none)",
    )
    add("--dry-run", action="store_true", help="matrix: print the fairseq-train commands, train nothing")
    add("--jobs", type=int, default=1, help="matrix/probe/bleu: cells run at the same time (default: %(default)s)")
    add("--threads", type=int, default=1, help="OpenMP threads per job (default: %(default)s)")
    add("--beam", type=int, default=5, help="bleu: beam size (default: %(default)s)")
    add(
        "--output",
        type=Path,
        default=None,
        help=f"report: replace the text between {BEGIN} and\n{END} in this file, e.g. docs/results.md\n"
        "(default: print the tables)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["converge"]:  # the converged matrix (issue #17): scripts/matrix/
        from matrix import run as converge_run

        return converge_run.main(argv[1:])
    if argv[:1] == ["report"] and "--converged" in argv:
        from matrix import report as converge_report

        return converge_report.main([x for x in argv[1:] if x != "--converged"])
    p = build_parser()
    a = p.parse_args(argv)
    try:
        work = a.work_dir
        if a.command == "prepare":
            prepare(work, a.bpe_merges, a.multi30k_dir)
            return 0
        if a.command == "report":
            text = report(work, Rules.of(a))
            if a.output:
                write_between_markers(a.output, text)
            else:
                print(text, end="")
            return 0
        if a.command == "bleu" and a.cells == "select":
            cells = select_for_bleu(load_results(work, Rules.of(a)))
        elif a.command == "probe" and a.cells == "all":
            runs = sorted((work / "runs").glob("*/checkpoint_best.pt"))
            cells = [
                json.loads((p.parent / "result.json").read_text())["cell"]
                for p in runs
                if not (p.parent / "probe.json").exists() and (p.parent / "result.json").exists()
            ]
        else:
            if not all(d.strip().isdigit() for d in a.depths.split(",")):
                raise MatrixError(f"--depths {a.depths!r} is not a comma-separated list of layer counts (e.g. 6,18)")
            cells = [c for c in a.cells.split(",") if c] or expand(
                a.methods.split(","), [int(d) for d in a.depths.split(",")], a.regimes.split(",")
            )
        for c in cells:
            parse_cell(c)
        if a.command == "matrix" and a.dry_run:
            for c in cells:
                print(shlex.join(train_command(work / "bin", cell_dir(work, c), c, a)))
            return 0
        bin_dir = prepare(work, a.bpe_merges, a.multi30k_dir)
        if a.command == "matrix":
            with ThreadPoolExecutor(a.jobs) as pool:
                list(pool.map(lambda c: train_cell(bin_dir, work, c, a), cells))
        elif a.command == "probe":
            with ThreadPoolExecutor(a.jobs) as pool:
                for c, found in zip(
                    cells, pool.map(lambda c: probe_cell(bin_dir, work, c, a.threads), cells), strict=True
                ):
                    print(c, json.dumps(found))
        else:
            with ThreadPoolExecutor(a.jobs) as pool:
                for c, scores in zip(
                    cells, pool.map(lambda c: bleu_cell(bin_dir, work, c, a.beam, a.threads), cells), strict=True
                ):
                    print(c, json.dumps(scores))
        return 0
    except (MatrixError, prepare_bible.CorpusError, multi30k_data.Multi30kError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
