#!/usr/bin/env python
"""Progress of a running fairseq-generate: sentences translated of the total, while it translates.

fairseq-generate prints nothing useful until it is done when its output goes to a file (its tqdm
bar goes to stderr, which the quickstart keeps in a log, and its log lines go into the output
itself). This filter sits on its stdout: every line is copied to the output file unchanged, and
each time another tenth of the sentences (``--every``) has a hypothesis it prints one line such as
``[translate] 320/623 sentences (51%), 42 s, 7.6 sentences/s, about 40 s left``.

The total is ``--total`` (the caller knows its test set); without it, the translation task's own log
line (``... test de-en 623 examples``) when fairseq's log goes to the same stream, else none (then
the lines count sentences only). Use it in a pipe::

    fairseq-generate ... 2> generate.log | python scripts/generate_progress.py generate-test.txt --total 623
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Sequence

# bytes, not text: the output file must be byte-identical to what fairseq-generate wrote
_TOTAL = re.compile(rb"\| fairseq\.tasks\.\w+ \| .* (\d+) examples$")
_HYPO = re.compile(rb"^H-(\d+)\t")
PARTS = 10  # default report interval: a tenth of the sentences (about as often as training logs)


def relay(
    lines: Iterable[bytes],
    out: BinaryIO,
    report: Callable[[str], None],
    total: int | None = None,
    every: int | None = None,
    label: str = "translate",
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Copy ``lines`` to ``out`` unchanged and ``report`` progress; returns the sentences translated.

    A sentence counts once, at its first ``H-`` line (``--nbest`` prints several). ``every``
    defaults to a tenth of ``total`` (or 100 while the total is unknown)."""
    start = clock()
    seen: set = set()
    next_at = None
    for line in lines:
        out.write(line)
        if total is None:
            m = _TOTAL.search(line.rstrip(b"\r\n"))
            if m:
                total = int(m.group(1))
        m = _HYPO.match(line)
        if not m or m.group(1) in seen:
            continue
        seen.add(m.group(1))
        step = every or (max(1, -(-total // PARTS)) if total else 100)
        if next_at is None:
            next_at = step
        done = len(seen)
        if done >= next_at or done == total:
            out.flush()  # the file is complete up to what the progress line says
            next_at = (done // step + 1) * step
            report(_progress_line(label, done, total, clock() - start))
    out.flush()
    return len(seen)


def _progress_line(label: str, done: int, total: int | None, elapsed: float) -> str:
    rate = done / elapsed if elapsed > 0 else 0.0
    if not total:
        return f"[{label}] {done} sentences, {elapsed:.0f} s, {rate:.1f} sentences/s"
    left = f", about {(total - done) / rate:.0f} s left" if rate > 0 and done < total else ""
    return f"[{label}] {done}/{total} sentences ({100 * done // total}%), {elapsed:.0f} s, {rate:.1f} sentences/s{left}"


def build_parser() -> argparse.ArgumentParser:
    """The command line of the filter."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output", type=Path, help="file that receives fairseq-generate's stdout, unchanged")
    p.add_argument(
        "--total",
        type=int,
        default=None,
        help="sentences to translate (default: from fairseq's 'N examples' log line if it is in the stream)",
    )
    p.add_argument(
        "--every",
        type=int,
        default=None,
        help=f"report every N sentences (default: a tenth of the total, 1/{PARTS}; 100 if the total is unknown)",
    )
    p.add_argument("--label", default="translate", help="prefix of the progress lines (default: %(default)s)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        out = open(a.output, "wb")
    except OSError as e:
        print(f"error: cannot write {a.output} ({e.strerror}): choose a writable path", file=sys.stderr)
        return 1
    with out:
        relay(sys.stdin.buffer, out, lambda msg: print(msg, flush=True), a.total, a.every, a.label)
    return 0
