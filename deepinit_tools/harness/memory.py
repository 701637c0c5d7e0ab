"""Peak memory: CPU resident-set growth (in a forked child or in-process) and CUDA allocations.

CPU: Linux's ``VmHWM`` (peak RSS) is reset through ``/proc/self/clear_refs`` before the measured
work, and the growth over the RSS at that moment is reported. glibc's mmap threshold is fixed in
a forked child so that freed tensors leave the RSS instead of staying in the heap: the figure is
then close to the peak of live allocations. CUDA: ``torch.cuda.max_memory_allocated`` growth
(tensors only; the caching allocator's reserve and the CUDA context are not counted).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import resource
from typing import Callable, Iterator

MIB = 2**20


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _libc(name: str, *args: int) -> None:
    try:
        getattr(ctypes.CDLL("libc.so.6"), name)(*args)
    except (OSError, AttributeError):  # not glibc: nothing to tune or give back
        pass


class PeakBox:
    """Filled in when the ``with`` block of a peak measurement ends: ``mib`` (None if unmeasurable)."""

    mib: float | None = None


@contextlib.contextmanager
def cpu_peak_rss() -> Iterator[PeakBox]:
    """Peak RSS growth (MiB) of the ``with`` block, in this process (Linux; None elsewhere)."""
    box = PeakBox()
    gc.collect()
    _libc("malloc_trim", 0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        base = _status_kb("VmRSS")
    except OSError:
        base = None
    yield box
    if base is not None:
        box.mib = (_status_kb("VmHWM") - base) / 1024


@contextlib.contextmanager
def cuda_peak() -> Iterator[PeakBox]:
    """Growth of ``torch.cuda.max_memory_allocated`` over the ``with`` block (MiB)."""
    import torch

    box = PeakBox()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    yield box
    torch.cuda.synchronize()
    box.mib = (torch.cuda.max_memory_allocated() - base) / MIB


def peak(device: str) -> contextlib.AbstractContextManager[PeakBox]:
    """The peak measurement of ``device`` (``cpu`` or ``cuda``)."""
    return cuda_peak() if device == "cuda" else cpu_peak_rss()


def cpu_peak_in_fork(work: Callable[[bool], None]) -> float:
    """Peak RSS growth (MiB) of ``work(True)`` in a forked child, after an unmeasured ``work(False)``.

    The child starts from the parent's state (imports, data loaded). The unmeasured call takes the
    one-off costs (lazy imports, kernel and allocator set-up) so that the measured call counts only
    what the work itself holds. The parent must not have run a multi-threaded torch op yet (OpenMP
    does not survive ``fork``): fork every child before building anything big. Raises
    ``RuntimeError`` with the child's error.
    """
    gc.collect()
    _libc("malloc_trim", 0)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must never return into the caller's code
        os.close(read_fd)
        code, msg = 0, ""
        try:
            _libc("mallopt", -3, 64 * 1024)  # M_MMAP_THRESHOLD: big blocks are unmapped on free
            work(False)
            with cpu_peak_rss() as box:
                work(True)
            msg = json.dumps({"mib": box.mib})
        except BaseException as e:  # noqa: BLE001  (reported by the parent)
            code, msg = 1, json.dumps({"error": f"{type(e).__name__}: {e}"})
        finally:
            os.write(write_fd, msg.encode())
            os.close(write_fd)
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        msg = f.read()
    os.waitpid(pid, 0)
    rec = json.loads(msg) if msg else {"error": "the child died without a word (killed for memory?)"}
    if "error" in rec:
        raise RuntimeError(rec["error"])
    return rec["mib"]


def children_peak_rss_mib() -> float:
    """Largest peak RSS of any waited-for child process so far (MiB; ``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
