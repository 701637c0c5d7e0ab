"""Run fairseq's CLI entry points in fresh processes without paying fairseq's import each time.

Importing fairseq takes ~4 s of CPU (it imports every task, model and criterion, sklearn included),
more than a tiny 100-update training run. :func:`run_forked` runs ``fairseq_cli.<tool>.cli_main`` --
the function the ``fairseq-<tool>`` console scripts call -- with ``sys.argv`` set, in a process
forked from a multiprocessing fork server that has imported fairseq and nothing else. Each call is
its own process, as from the shell: the plugin is imported only through ``--user-dir`` in that
process, registries and the torch allow-list start from fairseq's import-time state, and nothing
leaks between calls. This module deliberately imports neither fairseq nor the plugin itself.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

# fairseq_cli.train first: it configures logging (format, stdout) before fairseq is imported, as the CLI does
PRELOAD = ["fairseq_cli.train", "fairseq_cli.generate"]
_context = None
REFUSAL: str | None = None  # set (by conftest) while a fast-tier test runs: no fairseq process then


def _context_with_preload():
    global _context
    if _context is None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # read by torch when the server imports it
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _child(tool: str, argv: list, log_path: str, threads: int) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import torch

    torch.set_num_threads(threads)
    sys.argv = [f"fairseq-{tool}", *argv]
    importlib.import_module(f"fairseq_cli.{tool}").cli_main()


def run_forked(tool: str, *args, log: str | os.PathLike, timeout: int = 600) -> subprocess.CompletedProcess:
    """``fairseq-<tool> args...`` in a forked process; stdout+stderr go to ``log`` and ``.stdout``.

    Raises ``AssertionError`` with the command and the tail of the log when the tool fails.
    """
    if REFUSAL:
        raise AssertionError(f"{REFUSAL}: fairseq-{tool}")
    argv = [str(a) for a in args]
    ctx = _context_with_preload()
    proc = ctx.Process(target=_child, args=(tool, argv, str(log), int(os.environ.get("OMP_NUM_THREADS", "1"))))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"fairseq-{tool} {' '.join(argv)}\ntimed out after {timeout} s")
    out = Path(log).read_text(errors="replace") if Path(log).exists() else ""
    if proc.exitcode != 0:
        raise AssertionError(f"fairseq-{tool} {' '.join(argv)}\nexited {proc.exitcode}:\n{out[-4000:]}")
    return subprocess.CompletedProcess([f"fairseq-{tool}", *argv], proc.exitcode, stdout=out)
