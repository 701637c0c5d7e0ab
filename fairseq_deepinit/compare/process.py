"""Running one ``fairseq-train`` (or any command) as a child process, its output appended to a log file:
stopped at a deadline (SIGTERM, then SIGKILL: fairseq resumes from ``checkpoint_last.pt``), polled for
progress while it runs, and measured (peak resident memory, from the kernel's accounting of that child
alone, ``wait4``), and the CPU it runs on (:func:`cpu_name`). Shared by ``deepinit-compare`` and the Multi30k
matrix's cells."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Mapping, Sequence

_procs: Dict[int, subprocess.Popen] = {}
_lock = threading.Lock()
POLL_S = 5.0


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s model name) and core count, else what :mod:`platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class Finished:
    """How a child ended: ``returncode`` (None: stopped at the deadline), wall seconds and its peak
    resident set size in MiB (``ru_maxrss``; None where the platform does not say)."""

    returncode: int | None
    wall_s: float
    peak_rss_mib: float | None


def _wait(proc: subprocess.Popen, timeout: float) -> tuple | None:
    """``(status, rusage)`` of ``proc`` once it ends within ``timeout`` seconds, else None."""
    end = time.time() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage
        if time.time() >= end:
            return None
        time.sleep(min(0.2, max(0.0, end - time.time())))


def run_logged(
    cmd: Sequence[str],
    log_path: Path,
    env: Mapping[str, str],
    deadline: float | None = None,
    cwd: Path | None = None,
    on_poll: Callable[[], None] | None = None,
    poll_s: float = POLL_S,
) -> Finished:
    """Run ``cmd`` appending stdout and stderr to ``log_path``; calls ``on_poll`` every ``poll_s``
    seconds while it runs; stops it at ``deadline`` (``time.time()``), SIGTERM then SIGKILL after 20 s."""
    start = time.time()
    with open(log_path, "a", encoding="utf-8") as f:
        proc = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT, env=dict(env), cwd=cwd)
        with _lock:
            _procs[proc.pid] = proc
        try:
            while True:
                done = _wait(proc, poll_s)
                if done is not None:
                    rc, usage = done
                    return Finished(rc, round(time.time() - start, 1), round(usage.ru_maxrss / 1024, 1))
                if on_poll is not None:
                    on_poll()
                if deadline is not None and time.time() > deadline:
                    proc.send_signal(signal.SIGTERM)
                    done = _wait(proc, 20)
                    if done is None:
                        proc.kill()
                        done = _wait(proc, 60)
                    usage = done[1] if done else None
                    peak = round(usage.ru_maxrss / 1024, 1) if usage else None
                    return Finished(None, round(time.time() - start, 1), peak)
        finally:
            with _lock:
                _procs.pop(proc.pid, None)
