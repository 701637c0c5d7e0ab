"""``--optimizer adam_foreach``: fairseq's ``adam`` update, applied to all parameters at once.

fairseq's ``--optimizer adam`` uses apex's FusedAdam when apex is installed and otherwise its own
``fairseq.optim.adam.Adam``, which loops over the parameters in Python: about ten kernels per
parameter tensor and step. Under ``--fp16`` that costs little (``FP16Optimizer`` flattens the fp32
master copy into one tensor), but fp32 weights (``--autocast-bf16``, fp32 training) have one tensor
per weight and bias: about 250 for transformer base at 6+6 layers, about 2,500 kernel launches per
update on a GPU without apex.

This optimizer computes exactly fairseq's rule (fairseq 0.12 ``fairseq/optim/adam.py``,
``Adam.step``: decoupled weight decay ``p -= lr * wd * p``, ``denom = sqrt(v) + eps``,
``step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)``, AMSGrad optional) with ``torch._foreach_*``
operations over every parameter of a group that share a step count, so the number of kernel
launches no longer grows with the number of tensors. The options are ``adam``'s (``--adam-betas``,
``--adam-eps``, ``--weight-decay``) and so is the layout of the optimizer state (``exp_avg``,
``exp_avg_sq``, ``step`` per parameter), so a run trained with ``adam`` resumes with ``adam_foreach``
and the other way round (:func:`accepted_history`, run by
:func:`fairseq_deepinit.patches.build_optimizer`). Gradient clipping (and the norm fairseq logs as
``gnorm``) is taken the same way, with one ``_foreach_norm`` instead of a norm per tensor
(:meth:`FairseqAdamForeach.clip_grad_norm`).

``--adam-betas`` is read as a Python literal (:func:`parse_adam_betas`), not with the ``eval()`` of
fairseq's ``FairseqAdam.optimizer_config`` (``fairseq/optim/adam.py``; with the plugin loaded,
``--optimizer adam`` reads it the same way, a patch of :mod:`fairseq_deepinit.patches`), and must be two finite
numbers in [0, 1): at beta1 = 1 the bias correction ``1 - beta1^t`` is 0 (a division by zero), at
beta2 = 1 ``sqrt(1 - beta2^t)`` is 0, so the step size is 0 and the model never trains, above 1 the
moving averages put a negative weight on the new gradient (and ``1 - beta2^t < 0`` has no square
root), below 0 they alternate in sign; ``torch.optim.Adam`` refuses the same range.
"""

import ast
import logging
import math
from collections import defaultdict
from collections.abc import Collection
from typing import Any, Dict, List, Tuple

import torch
from fairseq.optim import register_optimizer
from fairseq.optim.adam import FairseqAdam, FairseqAdamConfig
from fairseq.optim.fairseq_optimizer import FairseqOptimizer
from omegaconf import OmegaConf

from ..errors import DeepInitConfigError
from .param_groups import ScaledParamGroups

logger = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)
# fairseq's optimizer names (``Trainer.state_dict``: ``self.optimizer.__class__.__name__``) whose
# optimizer state has one layout: ``exp_avg``, ``exp_avg_sq`` (``max_exp_avg_sq``), ``step``
SAME_ADAM_STATE = frozenset({"FairseqAdam", "FairseqAdamForeach"})


def parse_adam_betas(value: Any) -> Tuple[float, float]:
    """``--adam-betas`` as two floats, each finite and in [0, 1) (module docstring), or a one-line error.

    A string is read with :func:`ast.literal_eval` (a tuple or list literal such as ``(0.9, 0.98)``
    or ``0.9,0.98``): nothing in it is executed. A list from a YAML config is taken as it is.
    """
    parsed: Any = None
    if isinstance(value, str):
        try:
            parsed = ast.literal_eval(value.strip())
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            parsed = None
    elif OmegaConf.is_config(value):
        parsed = OmegaConf.to_container(value)
    else:
        parsed = value
    numbers = (
        isinstance(parsed, (tuple, list))
        and len(parsed) == 2
        and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in parsed)
    )
    if not numbers:
        raise DeepInitConfigError(
            f"--adam-betas {value!r} is not a pair of numbers; give beta1 and beta2 as a literal, e.g. "
            "--adam-betas '(0.9, 0.98)'"
        )
    betas = (float(parsed[0]), float(parsed[1]))
    if not all(math.isfinite(b) and 0.0 <= b < 1.0 for b in betas):
        raise DeepInitConfigError(
            f"--adam-betas {value!r}: each beta must be >= 0 and < 1 (at beta1 = 1 Adam divides by 1 - beta1^t = 0, "
            "at beta2 = 1 its step size lr * sqrt(1 - beta2^t) / (1 - beta1^t) is 0); e.g. --adam-betas '(0.9, 0.98)'"
        )
    return betas


