"""CPU stand-ins for what a GPU suffers from, in one place for tests and ``benchmarks/gpu_readiness.py``;
each is measured without a GPU:

- host reads of device data (syncs): :class:`HostReads` (:mod:`harness.host_reads`);
- kernel launches, fused calls once: :class:`OpCounter`; the dtype of every matrix product:
  :class:`MatmulDtypeAudit` (:mod:`harness.op_counters`);
- the path, ``is_causal`` and mask of every attention call: :class:`AttentionCalls`
  (:mod:`harness.attention_calls`);
- graph breaks: :func:`graph_breaks` (``torch._dynamo.explain`` of a call, each break with its reason
  and whose code caused it); the ``meta`` device: :func:`to_meta`, :func:`tensors_to` (here).

Nothing here imports the plugin; a caller passes the model and the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List

import torch
import torch.nn as nn

from .attention_calls import AttentionCall, AttentionCalls, attention_kind
from .host_reads import READ_OPS, HostReads
from .op_counters import FUSED, MATMUL_OPS, MatmulDtypeAudit, OpCounter, is_matmul
from .origins import Event, origin, user_frame, where

# --- graph breaks -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    reason: str
    origin: str
    where: str


def graph_breaks(fn: Callable, *args, **kwargs) -> tuple[int, List[GraphBreak]]:
    """``torch._dynamo.explain(fn)(*args, **kwargs)``: the number of graphs and every break, by origin.

    A break's origin is the innermost frame of its user stack outside torch: the code whose line
    dynamo could not put into the graph.
    """
    import torch._dynamo

    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args, **kwargs)
    breaks = []
    for br in explained.break_reasons:
        frame = user_frame(list(br.user_stack or []))
        reason = " ".join(str(br.reason).split())
        breaks.append(GraphBreak(reason[:300], origin(frame.filename) if frame else "torch", where(frame)))
    torch._dynamo.reset()
    return explained.graph_count, breaks


# --- the meta device --------------------------------------------------------------------------------


def to_meta(module: nn.Module) -> nn.Module:
    """``module`` with every parameter and buffer on ``meta`` (same shapes and dtypes, no data), in place."""
    return module.to_empty(device="meta")


def tensors_to(sample: Any, device: str | torch.device) -> Any:
    """Every tensor in a (nested) sample moved to ``device``; everything else kept."""
    if isinstance(sample, torch.Tensor):
        return sample.to(device)
    if isinstance(sample, dict):
        return {k: tensors_to(v, device) for k, v in sample.items()}
    if isinstance(sample, (list, tuple)):
        return type(sample)(tensors_to(v, device) for v in sample)
    return sample


__all__ = [
    "FUSED", "MATMUL_OPS", "READ_OPS", "AttentionCall", "AttentionCalls", "Event", "GraphBreak", "HostReads",
    "MatmulDtypeAudit", "OpCounter", "attention_kind", "graph_breaks", "is_matmul", "origin", "tensors_to", "to_meta",
]  # fmt: skip
