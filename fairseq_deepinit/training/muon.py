"""``--optimizer muon``: Muon (Jordan et al. 2024; "Muon is Scalable for LLM Training", Liu et al. 2025, arXiv
2502.16982, the Moonlight report) on the matrices of the hidden layers, AdamW on everything else, as Moonlight
releases it (MoonshotAI/Moonlight @ c2ad5b2 ``examples/toy_train.py``).

For a hidden matrix ``W`` (``A x B``) with gradient ``G`` (``Muon.step``, ``toy_train.py:175-203``)::

    M = mu M + G                          (momentum buffer)
    U = G + mu M  (Nesterov, default)     else  U = M
    O = NS5(U)                            (Newton-Schulz, below)
    W = W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O

``NS5`` (``zeropower_via_newtonschulz5``, ``toy_train.py:48-76``): ``X = U / (||U||_F + 1e-7)`` (transposed when
``A > B``), then ``steps`` times ``A_ = X X^T``, ``X = a X + (b A_ + c A_ A_) X`` with ``(a, b, c) = (3.4445,
-4.7750, 2.0315)``, in bfloat16 as released (``--muon-ns-fp32``: in the master weights' dtype). The factor
``0.2 sqrt(max(A, B))`` (``adjust_lr_for_muon``, ``toy_train.py:142-148``; the report's eq. 4) gives the update
the RMS of AdamW's (about 0.2), so AdamW's lr and weight decay carry over. Every other parameter (embeddings, a
tied or separate output projection, norms, biases: ``toy_train.py:293-304``) takes the released AdamW
(``toy_train.py:209-237``)::

    m = lerp(m, g, 1 - b1);  v = lerp(v, g^2, 1 - b2)
    W = W (1 - lr wd) - lr sqrt(1 - b2^t) / (1 - b1^t) * m / (eps + sqrt(v))

One lr (fairseq's scheduler) and one weight decay for both rules, as released. Which parameter is which is
decided from its role in the model (:func:`tag_roles`, run by :func:`fairseq_deepinit.patches.build_optimizer`
through :meth:`FairseqMuon.prepare_model` before fairseq builds the optimizer), carried on the parameter like
depth-muP's groups (:mod:`.param_groups`), so it survives fairseq's fp32 master copies. The training set-ups it
refuses and why: :func:`check_training_config`. The account (torch's own ``torch.optim.Muon``, cost): docs/schemes.md,
"Muon and MuonClip".
"""

import logging
import math
from collections.abc import Collection
from dataclasses import dataclass, field  # no `from __future__ import annotations`: fairseq reads real types
from typing import Any, Dict, List, Tuple

import torch
from fairseq.dataclass import FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer
from omegaconf import II
from torch import Tensor, nn

from ..errors import DeepInitConfigError
from .adam_foreach import parse_adam_betas
from .depth_mup import group_kinds
from .param_groups import GROUP_KEY, GroupScale, ScaledParamGroups, tag_parameter

logger = logging.getLogger(__name__)

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # toy_train.py:60
NS_EPS = 1e-7  # toy_train.py:65
RMS_MATCH = 0.2  # toy_train.py:146: AdamW's update RMS
MUON, ADAMW = "muon", "adamw"  # the two groups (param_groups.TAG names)
MUON_KIND = "hidden_weight"  # depth_mup.group_kinds: a matrix of a stack's layers
_HALF = (torch.float16, torch.bfloat16)


def zeropower_via_newtonschulz5(g: Tensor, steps: int, bf16: bool = True) -> Tensor:
    """``NS5(g)`` (module docstring; ``toy_train.py:48-76``) computed in bfloat16 as released (``bf16=False``: in
    ``g``'s dtype), returned in that dtype."""
    a, b, c = NS_COEFFICIENTS
    x = g.bfloat16() if bf16 else g
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def adjusted_lr(lr: float, shape: torch.Size) -> float:
    """``lr * 0.2 * sqrt(max(A, B))`` of a parameter of ``shape`` (its first two sizes, ``toy_train.py:142-148``)."""
    a, b = shape[:2]
    return lr * RMS_MATCH * math.sqrt(max(a, b))