class AdamForeach(torch.optim.Optimizer):
    """fairseq's ``Adam`` (AdamW-style weight decay) with multi-tensor (``_foreach``) arithmetic."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad))

    @property
    def supports_memory_efficient_fp16(self) -> bool:
        return True

    @property
    def supports_flat_params(self) -> bool:
        return True

    def _state(self, p: torch.Tensor, p32: torch.Tensor, group: dict, amsgrad: bool) -> dict:
        state = self.state[p]
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        if len(state) == 0:
            state["step"] = 0
            for k in keys:
                state[k] = torch.zeros_like(p32)
        else:  # a loaded state may sit on another device or in another dtype, as fairseq's Adam allows
            for k in keys:
                state[k] = state[k].to(p32)
            if "step" not in state:  # apex's FusedAdam keeps the step per group (fairseq/optim/fused_adam.py:213)
                state["step"] = int(group.get("step", 0))
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            amsgrad = group.get("amsgrad", False)
            beta1, beta2 = group["betas"]
            # parameters that share a step count (all, unless some were added later) share the scalars
            buckets: Dict[int, List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("adam_foreach does not support sparse gradients")
                grad = p.grad.float() if p.grad.dtype in _HALF else p.grad
                p32 = p.float() if p.dtype in _HALF else p
                state = self._state(p, p32, group, amsgrad)
                state["step"] += 1
                buckets[state["step"]].append((p, p32, grad, state))
            for step, items in buckets.items():
                params32 = [x[1] for x in items]
                grads = [x[2] for x in items]
                exp_avgs = [x[3]["exp_avg"] for x in items]
                exp_avg_sqs = [x[3]["exp_avg_sq"] for x in items]
                torch._foreach_mul_(exp_avgs, beta1)
                torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
                if amsgrad:
                    maxes = [x[3]["max_exp_avg_sq"] for x in items]
                    torch._foreach_maximum_(maxes, exp_avg_sqs)
                    denom = torch._foreach_sqrt(maxes)
                else:
                    denom = torch._foreach_sqrt(exp_avg_sqs)
                torch._foreach_add_(denom, group["eps"])
                step_size = group["lr"] * math.sqrt(1 - beta2**step) / (1 - beta1**step)
                if group["weight_decay"] != 0:
                    torch._foreach_add_(params32, params32, alpha=-group["weight_decay"] * group["lr"])
                torch._foreach_addcdiv_(params32, exp_avgs, denom, value=-step_size)
                for p, p32, _, _ in items:
                    if p32 is not p:
                        p.copy_(p32)
        return loss


class _FairseqAdamForeach(FairseqAdam):
    """``adam``'s options and state, :class:`AdamForeach`'s arithmetic (:class:`FairseqAdamForeach` without
    the parameter groups)."""

    def __init__(self, cfg: FairseqAdamConfig, params) -> None:
        FairseqOptimizer.__init__(self, cfg)  # not FairseqAdam's: it would build apex's or the per-tensor Adam
        if getattr(cfg, "fp16_adam_stats", False):
            raise DeepInitConfigError(
                "--fp16-adam-stats needs apex's FusedAdamV1: use --optimizer adam, or drop --fp16-adam-stats"
            )
        self._optimizer = AdamForeach(params, **self.optimizer_config)

    @property
    def optimizer_config(self) -> Dict[str, Any]:
        """``FairseqAdam.optimizer_config`` with ``--adam-betas`` read by :func:`parse_adam_betas` (no ``eval``)."""
        lr = self.cfg.lr
        return {
            "lr": lr[0] if isinstance(lr, Collection) else lr,
            "betas": parse_adam_betas(self.cfg.adam_betas),
            "eps": self.cfg.adam_eps,
            "weight_decay": self.cfg.weight_decay,
        }

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        """fairseq's ``utils.clip_grad_norm_`` with the per-tensor norms taken by one ``_foreach_norm``.

        Without apex, fairseq takes one ``torch.norm`` per gradient tensor (and warns on a GPU); the
        total is the same 2-norm of the per-tensor fp32 norms. Mixture-of-experts parameters (an
        ``expert`` attribute) keep fairseq's own path.
        """
        grads = [p.grad.detach() for p in self.params if p.grad is not None]
        if len(grads) < 2 or any(hasattr(p, "expert") for p in self.params):
            return super().clip_grad_norm(max_norm, aggregate_norm_fn)
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        total_norm = torch.norm(torch.stack(norms))
        if aggregate_norm_fn is not None:
            total_norm = aggregate_norm_fn(total_norm)
        if max_norm > 0:
            clip_coef = (float(max_norm) / (total_norm + 1e-6)).clamp_(max=1)
            torch._foreach_mul_(grads, clip_coef)
        return total_norm


@register_optimizer("adam_foreach", dataclass=FairseqAdamConfig)
class FairseqAdamForeach(ScaledParamGroups, _FairseqAdamForeach):
    """``--optimizer adam_foreach``: ``adam``'s options and state, :class:`AdamForeach`'s arithmetic, and one
    param group per tagged parameter group with its lr/eps/weight-decay multipliers
    (:class:`~.param_groups.ScaledParamGroups`; depth-muP's groups). Without tags: one group, the same keys
    and state dict as fairseq's ``adam``."""


def accepted_history(history: Any, optimizer: Any) -> List[dict] | None:
    """The optimizer history under which a run resumes ``adam``'s optimizer state with ``adam_foreach`` (or
    the other way round), or None where fairseq's own check stays.

    fairseq's ``Trainer.load_checkpoint`` (fairseq 0.12.3 ``trainer.py``, lines 604-615) rebuilds
    the optimizer and then asserts that the class name saved in the checkpoint's last
    ``optimizer_history`` entry equals the new optimizer's. ``FairseqAdam`` and
    ``FairseqAdamForeach`` keep the same state and apply the same update, so for this pair the entry
    is replaced by a copy naming the new optimizer (the saved name is kept under
    ``resumed_from_optimizer``), and fairseq then loads the state as usual (the trainer's
    ``_optim_history`` is replaced by :func:`fairseq_deepinit.patches.build_optimizer`). Any other pair
    keeps fairseq's check. Under ``--fp16`` / ``--amp`` both are wrapped by the same fairseq class, whose
    name already matches.
    """
    if not history or optimizer is None or not isinstance(history[-1], dict):
        return None
    saved, current = history[-1].get("optimizer_name"), type(optimizer).__name__
    if saved == current or not {saved, current} <= SAME_ADAM_STATE:
        return None
    logger.info(f"resuming the optimizer state of {saved} with {current}: the same state and update rule")
    entry = {**history[-1], "optimizer_name": current, "resumed_from_optimizer": saved}
    return [*history[:-1], entry]
