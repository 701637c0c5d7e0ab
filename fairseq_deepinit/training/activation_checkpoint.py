"""``--checkpoint-activations`` whose recompute runs under the forward's autocast state.

fairseq's ``checkpoint_wrapper`` (fairseq 0.12 ``fairseq/modules/checkpoint_activations.py:14-39``)
runs a layer under ``torch.no_grad()`` in the forward pass and again, with the forward's RNG state
restored, in the backward pass (``CheckpointFunction.backward``, ``:211-222``). That second run is
inside ``torch.enable_grad()`` only: the autocast state of the forward is not saved, and the backward
pass runs outside ``torch.autocast`` (as PyTorch recommends, and as ``--autocast-bf16`` does). Under
``--autocast-bf16`` the layer was therefore recomputed in fp32: the gradients were those of another
function than the loss (every matrix product of the recompute and of the layer's backward in fp32,
26 addmm and 70 mm of them in the 2+2-layer test model), and on a GPU the recompute left the tensor
cores.

:func:`checkpoint_wrapper` is fairseq's, with one change: the function that ``CheckpointFunction``
stores and recomputes (fairseq's ``_checkpointed_forward``, ``:55-72``, passes it on as
``run_function``) is the layer's forward bound to the :class:`~fairseq_deepinit.modules.autocast_state.AutocastState` of
the moment the layer is called, as ``torch.utils.checkpoint`` binds its recompute to the saved
autocast state. In the forward pass that state is the one already active, so the first run is
unchanged; in the backward pass the recompute runs in the forward's dtypes, and with fairseq's RNG
replay its dropout masks are the forward's.

Why not ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: it saves the autocast state, but
it has no equivalent of fairseq's ``offload_to_cpu`` (``--offload-activations`` moves the saved layer
inputs to the CPU), and it changes what the recompute keeps alive and when (saved-tensor hooks instead
of a reentrant backward), which fairseq's FSDP wrapping (``fsdp_wrap`` around the checkpointed layer)
and ``unwrap_checkpoint`` (``precheckpoint_forward``) were written against. Keeping fairseq's
``CheckpointFunction`` keeps all of that, keyword arguments and non-tensor outputs included, and
changes only the state the recompute runs under.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn as nn
from fairseq.modules import checkpoint_activations as fairseq_checkpoint

from ..modules.autocast_state import AutocastState


def checkpoint_wrapper(module: nn.Module, offload_to_cpu: bool = False) -> nn.Module:
    """fairseq's ``checkpoint_wrapper`` (same attributes, so fairseq's ``unwrap_checkpoint`` undoes it),
    recomputing under the forward's autocast state (module docstring)."""
    if hasattr(module, "precheckpoint_forward"):
        raise ValueError(f"{type(module).__name__} is already wrapped for activation checkpointing")
    module.precheckpoint_forward = module.forward
    module.forward = functools.partial(_checkpointed_forward, module.precheckpoint_forward, offload_to_cpu)
    return module


def _checkpointed_forward(original_forward: Callable, offload_to_cpu: bool, *args: Any, **kwargs: Any) -> Any:
    state = AutocastState.capture((*args, *kwargs.values()))
    run = functools.partial(_run_under, state, original_forward)
    return fairseq_checkpoint._checkpointed_forward(run, offload_to_cpu, *args, **kwargs)


def _run_under(state: AutocastState, forward: Callable, *args: Any, **kwargs: Any) -> Any:
    with state.applied():
        return forward(*map(_as_activation, args), **{k: _as_activation(v) for k, v in kwargs.items()})


def _as_activation(x: Any) -> Any:
    """A view of a leaf that requires grad: how autocast sees the layer input in a run without checkpointing.

    The recompute gets its inputs as detached leaves that require grad, and autocast caches the
    low-precision cast of such a tensor as it does a weight's (``cached_cast`` in
    ``aten/src/ATen/autocast_mode.h``: ``requires_grad && is_leaf && !is_view``). One cast shared by
    the q, k and v projections would sum their input gradients in bf16; without checkpointing each
    use casts the activation on its own and the sum is fp32. A view is not cached, so the recompute
    computes the gradients of the run without checkpointing, in the same dtypes.
    """
    if isinstance(x, torch.Tensor) and x.is_leaf and x.requires_grad:
        return x.view_as(x)
    return x
