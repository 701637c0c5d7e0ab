"""Where a result was measured (device, versions, date, command) and how it is written out.

Every JSON file and markdown table a benchmark writes embeds the device, the date and the exact
command line, so that a pasted table can always be traced back to the run that produced it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence


def command_line(script: str, argv: Sequence[str] | None = None) -> str:
    """The command as typed: ``OMP_NUM_THREADS=.. python benchmarks/<script> <argv>`` (shell-quoted)."""
    args = list(sys.argv[1:] if argv is None else argv)
    threads = os.environ.get("OMP_NUM_THREADS")
    prefix = f"OMP_NUM_THREADS={threads} " if threads else ""
    return prefix + shlex.join(["python", f"benchmarks/{script}", *args])


def describe_device(device: str) -> str:
    """``NVIDIA H100 80GB HBM3, 79.1 GiB`` on CUDA; ``<lscpu model name>, N cores`` on CPU."""
    if device == "cuda":
        import torch

        props = torch.cuda.get_device_properties(0)
        return f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
    model = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
        found = re.search(r"Model name:\s*(.+)", out)
        if found:
            model = found.group(1).strip()
    except OSError:  # no lscpu: the platform's name will do
        pass
    return f"{model}, {os.cpu_count()} cores"


def package_version(dist: str, module: str) -> str:
    """Installed version of ``dist`` (falling back to ``module.__version__``); ``unknown`` otherwise."""
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001  (any packaging oddity: the version is informative only)
        try:
            return getattr(__import__(module), "__version__", "unknown")
        except ImportError:
            return "unknown"


def environment(device: str, script: str, argv: Sequence[str] | None = None) -> dict:
    """The metadata every result carries: device, date (UTC), command, versions, threads."""
    import torch

    now = datetime.datetime.now(datetime.UTC)
    return {
        "device": device,
        "device_name": describe_device(device),
        "date": now.date().isoformat(),
        "time_utc": now.strftime("%H:%M"),
        "command": command_line(script, argv),
        "torch": torch.__version__,
        "fairseq": package_version("ve-fairseq", "fairseq"),
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """A GitHub markdown table; columns whose index is in ``right`` are right-aligned (numbers)."""
    rule = ["---:" if i in right else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {row!r} has {len(row)} cells, the header {len(header)}")
        lines.append("| " + " | ".join("n/a" if c is None else str(c) for c in row) + " |")
    return "\n".join(lines)


def provenance(meta: Mapping[str, Any]) -> str:
    """The one-line header of a pasted table: device, versions, date and command."""
    return (
        f"Device: {meta['device_name']} ({meta['device']}, {meta['threads']} torch thread(s)); torch "
        f"{meta['torch']}, fairseq {meta['fairseq']}, Python {meta['python']}; {meta['date']} "
        f"{meta.get('time_utc', '')} UTC.\nCommand: `{meta['command']}`"
    )


def write_json(path: Path | None, payload: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    """Write ``{"meta": meta, **payload}`` to ``path`` (nothing if None); NaN becomes null."""
    if path is None:
        return
    doc = {"meta": dict(meta), **payload}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_nan_to_none(doc), indent=1) + "\n")


def write_markdown(path: Path | None, text: str) -> None:
    """Write a markdown report (nothing if ``path`` is None)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.rstrip("\n") + "\n")


def _nan_to_none(obj: Any) -> Any:
    # strict JSON has no NaN: a missing measurement is null
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    return obj
