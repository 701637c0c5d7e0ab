"""Interleaved timing rounds and their statistics (median, min-max, paired ratios).

Why interleaved: on a shared machine (and on a GPU whose clocks drift with temperature) the
speed of the hardware changes over minutes. Timing every case once per round, with the starting
case rotating from round to round, exposes all cases to the same drift; the ratio of two cases
*within* a round (paired) then cancels most of it, and the median over rounds drops the outliers.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Dict, List, Mapping, Sequence

Clock = Callable[[], float]


@dataclasses.dataclass(frozen=True)
class Clocks:
    """Where time is read: the wall clock, this process's CPU time, and a barrier run before each
    reading (``torch.cuda.synchronize`` on CUDA, where kernels run asynchronously to the host)."""

    wall: Clock = time.perf_counter
    cpu: Clock = time.process_time
    sync: Callable[[], None] = lambda: None


@dataclasses.dataclass(frozen=True)
class Stat:
    """Median and min-max spread of a list of samples (NaN for an empty list)."""

    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        if not values:
            nan = float("nan")
            return cls(nan, nan, nan, 0)
        return cls(statistics.median(values), min(values), max(values), len(values))

    def text(self, fmt: str = "{:.3f}") -> str:
        """``0.995 [0.981-1.010]`` (median [min-max]); ``n/a`` without samples."""
        if not self.n:
            return "n/a"
        return f"{fmt.format(self.median)} [{fmt.format(self.lo)}-{fmt.format(self.hi)}]"


def median(values: Sequence[float]) -> float:
    """The median, NaN for an empty list (a report prints ``nan`` instead of crashing)."""
    return statistics.median(values) if values else float("nan")


def rotation(names: Sequence[str], round_index: int) -> List[str]:
    """The order of round ``round_index``: ``names`` started ``round_index`` places later."""
    if not names:
        return []
    k = round_index % len(names)
    return [*names[k:], *names[:k]]


def paired_ratios(num: Sequence[float], den: Sequence[float]) -> List[float]:
    """Per-round quotients ``num[r] / den[r]`` (both lists must come from the same rounds)."""
    if len(num) != len(den):
        raise ValueError(f"paired ratios need the same rounds: {len(num)} against {len(den)} samples")
    return [a / b for a, b in zip(num, den, strict=True)]


@dataclasses.dataclass
class Rounds:
    """What :func:`interleave` measured: per case and round, the work done and the seconds taken."""

    names: List[str]
    work: Dict[str, List[float]]
    wall: Dict[str, List[float]]
    cpu: Dict[str, List[float]]
    orders: List[List[str]]

    def rates(self, name: str, clock: str = "wall") -> List[float]:
        """Work per second in every round (``clock``: ``wall`` or ``cpu``)."""
        seconds = self.wall[name] if clock == "wall" else self.cpu[name]
        return [w / s for w, s in zip(self.work[name], seconds, strict=True)]

    def ratios(self, name: str, baseline: str, clock: str = "wall") -> List[float]:
        """Per-round paired speed ratios of ``name`` against ``baseline``."""
        return paired_ratios(self.rates(name, clock), self.rates(baseline, clock))


def interleave(
    trials: Mapping[str, Callable[[], float]],
    rounds: int,
    warmup: int = 0,
    clocks: Clocks = Clocks(),
    on_round: Callable[[int, Rounds], None] | None = None,
) -> Rounds:
    """Time every trial once per round, the start rotating; returns the samples.

    ``trials`` maps a name to a function that does one trial and returns how much work it did
    (tokens, sentences). ``warmup`` untimed calls of every trial come first (lazy initialisation,
    allocator, kernel selection). ``on_round(r, rounds)`` is called after each round (progress).
    """
    if rounds <= 0:
        raise ValueError("rounds must be positive")
    names = list(trials)
    for name in names:
        for _ in range(warmup):
            trials[name]()
    out = Rounds(names, {n: [] for n in names}, {n: [] for n in names}, {n: [] for n in names}, [])
    for r in range(rounds):
        order = rotation(names, r)
        out.orders.append(order)
        for name in order:
            clocks.sync()
            w0, c0 = clocks.wall(), clocks.cpu()
            work = trials[name]()
            clocks.sync()
            out.wall[name].append(clocks.wall() - w0)
            out.cpu[name].append(clocks.cpu() - c0)
            out.work[name].append(float(work))
        if on_round is not None:
            on_round(r, out)
    return out
