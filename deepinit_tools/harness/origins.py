"""Whose code asked for an op: the line of Python behind an aten op, a host read or a graph break.

:func:`origin` sorts a file into ``plugin`` (fairseq_deepinit), ``fairseq``, ``torch`` or ``other``
(tests, benchmarks, Python itself); :func:`event` names the innermost frame outside torch, the harness
and any torch mode's handler (``fairseq_deepinit/modules/attention.py:203 (forward)``). Used by
:mod:`harness.host_reads`, :mod:`harness.op_counters` (products in an unexpected dtype) and
:func:`harness.counters.graph_breaks`.
"""

from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path
from typing import Sequence

import torch

_HARNESS = str(Path(__file__).resolve().parent)
_TORCH = str(Path(torch.__file__).resolve().parent).replace("\\", "/")


def origin(filename: str) -> str:
    """``plugin`` (fairseq_deepinit), ``fairseq``, ``torch`` or ``other`` (tests, benchmarks, Python)."""
    path = filename.replace("\\", "/")
    if "/fairseq_deepinit/" in path:
        return "plugin"
    if "/fairseq/" in path or "/fairseq_cli/" in path:
        return "fairseq"
    if path.startswith(_TORCH) or "/torch/" in path:
        return "torch"
    return "other"


# a torch function / dispatch mode's handler (a benchmark's recorder, wherever it is defined) passes the op on:
# the code that asked is its caller
_MODE_HANDLERS = ("__torch_function__", "__torch_dispatch__")


def user_frame(frames: Sequence[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame outside torch, this harness and any torch mode's handler: the code that asked for
    the op."""
    for frame in reversed(frames):
        passes_on = frame.filename.startswith((_HARNESS, "<")) or origin(frame.filename) == "torch"
        if not passes_on and frame.name not in _MODE_HANDLERS:
            return frame
    return None


def where(frame: traceback.FrameSummary | None) -> str:
    """``file:line (function)``, the path from the package or folder it belongs to."""
    if frame is None:
        return "?"
    path = Path(frame.filename)
    parts = path.parts
    for anchor in ("fairseq_deepinit", "fairseq", "benchmarks", "tests"):
        if anchor in parts:
            path = Path(*parts[parts.index(anchor) :])
            break
    return f"{path.as_posix()}:{frame.lineno} ({frame.name})"


@dataclasses.dataclass(frozen=True)
class Event:
    """One op of interest: the aten op, whose code asked for it, and the line (``file:line (function)``)."""

    op: str
    origin: str
    where: str


def event(op: str) -> Event:
    """An :class:`Event` for ``op``, asked for by the current Python stack."""
    frame = user_frame(traceback.extract_stack()[:-1])
    return Event(op, origin(frame.filename) if frame else "torch", where(frame))


def op_name(func) -> str:
    """An aten op's base name: ``aten::addmm`` -> ``addmm``."""
    return func._schema.name.split("::", 1)[-1]
