"""``gpu_session.py --plan``: what each stage of a session is expected to take on an H100, and how many
epochs the packed cells get at each width.

Nothing here was measured on a GPU. The figures are the stock fairseq rates measured on an H100
earlier (transformer base, ``--max-tokens 16384``: 6+6 layers fp16 155-191k target tokens/s, midpoint
173k; fp32 about 70k; 18+18 layers 62k; 36+36 about 31k by extrapolation), scaled for the cells by the
CPU-measured depth and width costs of :mod:`deepinit_tools.matrix.budget`, with its assumed speed-up
of packed processes; the plugin's rows are costed at stock's fp16 rate (the speed target is 2x, not
assumed). Given a CPU rehearsal's output folder (``--rehearsal``), the plan shows the minutes each
stage took there beside the estimate.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Sequence

from deepinit_tools.matrix import budget as est
from deepinit_tools.matrix.regimes import M30K_TARGET_TOKENS, MAIN_METHODS
from deepinit_tools.session.cells import WIDTH_REASON, decode_seconds
from deepinit_tools.session.stages import Budget, Stage

STOCK_H100 = {6: 173_000.0, 18: 62_000.0, 36: 31_000.0}  # stock fairseq fp16 target tokens/s, one process
STOCK_H100_FP32_6L = 70_000.0
BATCH_TARGET_TOKENS = 12_000  # target tokens of a --max-tokens 16384 Multi30k batch (about)
START_S = 50.0  # imports, data and the first CUDA kernels of a benchmark script
INSTALL_MIN = 0.3  # the wheel install before the session starts (counted in its budget)
SMOKE_ROW_S = 1.0  # one architecture in one precision: build, 3 steps, beam-4 decode (host-bound; estimate)
BUILD_S, WARMUP_STEPS, TIMED_STEPS = 3.0, 3, 5 * 10  # a speed row: build, warm-up, 5 rounds of 10 steps
LOSS_UPDATES = 300
COMPILE_S = 90.0
DEV_BLEU_S_PER_LAYER = 0.15  # greedy decoding of the 1,014 dev sentences in each validation (estimate)
WIDTHS = ((128, 512, 2), (256, 1024, 4), (512, 2048, 8))


def _row_s(rate: float) -> float:
    return BUILD_S + (WARMUP_STEPS + TIMED_STEPS) * BATCH_TARGET_TOKENS / rate


def script_minutes(stage: Stage, n_smoke_rows: int) -> float:
    """Expected H100 minutes of a timed stage (see the module docstring)."""
    if stage.name == "smoke":
        return (20.0 + n_smoke_rows * SMOKE_ROW_S) / 60
    if stage.name == "speed6":  # 14 rows: stock fp32, 13 at fp16 rates; then the loss check (2 models)
        loss = 2 * LOSS_UPDATES * BATCH_TARGET_TOKENS / STOCK_H100[6]
        return (START_S + _row_s(STOCK_H100_FP32_6L) + 13 * _row_s(STOCK_H100[6]) + loss) / 60
    if stage.name == "speed-deep":
        return (START_S + 3 * _row_s(STOCK_H100[18]) + 3 * _row_s(STOCK_H100[36])) / 60
    if stage.name == "compile":
        return (START_S + COMPILE_S + 3 * _row_s(STOCK_H100[6])) / 60
    if stage.name == "profile":
        return (START_S + 4 * (BUILD_S + 2 * 13 * BATCH_TARGET_TOKENS / STOCK_H100[6])) / 60
    raise ValueError(f"{stage.name} is not a timed stage")


def epoch_seconds(depth: int, dim: int, jobs: int) -> float:
    """Seconds of one epoch of one of ``jobs`` packed cells: training, validation and greedy dev BLEU."""
    rate = est.h100_tokens_per_s(depth, dim) * est.jobs_speedup(jobs) / jobs
    return M30K_TARGET_TOKENS / rate + 1.0 + (est.VALID_SAVE_S_PER_LAYER + DEV_BLEU_S_PER_LAYER) * depth


def cells_table(depth: int, jobs: int, minutes: float) -> List[str]:
    """Expected epochs of the packed cells in ``minutes`` at each width of :data:`WIDTHS`."""
    decode = decode_seconds(depth, "cuda", len(MAIN_METHODS))
    train = 60 * minutes - decode - est.PROCESS_START_S
    lines = [f"  {'width':<22} {'tok/s per process':>17} {'s per epoch':>11} {'epochs':>6}"]
    for dim, ffn, heads in WIDTHS:
        per = est.h100_tokens_per_s(depth, dim) * est.jobs_speedup(jobs) / jobs
        sec = epoch_seconds(depth, dim, jobs)
        epochs = max(0, math.floor(train / sec))
        mark = "  <- default" if dim == 256 else ""
        lines.append(f"  d {dim}, FFN {ffn}, {heads} heads{'':<3} {per:>17,.0f} {sec:>11.1f} {epochs:>6}{mark}")
    lines.append(f"  (training {train / 60:.1f} min = the stage's {minutes:.1f} less {decode:.0f} s of decoding and "
                 f"{est.PROCESS_START_S:.0f} s of process start)")  # fmt: skip
    return lines


def rehearsal_minutes(folder: Path | None) -> Dict[str, float]:
    """Minutes each stage took in a rehearsal's ``session.json`` (none without a folder)."""
    if folder is None:
        return {}
    doc = json.loads((folder / "session.json").read_text())
    return {r["name"]: r["seconds"] / 60 for r in doc["stages"] if "seconds" in r}


def plan(stages: Sequence[Stage], budget: Budget, n_smoke_rows: int, jobs: int, rehearsal: Path | None) -> str:
    """The plan's text: every stage's expected minutes and deadline, then the cells per width."""
    measured = rehearsal_minutes(rehearsal)
    lines = [
        "GPU session plan: an ESTIMATE for an H100 (stock fairseq rates measured on an H100 earlier, scaled by",
        "CPU-measured depth/width costs; nothing here was measured on a GPU).",
        f"budget {budget.minutes:g} min from the command's start, the wheel install (~{INSTALL_MIN} min) included",
        "",
        f"{'stage':<11} {'expected min':>12} {'must end by (min)':>17} {'CPU rehearsal min':>18}  what",
    ]
    t = budget.t0 + 60 * INSTALL_MIN
    greedy: List[tuple] = []
    for i, s in enumerate(stages):
        deadline = budget.deadline(s, stages[i + 1 :], now=t)
        if deadline is None:
            lines.append(f"{s.name:<11} {'skipped: no time left':>31}")
            continue
        if s.greedy:
            minutes = (deadline - t) / 60
            expected = f"rest {minutes:.1f}"
            greedy.append((s, minutes))
        else:
            minutes = min(script_minutes(s, n_smoke_rows), (deadline - t) / 60)
            expected = f"{minutes:.1f}"
        rehearsed = f"{measured[s.name]:.1f}" if s.name in measured else "-"
        lines.append(f"{s.name:<11} {expected:>12} {(deadline - budget.t0) / 60:>17.1f} {rehearsed:>18}  {s.what}")
        t += 60 * minutes
    for s, minutes in greedy:
        lines += ["", f"{s.name}: {len(MAIN_METHODS)} paper cells at {s.depth} layers, packed {jobs} at a time, "
                  f"{minutes:.1f} min:", *cells_table(s.depth, jobs, minutes)]  # fmt: skip
    if greedy:
        lines += ["", "width: " + WIDTH_REASON]
    return "\n".join(lines)
