"""Running the real fairseq command-line tools as child processes, and reading their logs.

A child runs ``python -m deepinit_tools.harness.child TOOL ARGS``: fairseq-TOOL in that process, its
meters optionally on the process's CPU clock, and a last line with its peak memory. The parent
reads the peak RSS from ``wait4`` as well, so it is known even when the child dies.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Sequence

from deepinit_tools.paths import tools_env


@dataclasses.dataclass
class ToolRun:
    """Output (stdout and stderr merged) and peak memory of one fairseq tool run."""

    output: str
    peak_rss_mib: float
    peak_cuda_mib: float | None


def run_tool(
    tool: str,
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
    clock: str = "wall",
    cwd: Path | None = None,
) -> ToolRun:
    """Run ``fairseq-<tool> argv`` in a child process; raises SystemExit with its tail on failure.

    ``clock="cpu"``: fairseq's meters (``wps``, generation time) read the process's CPU time, which
    other jobs on a shared machine do not inflate. ``log``: the command and output are appended.
    """
    cmd = [sys.executable, "-m", "deepinit_tools.harness.child", "--clock", clock, tool, *map(str, argv)]
    # the tools and the plugin this process uses first on PYTHONPATH (never another copy)
    full_env = tools_env({**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
    proc = subprocess.Popen(cmd, env=full_env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if log is not None:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{output}\n")
    if code != 0:
        raise SystemExit(f"fairseq-{tool} exited {code}: {' '.join(cmd)}\n{output[-4000:]}")
    cuda = re.findall(r"BENCH_PEAK rss_mib=[\d.]+ cuda_mib=([\d.]+|none)", output)
    cuda_mib = float(cuda[-1]) if cuda and cuda[-1] != "none" else None
    return ToolRun(output, usage.ru_maxrss / 1024, cuda_mib)


def train_inner(output: str) -> List[Dict[str, float]]:
    """Every ``train_inner`` record of a fairseq-train log, ``--log-format json`` or ``simple``."""
    records = []
    for line in output.splitlines():
        if "train_inner" not in line:
            continue
        found = re.search(r"train_inner[ |:]+(\{.*\})", line)
        if found:
            rec = json.loads(found.group(1))
        else:
            rec = dict(re.findall(r"(\w+)=([-\d.e+]+)", line))
        records.append({k: float(v) for k, v in rec.items() if _is_number(v)})
    return records


def _is_number(value: object) -> bool:
    try:
        float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True
