"""Progress of a running fairseq-train: updates done of ``--max-update``, and the time left at this pace.

fairseq-train's log lines say how many updates are done (``num_updates=250``) but not how many remain nor
when the run will end. This filter sits on its output (stdout and stderr together): every line is copied
unchanged, and after a line whose update count passes another tenth of ``--max-update`` (or comes a
minute after the last report) it prints one line such as
``[train] 300/1500 updates (20%), 1 min 2 s, about 4 min 8 s left``. The pace is measured over the updates of
this process only (a resumed run starts from its checkpoint's count), so it holds on a busy machine too.
Use it in a pipe::

    fairseq-train ... 2>&1 | python scripts/train_progress.py --max-update 1500
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Callable, Iterable, TextIO

_UPDATES = re.compile(r"\bnum_updates[=\s|:]+(\d+)\b")
PARTS = 10  # a report each tenth of the updates ...
EVERY_S = 60.0  # ... or each minute, whichever comes first


def duration(seconds: float) -> str:
    """``62`` -> ``1 min 2 s``; ``3725`` -> ``1 h 2 min``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def progress_line(done: int, total: int, elapsed: float, rate: float | None) -> str:
    """``[train] done/total updates (pct%), elapsed, about T left`` (no estimate before a pace is measured)."""
    left = f", about {duration((total - done) / rate)} left" if rate and done < total else ""
    return f"[train] {done}/{total} updates ({100 * done // total}%), {duration(elapsed)}{left}"


def relay(
    lines: Iterable[str],
    out: TextIO,
    total: int,
    clock: Callable[[], float] = time.monotonic,
) -> int | None:
    """Copy ``lines`` to ``out``, adding a progress line each tenth of ``total`` or each minute; returns the last
    update count seen.

    The pace is (updates since the first count seen) / (seconds since then): the first count of a run may
    come from a resumed checkpoint or follow start-up work, neither of which says how fast updates go."""
    start = clock()
    first: tuple[int, float] | None = None
    last = None
    step = max(1, -(-total // PARTS))
    next_at, reported = step, start
    for line in lines:
        out.write(line)
        out.flush()  # a screen, not a file: fairseq's line shows when fairseq prints it
        m = _UPDATES.search(line)
        if not m or int(m.group(1)) == last:
            continue
        last, now = int(m.group(1)), clock()
        if first is None:
            first = (last, now)
        if last < next_at and now - reported < EVERY_S and last < total:
            continue
        next_at, reported = (last // step + 1) * step, now
        rate = (last - first[0]) / (now - first[1]) if now > first[1] and last > first[0] else None
        out.write(progress_line(last, total, now - start, rate) + "\n")
        out.flush()
    return last


def build_parser() -> argparse.ArgumentParser:
    """The command line of the filter."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-update", type=int, required=True, help="the run's --max-update")
    return p


def main(argv: list | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.max_update < 1:
        print(f"error: --max-update {a.max_update}: give a whole number >= 1", file=sys.stderr)
        return 1
    relay(sys.stdin, sys.stdout, a.max_update)
    return 0
