"""Child process of :func:`deepinit_tools.harness.fairseq_tools.run_tool`:
``python -m deepinit_tools.harness.child --clock cpu|wall TOOL ARGS``.

Runs ``fairseq-TOOL`` in this process and prints ``BENCH_PEAK rss_mib=.. cuda_mib=..`` last.
With ``--clock cpu`` fairseq's meters read this process's CPU time instead of the wall clock: on a
machine shared with other jobs the wall clock also counts the time spent waiting for a core.
"""

from __future__ import annotations

import importlib
import resource
import sys
import time
import types


def main(argv: list[str]) -> None:
    """Parse ``--clock CLOCK TOOL ARGS`` and run the tool."""
    if len(argv) < 3 or argv[0] != "--clock" or argv[1] not in ("cpu", "wall"):
        print("usage: child.py --clock cpu|wall TOOL [ARGS...]", file=sys.stderr)
        sys.exit(1)
    clock, tool, args = argv[1], argv[2], argv[3:]
    if clock == "cpu":
        from fairseq.logging import meters

        meters.time = types.SimpleNamespace(perf_counter=time.process_time)
    sys.argv = [f"fairseq-{tool}", *args]
    try:
        importlib.import_module(f"fairseq_cli.{tool}").cli_main()
    finally:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        cuda = "none"
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = f"{torch.cuda.max_memory_allocated() / 2**20:.1f}"
        print(f"BENCH_PEAK rss_mib={rss:.1f} cuda_mib={cuda}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
