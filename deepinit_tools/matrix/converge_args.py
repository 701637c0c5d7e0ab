"""The options of ``multi30k_matrix.py converge`` (:mod:`deepinit_tools.matrix.run`), with their help."""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinit_tools.matrix import plan as plan_mod
from deepinit_tools.matrix import regimes as rg
from deepinit_tools.paths import REPO


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="multi30k_matrix.py converge",
        description="Train cells of the Multi30k matrix to convergence (patience or epoch cap), on CPU or CUDA, "
        "resumably; each cell ends as one small result.json (see docs/results.md, 'Converged reproduction').",
    )
    add = p.add_argument
    add(
        "--chunk",
        default=None,
        help="train this chunk of the matrix (--list-chunks shows them; default: none, "
        "use --cells or --methods/--depths/--regime/--seeds)",
    )
    add("--list-chunks", action="store_true", help="print the chunks, their cells and estimated GPU minutes, then exit")
    add("--cells", default="", help="comma-separated METHOD:DEPTH:REGIME[:sSEED] (default: none)")
    add("--methods", default=",".join(rg.METHODS), help="methods (default: %(default)s)")
    add("--depths", default="6,18,36", help="layers per stack (default: %(default)s)")
    add(
        "--regime",
        default="both",
        choices=("paper", "common", "both"),
        help="each method's paper regime(s), the common regime, or both (default: %(default)s)",
    )
    add("--seeds", default="1", help="seeds, comma-separated (default: %(default)s)")
    add(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where fairseq trains and decodes (default: %(default)s)",
    )
    add(
        "--precision",
        default=None,
        choices=("fp16", "bf16", "fp32"),
        help="fp16: fairseq --fp16; bf16: --task translation_deepinit --autocast-bf16 (fp32 weights); fp32\n"
        "(default: bf16 on cuda, fp32 on cpu)",
    )
    add(
        "--jobs",
        default="1",
        help="cells trained at the same time, sharing the device, or 'auto': the count of the highest measured\n"
        "aggregate tokens/s in --rates (default: %(default)s)",
    )
    add("--max-epochs", type=int, default=50, help="epoch cap of every cell (default: %(default)s)")
    add(
        "--patience",
        type=int,
        default=3,
        help="stop when the dev loss has not improved for this many epochs (default: %(default)s)",
    )
    add("--dim", type=int, default=256, help="embedding dimension (default: %(default)s)")
    add("--ffn", type=int, default=1024, help="FFN inner dimension (default: %(default)s)")
    add("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    add(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens per update instead of the regime's (default: the regime's, 8192)",
    )
    add(
        "--max-tokens-per-job",
        type=int,
        default=None,
        help="memory limit: tokens per forward of one job; a larger batch is split with --update-freq\n"
        "(default: the chunk's, else no limit)",
    )
    add(
        "--work-dir",
        type=Path,
        default=REPO / "work-data" / "multi30k-matrix",
        help="prepared data (bin/, raw/, bpe*/), made by `prepare` when missing (default: %(default)s)",
    )
    add(
        "--runs-dir",
        type=Path,
        default=None,
        help="one folder per cell (log, checkpoints until it finishes, result.json) (default: WORK_DIR/converged)",
    )
    add("--multi30k-dir", type=str, default=None, help="Multi30k raw files for `prepare` (default: as `prepare`)")
    add("--bpe-merges", type=int, default=8000, help="joint BPE merges when preparing (default: %(default)s)")
    add("--threads", type=int, default=1, help="OpenMP threads per job (default: %(default)s)")
    add("--beam", type=int, default=5, help="beam size for test2016/test2017 (default: %(default)s)")
    add(
        "--stall-bits",
        type=float,
        default=None,
        help="stalled = best dev nll never below this (default: the unigram model's)",
    )
    add(
        "--deadline-min",
        type=float,
        default=None,
        help="stop training this many minutes after the start, cells left resumable (default: none)",
    )
    add(
        "--pack",
        type=Path,
        default=None,
        help="write the selected cells' finished results into this one JSON file (default: none)",
    )
    add(
        "--deadline-at",
        type=float,
        default=None,
        help="as --deadline-min, at this Unix time (date +%%s): several steps in one device command (default: none)",
    )
    add(
        "--no-fast-path",
        action="store_true",
        help="on CUDA, train with fairseq's attention and per-tensor Adam instead of the plugin's fast path\n"
        "(--attention-impl sdpa, --optimizer adam_foreach where the regime uses Adam) (default: fast path)",
    )
    add(
        "--rates",
        type=Path,
        default=None,
        help="measured tokens/s: the file --measure-jobs writes, or a --pack file; read by --plan and --jobs auto\n"
        "(default: none; --plan then uses the built-in H100 estimate, labelled as such)",
    )
    add(
        "--measure-jobs",
        default=None,
        help="measure the aggregate tokens/s of K identical training processes for each K of this comma-separated\n"
        "list (e.g. 1,8,12,16) into --rates, then exit (default: none)",
    )
    add(
        "--measure-cells",
        default=plan_mod.DEFAULT_PROBE,
        help="--measure-jobs: the probe cell(s), comma-separated (default: %(default)s)",
    )
    add("--measure-updates", type=int, default=200, help="--measure-jobs: updates per process (default: %(default)s)")
    add(
        "--plan",
        action="store_true",
        help="print the expected wall time of the selected cells for every --jobs of the rates, then exit",
    )
    add("--plan-jobs", default=None, help="--plan: the job counts to plan for (default: those of --rates)")
    add("--budget-min", type=float, default=None, help="--plan: list the cells finished within this many minutes")
    add(
        "--command-min",
        type=float,
        default=8.5,
        help="--plan: usable minutes of one device command (its --deadline-min) (default: %(default)s)",
    )
    add(
        "--skip-done",
        type=Path,
        action="append",
        default=[],
        help="leave out the cells this file (docs/results/converged.json or a --pack file) holds a result of,\n"
        "trained on the same --device; may be repeated (default: none)",
    )
    add("--extra-args", default="", help="appended to every fairseq-train command (default: none)")
    add("--dry-run", action="store_true", help="print the commands and the estimated GPU minutes, train nothing")
    return p
