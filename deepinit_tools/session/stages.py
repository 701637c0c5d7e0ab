"""The stages of a GPU session, their commands, and how one wall-clock budget is shared out.

A device command runs at most 10 minutes; the session gets ``--budget-min`` of them (default 9.5,
counted from ``--t0``, the moment the command started, so the wheel install counts too). The stages
run in the order given; each gets a deadline (:meth:`Budget.deadline`):

- a timed stage (smoke test, speed rows, profile) gets its expected minutes times :data:`SLACK`, but
  never time that the stages after it need (their expected minutes; a *greedy* stage's minimum);
- a greedy stage (the packed cells) gets everything up to the budget's end less the expected
  minutes of the stages after it;
- a stage whose deadline leaves less than its minimum is skipped (recorded as such).

The first draw of a GPU runs :data:`FIRST`, a second draw :data:`SECOND` (its complement).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import List, Sequence

from deepinit_tools.paths import REPO

SLACK = 1.25  # a timed stage may overrun its expected minutes by this factor before it is stopped
DEFAULT_BUDGET_MIN = 9.5  # inside one device command's 10 minutes
# the cells' training logs and test translations, in the order the extras tarball keeps them when it is too big
CELL_EXTRAS = ("runs/*/train.log", "runs/*/generate-test20*.txt", "runs/*/generate-dev-greedy.txt")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage: what it measures, its expected minutes (H100 / CPU rehearsal), its result file."""

    name: str
    what: str
    minutes: float  # expected on an H100, as --plan estimates it (a greedy stage: its minimum)
    quick_minutes: float  # expected in the CPU rehearsal (--device cpu --quick) on 2 shared cores
    result: str  # its JSON, copied into the output folder as it is rewritten
    extras: tuple = ()  # files of its work folder that go into the extras tarball
    greedy: bool = False  # takes all the time the later stages leave
    depth: int = 0  # the cells' depth (greedy stages)

    def expected(self, quick: bool) -> float:
        return self.quick_minutes if quick else self.minutes


STAGES = {
    s.name: s
    for s in (
        Stage("smoke", "CUDA smoke test of every architecture: fp16 and bf16 steps, beam-4 decode, SDPA backend "
              "per attention kind, host syncs, matmul dtypes; every optimizer and training hook through fairseq's "
              "Trainer", 2.9, 3.0, "smoke.json", ("smoke.md",)),
        Stage("speed6", "6-layer speed rows (stock fp16/fp32 and the plugin's paths, transformer base, equal batch, "
              "interleaved) and the loss-curve check", 3.2, 1.0, "gpu-6l.json", ("gpu-6l.md",)),
        Stage("cells18", "the 18-layer paper cells trained side by side, each in its paper's regime", 2.5, 1.0,
              "cells-18l.json", CELL_EXTRAS, greedy=True, depth=18),
        Stage("speed-deep", "18- and 36-layer speed rows (stock fp16, the plugin's fp16 / bf16 SDPA paths)", 2.7,
              1.0, "gpu-18l-36l.json", ("gpu-18l-36l.md",)),
        Stage("compile", "the torch.compile row beside its eager twin and stock fp16 (6 layers)", 2.7, 0.7,
              "gpu-compile.json", ("gpu-compile.md",)),
        Stage("profile", "phases and torch.profiler of stock fp16 and the plugin's fast paths (6 layers, eager)", 1.2,
              0.7, "prof.json", ("prof.txt",)),
        Stage("cells6", "the 6-layer paper cells trained side by side, each in its paper's regime", 2.5, 1.0,
              "cells-6l.json", CELL_EXTRAS, greedy=True, depth=6),
    )
}  # fmt: skip
# what one device command returns: at most 8 files; a session writes session.json, session.log and
# extras.tar.gz besides one JSON per stage, and a copy in flight may leave one stray .tmp
MAX_STAGES = 4
FIRST = ("smoke", "speed6", "cells18")
SECOND = ("speed-deep", "compile", "profile", "cells6")


