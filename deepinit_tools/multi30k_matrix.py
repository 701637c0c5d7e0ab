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
- ``converge`` and ``report --converged``: the converged matrix (each method trained to
  convergence in its paper's regime and a common one, on CPU or CUDA, in resumable chunks), in the
  package ``deepinit_tools/matrix/`` (``regimes.py``, ``run.py``, ``report.py``).

Cells are named ``METHOD:DEPTH:REGIME`` (``postln:18:nowarmup``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from deepinit_tools import (
    multi30k,  # MULTI30K_DIR, the local copy, or the pinned public release
    prepare_bible,  # the tokeniser, BPE and scorer of the quickstart, shared
)
from deepinit_tools.matrix.cells import Rules, expand, train_cell, train_command
from deepinit_tools.matrix.common import (
    BLIND_FRACTION,
    METHODS,
    PLATEAU_BITS,
    REGIMES,
    MatrixError,
    cell_dir,
    parse_cell,
)
from deepinit_tools.matrix.decode import bleu_cell, probe_cell
from deepinit_tools.matrix.early_report import BEGIN, END, load_results, report, select_for_bleu, write_between_markers
from deepinit_tools.multi30k import prepare_bpe as prepare
from deepinit_tools.paths import REPO

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
        f"$MULTI30K_DIR, else {multi30k.LOCAL_DEFAULT} if present, else the pinned public\n"
        f"release downloaded once into {multi30k.CACHE})",
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
    if argv[:1] == ["converge"]:  # the converged matrix: deepinit_tools/matrix/
        from deepinit_tools.matrix import run as converge_run

        return converge_run.main(argv[1:])
    if argv[:1] == ["report"] and "--converged" in argv:
        from deepinit_tools.matrix import report as converge_report

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
    except (MatrixError, prepare_bible.CorpusError, multi30k.Multi30kError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
