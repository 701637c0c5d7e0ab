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
    ``g``'s dtype), returned in that dtype. ``g``: one matrix, or a stack of matrices of one shape (``n x A x B``),
    each orthogonalised on its own (its own norm), in one chain of batched products."""
    a, b, c = NS_COEFFICIENTS
    x = g.bfloat16() if bf16 else g
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def adjusted_lr(lr: float, shape: torch.Size) -> float:
    """``lr * 0.2 * sqrt(max(A, B))`` of a parameter of ``shape`` (its first two sizes, ``toy_train.py:142-148``)."""
    a, b = shape[:2]
    return lr * RMS_MATCH * math.sqrt(max(a, b))


class Muon(torch.optim.Optimizer):
    """Muon and AdamW over param groups: a group whose ``use_muon`` is True is stepped by Muon, the others by
    AdamW (module docstring); ``lr`` and ``weight_decay`` per group, the rest shared. Muon's matrices of one shape
    go through one batched Newton-Schulz chain, and the elementwise parts of both rules are ``_foreach``
    operations, so a step's kernels grow with the number of matrix shapes, not of matrices."""

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
            live = [p for p in group["params"] if p.grad is not None]
            # fp16/bf16 weights (--memory-efficient-fp16): the state and the arithmetic in float32
            weights = [p.float() if p.dtype in _HALF else p for p in live]
            grads = [p.grad.float() if p.grad.dtype in _HALF else p.grad for p in live]
            states = [self.state[p] for p in live]
            if group["use_muon"]:
                for same in _same_shape(weights):  # one batched Newton-Schulz chain per matrix shape
                    self._muon(*([x[i] for i in same] for x in (weights, grads, states)), group)
            elif live:
                self._adamw(weights, grads, states, group)
            for p, w in zip(live, weights, strict=True):
                if w is not p:
                    p.copy_(w)
        return loss

    @staticmethod
    def _muon(ps: List[Tensor], grads: List[Tensor], states: List[dict], group: dict) -> None:
        """Muon's step for matrices of one shape, the elementwise parts as ``_foreach`` operations."""
        gs = [g.view(g.size(0), -1) for g in grads]  # a weight of more than 2 dimensions: its first size x the rest
        for g, state in zip(gs, states, strict=True):
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g)
        bufs, mu = [state["momentum_buffer"] for state in states], group["momentum"]
        torch._foreach_mul_(bufs, mu)
        torch._foreach_add_(bufs, gs)
        us = torch._foreach_add(gs, bufs, alpha=mu) if group["nesterov"] else bufs
        o = zeropower_via_newtonschulz5(torch.stack(us), group["ns_steps"], group["ns_bf16"]).to(ps[0].dtype)
        torch._foreach_mul_(ps, 1 - group["lr"] * group["weight_decay"])
        updates = [u.view_as(p) for u, p in zip(o.unbind(0), ps, strict=True)]
        torch._foreach_add_(ps, updates, alpha=-adjusted_lr(group["lr"], ps[0].shape))

    @staticmethod
    def _adamw(ps: List[Tensor], grads: List[Tensor], states: List[dict], group: dict) -> None:
        """The AdamW part over every parameter of the group at once (``_foreach`` operations)."""
        beta1, beta2 = group["betas"]
        for g, state in zip(grads, states, strict=True):
            if "step" not in state:
                state["step"], state["moment1"], state["moment2"] = 0, torch.zeros_like(g), torch.zeros_like(g)
            state["step"] += 1
        m, v = [state["moment1"] for state in states], [state["moment2"] for state in states]
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_lerp_(v, torch._foreach_mul(grads, grads), 1 - beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_add_(denom, group["eps"])
        lr = group["lr"]
        steps = [-lr * math.sqrt(1 - beta2 ** state["step"]) / (1 - beta1 ** state["step"]) for state in states]
        torch._foreach_mul_(ps, 1 - lr * group["weight_decay"])
        torch._foreach_addcdiv_(ps, m, denom, steps)


def _same_shape(tensors: List[Tensor]) -> List[List[int]]:
    """The indices of ``tensors`` grouped by shape, dtype and device, in first-seen order."""
    groups: Dict[Tuple, List[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.shape, t.dtype, t.device), []).append(i)
    return list(groups.values())


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