class Muon(torch.optim.Optimizer):
    """Muon and AdamW over param groups: a group whose ``use_muon`` is True is stepped by Muon, the others by
    AdamW (module docstring); ``lr`` and ``weight_decay`` per group, the rest shared."""

    def __init__(self, params, lr=1e-3, weight_decay=0.0, momentum=0.95, nesterov=True, ns_steps=5,
                 ns_bf16=True, betas=(0.9, 0.95), eps=1e-8) -> None:  # fmt: skip
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_bf16=ns_bf16, betas=betas, eps=eps, use_muon=False)  # fmt: skip
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"] and any(p.dim() < 2 for p in group["params"]):
                raise DeepInitConfigError("Muon orthogonalises matrices: a parameter of under 2 dimensions is AdamW's")

    @property
    def supports_memory_efficient_fp16(self) -> bool:
        return True

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                # fp16/bf16 weights (--memory-efficient-fp16): the state and the arithmetic in float32
                grad = p.grad.float() if p.grad.dtype in _HALF else p.grad
                p32 = p.float() if p.dtype in _HALF else p
                (self._muon if group["use_muon"] else self._adamw)(p32, grad, self.state[p], group)
                if p32 is not p:
                    p.copy_(p32)
        return loss

    @staticmethod
    def _muon(p: Tensor, grad: Tensor, state: dict, group: dict) -> None:
        g = grad.view(grad.size(0), -1) if grad.dim() > 2 else grad
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(g)
        buf = state["momentum_buffer"]
        buf.mul_(group["momentum"]).add_(g)
        u = g.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
        o = zeropower_via_newtonschulz5(u, group["ns_steps"], group["ns_bf16"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(o.view_as(p), alpha=-adjusted_lr(group["lr"], p.shape))

    @staticmethod
    def _adamw(p: Tensor, grad: Tensor, state: dict, group: dict) -> None:
        beta1, beta2 = group["betas"]
        if "step" not in state:
            state["step"], state["moment1"], state["moment2"] = 0, torch.zeros_like(grad), torch.zeros_like(grad)
        state["step"] += 1
        m, v, t = state["moment1"], state["moment2"], state["step"]
        m.lerp_(grad, 1 - beta1)
        v.lerp_(grad.square(), 1 - beta2)
        step_size = group["lr"] * math.sqrt(1 - beta2**t) / (1 - beta1**t)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-step_size)


# --- fairseq ------------------------------------------------------------------------------------------------


@dataclass
class FairseqMuonConfig(FairseqDataclass):
    muon_momentum: float = field(default=0.95, metadata={"help": "Muon's momentum mu (default 0.95, Moonlight's)"})
    muon_no_nesterov: bool = field(
        default=False, metadata={"help": "Muon: plain momentum instead of Nesterov's (the released default)"}
    )
    muon_ns_steps: int = field(default=5, metadata={"help": "Muon: Newton-Schulz iterations (default 5)"})
    muon_ns_fp32: bool = field(
        default=False,
        metadata={"help": "Muon: Newton-Schulz in the master weights' dtype instead of bfloat16 (as released)"},
    )
    adam_betas: Any = field(
        default=(0.9, 0.95), metadata={"help": "betas of the AdamW part (default (0.9, 0.95), Moonlight's)"}
    )
    adam_eps: float = field(default=1e-8, metadata={"help": "epsilon of the AdamW part"})
    weight_decay: float = field(default=0.0, metadata={"help": "decoupled weight decay, both parts (p *= 1 - lr wd)"})
    lr: List[float] = II("optimization.lr")


def _options(cfg: Any) -> Dict[str, Any]:
    """The torch optimizer's arguments from ``cfg``, or a one-line error."""
    momentum, steps = cfg.muon_momentum, cfg.muon_ns_steps
    if not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
        raise DeepInitConfigError(f"--muon-momentum {momentum}: must be >= 0 and < 1 (default 0.95)")
    if not (isinstance(steps, int) and 1 <= steps <= 100):
        raise DeepInitConfigError(f"--muon-ns-steps {steps}: must be a whole number from 1 to 100 (default 5)")
    if cfg.weight_decay < 0 or cfg.adam_eps <= 0:
        raise DeepInitConfigError("--weight-decay must be >= 0 and --adam-eps > 0 for --optimizer muon")
    lr = cfg.lr[0] if isinstance(cfg.lr, Collection) else cfg.lr
    return dict(lr=lr, weight_decay=cfg.weight_decay, momentum=float(momentum), nesterov=not cfg.muon_no_nesterov,
                ns_steps=steps, ns_bf16=not cfg.muon_ns_fp32,
                betas=parse_adam_betas(cfg.adam_betas), eps=cfg.adam_eps)  # fmt: skip


class _FairseqMuon(FairseqOptimizer):
    def __init__(self, cfg: FairseqMuonConfig, params) -> None:
        super().__init__(cfg)
        groups = list(params)
        if not groups or not isinstance(groups[0], dict):
            raise DeepInitConfigError(
                "--optimizer muon needs every parameter's role (hidden matrix or not), which the plugin gives in "
                "fairseq's trainer (fairseq-train --user-dir fairseq_deepinit)"
            )
        for group in groups:
            group["use_muon"] = group[GROUP_KEY] == MUON
        self._optimizer = Muon(groups, **_options(cfg))

    @property
    def supports_flat_params(self) -> bool:
        return False  # Muon needs each matrix's shape: check_training_config refuses the flat fp32 master first


@register_optimizer("muon", dataclass=FairseqMuonConfig)
class FairseqMuon(ScaledParamGroups, _FairseqMuon):
    """``--optimizer muon`` (module docstring): two param groups, ``muon`` and ``adamw``, named in the optimizer
    state (:class:`~.param_groups.ScaledParamGroups` checks them at resume)."""

    @staticmethod
    def prepare_model(cfg: Any, model: nn.Module) -> None:
        """Before fairseq builds the optimizer (``cfg``: ``Trainer.cfg``): refuse what Muon cannot follow, then
        tag every parameter with its role."""
        check_training_config(cfg)
        tag_roles(model)
        n_muon, n_adamw = describe(model)
        logger.info(f"Muon on {n_muon} parameters of the hidden layers' matrices, AdamW on the other {n_adamw}")


def roles(model: nn.Module) -> Dict[str, str]:
    """``{parameter name: "muon" | "adamw"}``: Muon for the matrices (2-D or more) of a stack's layers, AdamW for
    the embeddings, the output projection (tied or not), norms and biases (``toy_train.py:293-304``; the roles
    are depth-muP's groups, :func:`.depth_mup.group_kinds`). A parameter outside every role stops with one line."""
    kinds = group_kinds(model, who="--optimizer muon")
    return {name: MUON if kind.rpartition(".")[2] == MUON_KIND else ADAMW for name, kind in kinds.items()}


def tag_roles(model: nn.Module) -> None:
    """Tag every parameter of ``model`` with its role (:func:`roles`; :func:`.param_groups.tag_parameter`)."""
    params = dict(model.named_parameters())
    for name, role in roles(model).items():
        tag_parameter(params[name], role, GroupScale())


def check_training_config(cfg: Any) -> None:
    """Refuse, in one line, the set-ups where Muon cannot see each matrix (``cfg``: ``Trainer.cfg``): the flat
    fp32 master of ``--fp16`` / ``--bf16`` (one vector), ``--zero-sharding os`` and ``--ddp-backend
    fully_sharded`` (shards of flattened parameters), BMUF (its block average)."""
    common, dist = cfg.common, cfg.distributed_training
    efficient = common.memory_efficient_fp16 or common.memory_efficient_bf16
    if (common.fp16 or common.bf16) and not efficient and not common.fp16_no_flatten_grads:
        raise DeepInitConfigError(
            "--optimizer muon orthogonalises each weight matrix, and --fp16/--bf16 flatten the fp32 master weights "
            "into one vector: add --fp16-no-flatten-grads, or use --memory-efficient-fp16"
        )
    if dist.zero_sharding != "none" or dist.ddp_backend == "fully_sharded":
        raise DeepInitConfigError(
            "--optimizer muon needs each weight matrix whole on every rank: drop --zero-sharding and use "
            "--ddp-backend pytorch_ddp or legacy_ddp"
        )
    if getattr(cfg.optimization, "use_bmuf", False):
        raise DeepInitConfigError("--optimizer muon does not combine with --use-bmuf; drop one of them")


def describe(model: nn.Module) -> Tuple[int, int]:
    """``(Muon's parameter count, AdamW's)`` of ``model`` (for the log)."""
    params, split = dict(model.named_parameters()), roles(model)
    return tuple(sum(params[n].numel() for n, r in split.items() if r == role) for role in (MUON, ADAMW))
