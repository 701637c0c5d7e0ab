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
``exp_avg_sq``, ``step`` per parameter; fairseq-train resumes only with the optimizer class it saved,
unless given ``--reset-optimizer``). Gradient clipping (and the norm
fairseq logs as ``gnorm``) is taken the same way, with one ``_foreach_norm`` instead of a norm per
tensor (:meth:`FairseqAdamForeach.clip_grad_norm`).
"""

import math
from collections import defaultdict
from typing import Dict, List, Tuple

import torch
from fairseq.optim import register_optimizer
from fairseq.optim.adam import FairseqAdam, FairseqAdamConfig
from fairseq.optim.fairseq_optimizer import FairseqOptimizer

from ..errors import DeepInitConfigError

_HALF = (torch.float16, torch.bfloat16)


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

    def _state(self, p: torch.Tensor, p32: torch.Tensor, amsgrad: bool) -> dict:
        state = self.state[p]
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
        if len(state) == 0:
            state["step"] = 0
            for k in keys:
                state[k] = torch.zeros_like(p32)
        else:  # a loaded state may sit on another device or in another dtype, as fairseq's Adam allows
            for k in keys:
                state[k] = state[k].to(p32)
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
                state = self._state(p, p32, amsgrad)
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


@register_optimizer("adam_foreach", dataclass=FairseqAdamConfig)
class FairseqAdamForeach(FairseqAdam):
    """``--optimizer adam_foreach``: ``adam``'s options and state, :class:`AdamForeach`'s arithmetic."""

    def __init__(self, cfg: FairseqAdamConfig, params) -> None:
        FairseqOptimizer.__init__(self, cfg)  # not FairseqAdam's: it would build apex's or the per-tensor Adam
        if getattr(cfg, "fp16_adam_stats", False):
            raise DeepInitConfigError(
                "--fp16-adam-stats needs apex's FusedAdamV1: use --optimizer adam, or drop --fp16-adam-stats"
            )
        self._optimizer = AdamForeach(params, **self.optimizer_config)

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
