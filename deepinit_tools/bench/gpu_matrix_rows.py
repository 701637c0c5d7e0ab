"""The rows of the GPU matrix (``throughput.py --gpu-matrix``): which configuration runs how and at what
depth, the targets, and what each row is compared with."""

from __future__ import annotations

import dataclasses
from typing import List, Mapping

from deepinit_tools.harness.fairseq_train import (
    Variant,
)

BASE = (512, 2048, 8)  # transformer base: d, FFN, heads
LAYERS, QUICK_LAYERS, QUICK_DIMS = (6, 18, 36), (1, 2), (64, 128, 2)
# the speed target, stated once (docs/speed.md and docs/benchmarks.md refer here): the plugin's
# fastest transformer-base 6-layer path at least 2x stock fairseq fp16 target tokens/s at equal batch, with
# the same loss curve (final training loss within LOSS_TOLERANCE of stock's)
INIT_ONLY = ("postln", "lipschitz", "smallinit", "ds-init", "preln")
FAST_TARGET, INIT_ONLY_TARGET, NORM_TARGET, LOSS_TOLERANCE = 2.0, 0.98, 1.0, 0.02
LR = 5e-4


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the matrix: a configuration of throughput.CONFIGS, how it runs, at what depth."""

    config: str
    variant: Variant
    layers: int

    @property
    def label(self) -> str:
        """The ``config`` column: ``plugin-sdpa-compile``, ``stock``..."""
        v = self.variant
        return "-".join(
            [
                self.config,
                *([v.attention] if v.attention != "fairseq" else []),
                *(["foreach"] if v.optimizer == "adam_foreach" else []),
                *(["compile"] if v.compile else []),
            ]
        )

    @property
    def key(self) -> str:
        return f"{self.label} {self.variant.precision} {self.layers}L"


def compile_pair(full: int) -> List[Row]:
    """The compiled row and its references: stock fp16 and the same path eager (``--compile-only``)."""
    eager = Variant("bf16-autocast", "sdpa", optimizer="adam_foreach")
    compiled = Variant("bf16-autocast", "sdpa", compile=True, optimizer="adam_foreach")
    return [Row("stock", Variant("fp16"), full), Row("plugin", eager, full), Row("plugin", compiled, full)]


def matrix(layers: List[int], compile_row: bool, full: int | None = None) -> List[Row]:
    """The rows of the matrix (see the module docstring): the whole set at depth ``full`` (default:
    the first of ``layers``), stock fp16 and the plugin's fp16 / bf16 SDPA paths at every other depth."""
    first, V = (layers[0] if full is None else full), Variant
    variants = [("stock", V("fp32")), ("stock", V("fp16")), ("stock-preln", V("fp16")), ("plugin", V("fp16")),
                ("plugin", V("fp16", "sdpa")), ("plugin", V("bf16-autocast")),
                ("plugin", V("bf16-autocast", "sdpa")),
                ("plugin", V("bf16-autocast", "sdpa", optimizer="adam_foreach"))]  # fmt: skip
    if compile_row:
        variants.append(("plugin", V("bf16-autocast", "sdpa", compile=True, optimizer="adam_foreach")))
    variants += [(name, V("fp16")) for name in (*INIT_ONLY, "preln-scalenorm")]
    rows = [Row(c, v, first) for c, v in variants] if first in layers else []
    deep = [("stock", V("fp16")), ("plugin", V("fp16", "sdpa")), ("plugin", V("bf16-autocast", "sdpa"))]
    return rows + [Row(c, v, n) for n in layers if n != first for c, v in deep]


def skip_reason(row: Row, device: str) -> str | None:
    """Why ``row`` cannot run on ``device`` (None: it can)."""
    if device == "cuda":
        return None
    if row.variant.precision in ("fp16", "amp"):
        return "skipped: fp16 needs CUDA (fairseq has no CPU half-precision training)"
    if row.variant.compile:
        return "skipped: the compile row runs on CUDA only (inductor on a CPU compiles for minutes)"
    return None


def baseline(row: Row, ok: Mapping[Row, object], configs: Mapping) -> Row | None:
    """Stock in fp16 at the same depth and norm position; stock fp32 where fp16 was not measured (CPU)."""
    ref = configs[row.config].ref
    for precision in ("fp16", "fp32"):
        cand = Row(ref, Variant(precision), row.layers)
        if cand in ok:
            return cand
    return None
