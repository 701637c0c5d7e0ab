"""The GPU budget estimate of the converged Multi30k matrix: minutes per cell and per chunk on an H100,
from the known stock-fairseq figures scaled by CPU-measured depth and width costs; and the batch split
(``--update-freq``) where one process's memory binds.
"""

from __future__ import annotations

import math
from typing import Dict, Sequence, Tuple

from deepinit_tools.matrix.regimes import M30K_TARGET_TOKENS, Cell

# ---- GPU budget estimate -----------------------------------------------------------------------
# Known H100 figures: stock fairseq transformer base (d=512) with --fp16, target tokens/s
# of one process: 6+6 layers 155-191k (the midpoint is used), 18+18 layers 62k.
H100_TPS_D512 = {6: 173_000.0, 18: 62_000.0}
# Measured on this project's 2-core CPU (fairseq-train, Pre-LN, FFN 1024, 4,096 tokens, 1 thread, median
# tokens/s of updates 4-8): d=256 at 6 / 18 / 36 layers 1,294 / 457 / 215 tokens/s, d=512 at 6 layers 560.
# Time per token relative to 6 layers, from those CPU runs: 18 layers 2.83 (the H100 figures give 2.79), 36
# layers 6.02; linear in depth between and beyond the measured depths.
CPU_DEPTH_COST = {6: 1.0, 18: 1294 / 457, 36: 1294 / 215}
# Width: a d=256 token costs 560/1294 = 0.43 of a d=512 one on the CPU. An H100 at these sizes is partly
# launch-bound, so the GPU gain from halving the width is taken as at most 1/0.7.
CPU_WIDTH_RATIO = {256: 560 / 1294, 512: 1.0}
GPU_WIDTH_FLOOR = 0.7
# Aggregate throughput of K training processes sharing the GPU, relative to one (assumed, to be replaced by
# a measurement: every result file records its tokens/s and its --jobs)
JOBS_SPEEDUP = {1: 1.0, 2: 1.6, 3: 2.0, 4: 2.3, 6: 2.6, 8: 2.8}
EPOCHS_EXPECTED = 25  # mean epochs to the patience stop (assumed; replaced by measured means when known)
PROCESS_START_S = 10.0  # python + fairseq + CUDA start of one fairseq process on the device
VALID_SAVE_S_PER_LAYER = 0.03  # dev loss + checkpoint_last/best per epoch, seconds per layer of a stack


def depth_cost(depth: int) -> float:
    """Time per token at ``depth`` relative to 6 layers (:data:`CPU_DEPTH_COST`, piecewise linear)."""
    pts = sorted(CPU_DEPTH_COST.items())
    lo, hi = (pts[0], pts[1]) if depth <= pts[1][0] else (pts[-2], pts[-1])
    for p, q in zip(pts, pts[1:], strict=False):
        if p[0] <= depth <= q[0]:
            lo, hi = p, q
    return max(lo[1] + (hi[1] - lo[1]) * (depth - lo[0]) / (hi[0] - lo[0]), 0.1)


def h100_tokens_per_s(depth: int, dim: int) -> float:
    """Estimated target tokens/s of one fairseq-train process on an H100 (fp16/bf16), see above."""
    width = max(CPU_WIDTH_RATIO.get(dim, (dim / 512) ** 2), GPU_WIDTH_FLOOR) if dim < 512 else (dim / 512) ** 2
    return H100_TPS_D512[6] / (width * depth_cost(depth))


def jobs_speedup(jobs: int) -> float:
    known = sorted(JOBS_SPEEDUP)
    return JOBS_SPEEDUP[max(k for k in known if k <= jobs)] if jobs >= 1 else 1.0


def estimate_cell_s(cell: Cell, dim: int, epochs: float, tokens_per_s: float | None = None) -> float:
    """GPU seconds of one cell: training at ``tokens_per_s`` (default: :func:`h100_tokens_per_s`, one
    process alone) + per-epoch validation/saving + 4 process starts (train, dev probe, test2016,
    test2017) + decoding 3,014 sentences."""
    train = epochs * M30K_TARGET_TOKENS / (tokens_per_s or h100_tokens_per_s(cell.depth, dim))
    per_epoch = epochs * (1.0 + VALID_SAVE_S_PER_LAYER * cell.depth)
    decode = 4 * PROCESS_START_S + 10 + 0.8 * cell.depth
    return train + per_epoch + decode


def estimate_chunk(cells: Sequence[Cell], dim: int, jobs: int, epochs: Dict[int, float] | None = None) -> float:
    """Estimated GPU minutes of ``cells`` with ``jobs`` processes sharing one H100; ``epochs`` maps a
    depth to measured mean epochs (default :data:`EPOCHS_EXPECTED`)."""
    epochs = epochs or {}
    total = sum(estimate_cell_s(c, dim, epochs.get(c.depth, EPOCHS_EXPECTED)) for c in cells)
    longest = max((estimate_cell_s(c, dim, epochs.get(c.depth, EPOCHS_EXPECTED)) for c in cells), default=0.0)
    # K jobs share the GPU; the chunk cannot end before its longest cell
    return max(total / jobs_speedup(min(jobs, len(cells))), longest) / 60


def update_freq(max_tokens: int, limit: int | None) -> Tuple[int, int]:
    """(tokens per forward, --update-freq) so that each forward stays within ``limit`` tokens and
    their product is the regime's batch."""
    if not limit or max_tokens <= limit:
        return max_tokens, 1
    freq = math.ceil(max_tokens / limit)
    return math.ceil(max_tokens / freq), freq