def parse_stages(text: str) -> List[Stage]:
    """``--stages``: comma-separated names, ``first`` or ``second``; ValueError naming the bad one."""
    names: List[str] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        names += FIRST if item == "first" else SECOND if item == "second" else [item]
    unknown = [n for n in names if n not in STAGES]
    if unknown or not names:
        raise ValueError(
            f"--stages {text!r}: unknown {', '.join(unknown) or 'empty list'}; choose from first, second, "
            + ", ".join(STAGES)
        )
    names = list(dict.fromkeys(names))
    if len(names) > MAX_STAGES:
        raise ValueError(f"--stages {text!r}: {len(names)} stages; at most {MAX_STAGES} in one device command "
                         "(it returns 8 files: one per stage, the session's three, a copy in flight)")  # fmt: skip
    return [STAGES[n] for n in names]


@dataclasses.dataclass
class Budget:
    """The session's wall clock: ``t0`` (Unix time the command started) plus ``minutes``."""

    t0: float
    minutes: float
    quick: bool = False

    @property
    def end(self) -> float:
        return self.t0 + 60 * self.minutes

    def deadline(self, stage: Stage, later: Sequence[Stage], now: float | None = None) -> float | None:
        """The Unix time ``stage`` must end by, or None when it is to be skipped (see the module docstring)."""
        now = time.time() if now is None else now
        reserve = 60 * sum(s.expected(self.quick) for s in later)
        latest = self.end - reserve
        if stage.greedy:
            deadline = latest
        else:
            deadline = min(now + 60 * SLACK * stage.expected(self.quick), latest)
        minimum = stage.expected(self.quick) * (1.0 if stage.greedy else 0.25)
        return deadline if deadline - now >= 60 * minimum else None


# ---------------------------------------------------------------------------------------------
# the commands of the script stages (the cells run in-process: deepinit_tools/session/cells.py)


def script_command(stage: Stage, opts, work: Path, deadline: float) -> List[str]:
    """The command of a timed stage: a benchmark script of ``benchmarks/``, writing into ``work``.

    ``opts``: ``device`` (cpu / cuda), ``quick`` (the CPU rehearsal's sizes), ``carry`` (the prepared
    data, :mod:`deepinit_tools.session.data`), ``smoke_only`` (architectures, empty: all). The speed
    rows get a ``--deadline-min`` that leaves time for what follows their timing rounds."""
    py, bench = sys.executable, REPO / "benchmarks"
    dev = ["--device", opts.device]
    if stage.name == "smoke":
        cmd = [py, str(bench / "gpu_smoke.py"), *dev, "--out-dir", str(work)]
        if opts.quick:
            cmd += ["--layers", "2", "--dim", "32", "--ffn", "64", "--heads", "2", "--batch", "4"]
        return cmd + (["--only", opts.smoke_only] if opts.smoke_only else [])
    data = ["--work-dir", str(opts.carry / "bench")]
    if stage.name == "profile":
        return [py, str(bench / "gpu_profile.py"), *dev, "--no-compile", *data, *(["--quick"] if opts.quick else []),
                "--json", str(work / "prof.json"), "--text", str(work / "prof.txt")]  # fmt: skip
    # the speed rows: throughput.py --gpu-matrix, one pass; after the timing rounds the 6-layer pass
    # runs its loss-curve check (about 40 s on an H100; --quick's 2 updates, seconds), the others only
    # write their files
    tail_s = 10 if opts.quick else {"speed6": 75, "speed-deep": 20, "compile": 30}[stage.name]
    soft = max(0.1, (deadline - time.time() - tail_s) / 60)
    cmd = [py, str(bench / "throughput.py"), "--gpu-matrix", *dev, *data, "--deadline-min", f"{soft:.2f}"]
    if opts.quick:
        cmd.append("--quick")
    if stage.name == "compile":
        cmd.append("--compile-only")
    else:
        full = ["1"] if opts.quick else ["6"]  # --quick's whole matrix is at 1 layer
        deep = ["2"] if opts.quick else ["18", "36"]
        cmd += ["--layers", *(full if stage.name == "speed6" else deep), "--no-compile"]
    stem = Path(stage.result).stem
    return cmd + ["--json", str(work / f"{stem}.json"), "--markdown", str(work / f"{stem}.md")]
