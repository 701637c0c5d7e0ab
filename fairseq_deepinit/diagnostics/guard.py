"""The divergence guard of the diagnostics criteria: its per-run state, the report it ends training with,
and ``--diagnostics-inject-nan`` (for testing it).

When the loss or the gradients go non-finite in a way fairseq's fp16/AMP loss scaling does not absorb,
:func:`divergence_report` replays the update's batches with hooks (under the autocast state the
update's forward ran in, so that a bf16- or fp16-only overflow overflows again) and names the first
layer, in forward order, whose output went non-finite, the non-finite weights and the first layer with
non-finite gradients. The criterion (:mod:`.criterion`) decides when; this module says what.
"""

from __future__ import annotations

import difflib
import math
from contextlib import ExitStack
from typing import Dict, List

import torch
import torch.nn as nn
from fairseq.models import BaseFairseqModel

from ..errors import DeepInitConfigError
from ..modules.autocast_state import AutocastState
from . import hooks
from .stats import first_nonfinite_output, grad_norms_per_layer, layer_key, nonfinite_parameters


class RunState:
    """Per-run state kept outside ``nn.Module`` attributes (a model stored on the criterion would
    become one of its sub-modules, and fairseq would save and all-reduce it as the criterion's)."""

    def __init__(self) -> None:
        self.update_num = -1
        self.collect = False
        self.samples: List[dict] = []
        self.model: nn.Module | None = None
        self.optimizer = None
        self.last_loss: torch.Tensor | None = None
        self.precision: AutocastState | None = None  # autocast state of the update's forward, for the replay
        self.grad_norm: torch.Tensor | float | None = None  # the last clip's total norm, on the device
        self.step_open = False  # clipped, optimizer step not yet taken
        self.grad_stats: Dict[str, torch.Tensor] | None = None  # this update's per-layer norms (device)
        self.diverged = False
        self.injected = False
        self.warned_sharded = False
        self.metrics_dirty = False


def unwrap_model(model: nn.Module) -> nn.Module:
    """The fairseq model inside DDP / ModuleProxy wrappers."""
    while not isinstance(model, BaseFairseqModel) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _data_parallel_size() -> int:
    """Number of ranks whose gradients are averaged into this one's (1 outside distributed training)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _parse_inject(spec: str) -> tuple | None:
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0].isdigit() or int(parts[0]) < 1 or not parts[1]:
        raise DeepInitConfigError(
            f"--diagnostics-inject-nan {spec!r}: expected UPDATE:PARAM or UPDATE:PARAM:after with UPDATE >= 1, "
            "e.g. 5:encoder.layers.0.fc1.weight"
        )
    when = parts[2] if len(parts) == 3 else "before"
    if when not in ("before", "after"):
        raise DeepInitConfigError(
            f"--diagnostics-inject-nan {spec!r}: the third field must be 'after' (or absent), e.g. "
            f"{parts[0]}:{parts[1]}:after"
        )
    return int(parts[0]), parts[1], when


def check_inject_target(model: nn.Module, p_name: str) -> None:
    """Refuse a ``--diagnostics-inject-nan`` parameter the model does not have, naming close matches."""
    names = [n for n, _ in unwrap_model(model).named_parameters()]
    if p_name in names:
        return
    close = difflib.get_close_matches(p_name, names, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}?" if close else f"names look like {', '.join(names[:3])}."
    raise DeepInitConfigError(
        f"--diagnostics-inject-nan: the model has no parameter {p_name!r}; {hint} Give UPDATE:PARAM with a "
        "parameter name of this model (as model.named_parameters() lists them)"
    )


def divergence_report(run: RunState, reason: str, replay: bool) -> str:
    """The guard's report (several lines) for an update that diverged because of ``reason``; ``replay``:
    replay the update's batches to find the first layer whose output went non-finite."""
    run.diverged = True
    run.collect = False
    model = run.model
    lines = [f"divergence guard: training stopped at update {run.update_num + 1}: {reason}."]
    culprit = None
    first_sub = None
    if replay and run.samples and model is not None:
        res = hooks.ResidualStatistics(model) if hooks.residual_modules(model) else None
        with ExitStack() as stack:
            if res is not None:
                stack.enter_context(res)
            if run.precision is not None:  # a bf16/fp16-only overflow must overflow again
                stack.enter_context(run.precision.applied())
            culprit = first_nonfinite_output(model, lambda: [model(**s["net_input"]) for s in run.samples])
        if res is not None:
            for sub, v in res.variances().items():
                if not (math.isfinite(v["branch"]) and math.isfinite(v["skip"])):
                    first_sub = (sub, v)
                    break
    # say so when the replay ran under autocast: the same batch may be finite in fp32
    under = f"replayed under {run.precision.describe()}" if run.precision and run.precision.enabled else ""
    if culprit is not None:
        line = f"First layer whose statistics went non-finite (forward order): {layer_key(culprit + '._')}"
        line += f" (first module with a NaN/Inf output: {culprit}"
        if first_sub is not None:
            sub, v = first_sub
            line += f"; first sub-layer: {sub}, Var(branch)={v['branch']:.4g}, Var(skip)={v['skip']:.4g}"
        lines.append(line + (f"; {under}" if under else "") + ").")
    elif model is not None:
        grads = grad_norms_per_layer(model)
        bad = [k for k, v in grads.items() if not math.isfinite(v)]
        if bad:
            lines.append(
                f"The forward pass is finite{f' ({under})' if under else ''}; the gradients first go non-finite "
                f"(forward order) in layer "
                f"{bad[0]} ({len(bad)} of {len(grads)} layers affected)."
            )
            world = _data_parallel_size()
            if world > 1:
                # DDP all-reduces gradients, so another rank's batch or weights can be the source
                lines.append(
                    f"This rank's forward pass is finite, but its gradients are averaged over {world} "
                    "data-parallel ranks: the other ranks' reports name the source."
                )
    bad_params = nonfinite_parameters(model) if model is not None else []
    if bad_params:
        more = f" and {len(bad_params) - 5} more" if len(bad_params) > 5 else ""
        lines.append(f"Non-finite weights: {', '.join(bad_params[:5])}{more}.")
    lines.append(
        "No checkpoint is written from this state, so checkpoint_last.pt (if any) holds the last good one. "
        "To go on, resume from it with a lower --lr, a longer --warmup-updates, --clip-norm, or a "
        "deep-Transformer scheme (see docs/diagnostics.md)."
    )
    return "\n".join(lines)
