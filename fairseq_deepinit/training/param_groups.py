"""Per-parameter-group learning-rate, Adam-eps and weight-decay multipliers that survive fairseq's optimizers.

fairseq hands the optimizer one flat parameter list (``fairseq/trainer.py:289-344``), sets one lr in every
group (``fairseq/optim/fairseq_optimizer.py:70-73``) and, under ``--fp16``, gives it fp32 copies that keep
only ``optim_overrides`` (``fp16_optimizer.py:62-78``). So the group travels on the parameter
(:func:`tag_parameter`, under :data:`TAG` in ``optim_overrides``), and :class:`ScaledParamGroups`, a mixin
for a :class:`~fairseq.optim.FairseqOptimizer`, splits the list into one torch param group per tag holding
the effective lr, eps and weight decay; ``set_lr`` writes ``lr * lr_scale`` into each group, ``get_lr``
returns the base rate. Flattened ``--fp16`` and ``--optimizer composite`` are refused
(:func:`check_groups_reached`). The full account, resume included: docs/schemes.md, "Depth-muP and CompleteP".
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch
from fairseq.optim import AMPOptimizer, FairseqBMUF, FairseqOptimizer, FP16Optimizer, MemoryEfficientFP16Optimizer
from fairseq.optim.adam import FairseqAdam

from ..errors import DeepInitConfigError

logger = logging.getLogger(__name__)

# key of the plugin's entry in a parameter's ``optim_overrides`` dict
TAG = "deepinit_param_group"
# torch param-group keys the mixin adds: the group's name and the scale of each hyperparameter
GROUP_KEY = "group"
SCALED = {"lr": "lr_scale", "eps": "eps_scale", "weight_decay": "weight_decay_scale"}


@dataclass(frozen=True)
class GroupScale:
    """Multipliers of the base learning rate, Adam eps and weight decay of one parameter group."""

    lr: float = 1.0
    eps: float = 1.0
    weight_decay: float = 1.0

    def as_group_keys(self) -> Dict[str, float]:
        return {SCALED["lr"]: self.lr, SCALED["eps"]: self.eps, SCALED["weight_decay"]: self.weight_decay}


def tag_parameter(param: torch.Tensor, group: str, scale: GroupScale) -> None:
    """Put ``param`` in the optimizer group ``group`` with multipliers ``scale``.

    Stored in ``param.optim_overrides[TAG]`` (a new dict, so a dict shared with other parameters is not
    changed), the attribute ``FP16Optimizer`` copies to its fp32 master parameters
    (``fairseq/optim/fp16_optimizer.py:75-76``). Call it on the parameters the optimizer will be built
    from (after any re-materialisation such as ``to_empty``, which makes new parameter objects).
    """
    overrides = dict(getattr(param, "optim_overrides", None) or {})
    overrides[TAG] = {GROUP_KEY: group, **scale.as_group_keys()}
    param.optim_overrides = overrides


def parameter_tag(param: torch.Tensor) -> Tuple[str, GroupScale] | None:
    """The ``(group, scale)`` that :func:`tag_parameter` stored on ``param``, or None."""
    entry = (getattr(param, "optim_overrides", None) or {}).get(TAG)
    if entry is None:
        return None
    scale = GroupScale(entry[SCALED["lr"]], entry[SCALED["eps"]], entry[SCALED["weight_decay"]])
    return entry[GROUP_KEY], scale


def split_by_tag(params: Iterable[torch.Tensor]) -> List[Any]:
    """The optimizer's ``params`` argument: the tensors unchanged when none is tagged, else one torch
    param group per tag name (in order of first appearance) with the name and the scales as keys."""
    params = list(params)
    tags = [parameter_tag(p) for p in params]
    untagged = sum(t is None for t in tags)
    if untagged == len(params):
        return params
    if untagged:
        raise DeepInitConfigError(
            f"{untagged} of the {len(params)} trained parameters carry no optimizer group while the others do "
            "(a criterion or module with parameters the group rule does not cover); every trained parameter "
            "needs one"
        )
    groups: Dict[str, Dict[str, Any]] = {}
    for p, (name, scale) in zip(params, tags, strict=True):
        group = groups.setdefault(name, {"params": [], GROUP_KEY: name, **scale.as_group_keys()})
        if any(group[k] != v for k, v in scale.as_group_keys().items()):
            raise DeepInitConfigError(f"optimizer group {name!r} has parameters tagged with different multipliers")
        group["params"].append(p)
    return list(groups.values())


class ScaledParamGroups:
    """Mixin for a :class:`~fairseq.optim.FairseqOptimizer` (before it in the bases): one param group per
    tag, effective ``lr``/``eps``/``weight_decay`` = base x the group's scale (module docstring).

    The optimizer it extends must take ``(cfg, params)`` and pass ``params`` to a torch optimizer that
    accepts param groups and reads ``lr``, ``eps`` and ``weight_decay`` from each group at every step (fairseq's
    ``Adam``, apex's ``FusedAdam``, :class:`~.adam_foreach.AdamForeach`).
    """

    def __init__(self, cfg: Any, params: Iterable[torch.Tensor]) -> None:
        super().__init__(cfg, split_by_tag(params))
        for group in self.param_groups:
            for key, scale_key in SCALED.items():
                if scale_key not in group:
                    continue
                if key not in group:
                    raise DeepInitConfigError(
                        f"{type(self).__name__} has no {key!r} per parameter group to scale; use --optimizer adam "
                        "or adam_foreach"
                    )
                group[key] = group[key] * group[scale_key]

    def set_lr(self, lr: float) -> None:
        """Each group's rate: ``lr`` times its ``lr_scale`` (fairseq's writes ``lr`` into every group)."""
        for group in self.param_groups:
            group["lr"] = lr * group.get(SCALED["lr"], 1.0)

    def get_lr(self) -> float:
        """The base rate: that of the first group with ``lr_scale == 1`` (exactly what ``set_lr`` was given),
        else the first group's rate divided by its scale."""
        groups = list(self.param_groups)
        for group in groups:
            if group.get(SCALED["lr"], 1.0) == 1.0:
                return group["lr"]
        return groups[0]["lr"] / groups[0][SCALED["lr"]]

    def load_state_dict(self, state_dict: Dict[str, Any], optimizer_overrides: Dict[str, Any] | None = None) -> None:
        """torch's load (the saved state and group values), with the checks and scaling of the module docstring."""
        saved_names = [g.get(GROUP_KEY) for g in state_dict.get("param_groups", [])]
        names = [g.get(GROUP_KEY) for g in self.param_groups]
        if saved_names != names:
            raise DeepInitConfigError(
                f"the checkpoint's optimizer has parameter groups {_describe(saved_names)} and this run's "
                f"{_describe(names)}: resume with the options the checkpoint was trained with, or start the "
                "optimizer afresh with --reset-optimizer"
            )
        current = [{k: g[k] for k in SCALED.values() if k in g} for g in self.param_groups]
        self.optimizer.load_state_dict(state_dict)
        changed = []
        for group, scales in zip(self.param_groups, current, strict=True):
            for key, scale_key in SCALED.items():
                saved = group.get(scale_key, 1.0)
                if scale_key in scales and saved != scales[scale_key]:
                    changed.append(f"{group[GROUP_KEY]} {key} x{saved:g} -> x{scales[scale_key]:g}")
                    group[key] = group[key] / saved * scales[scale_key]
                    group[scale_key] = scales[scale_key]
        if changed:
            logger.warning("resuming with this run's optimizer group multipliers: " + ", ".join(changed))
        for group in self.param_groups:
            for key, value in (optimizer_overrides or {}).items():
                group[key] = value * group.get(SCALED[key], 1.0) if key in SCALED else value


def _describe(names: List[str | None]) -> str:
    if names == [None]:
        return "(one group, no multipliers)"
    return "(" + ", ".join(str(n) for n in names) + ")"


class FairseqAdamScaled(ScaledParamGroups, FairseqAdam):
    """fairseq's ``--optimizer adam`` with :class:`ScaledParamGroups`; not registered: depth-muP runs refuse
    ``--optimizer adam`` (fairseq's class builds one group) and use ``adam_foreach``, whose registered class
    has the mixin (:class:`~.adam_foreach.FairseqAdamForeach`)."""


def innermost(optimizer: FairseqOptimizer) -> FairseqOptimizer:
    """The optimizer that fairseq's wrappers (fp16, memory-efficient fp16, AMP, BMUF) forward to."""
    while True:
        if isinstance(optimizer, (FP16Optimizer, AMPOptimizer)):
            optimizer = optimizer.fp32_optimizer
        elif isinstance(optimizer, MemoryEfficientFP16Optimizer):
            optimizer = optimizer.wrapped_optimizer
        elif isinstance(optimizer, FairseqBMUF):
            optimizer = optimizer._optimizer
        else:
            return optimizer


def check_groups_reached(optimizer: FairseqOptimizer, model: torch.nn.Module) -> None:
    """Stop with one line when the model's tagged groups are not the optimizer's param groups.

    Run after the trainer has built the optimizer: it catches any path that loses the tags (``--fp16``'s
    flat fp32 copy, an optimizer without :class:`ScaledParamGroups`), whatever the options check missed.
    """
    expected: List[str] = []
    for p in model.parameters():
        tag = parameter_tag(p) if p.requires_grad else None
        if tag is not None and tag[0] not in expected:
            expected.append(tag[0])
    if not expected:
        return
    inner = innermost(optimizer)
    got = [g.get(GROUP_KEY) for g in inner.param_groups]
    if got != expected or not isinstance(inner, ScaledParamGroups):
        raise DeepInitConfigError(
            f"the model's {len(expected)} optimizer groups did not reach {type(inner).__name__} "
            f"(it has {_describe(got)}): per-group multipliers need --optimizer adam_foreach, and under "
            "--fp16 --fp16-no-flatten-grads or --memory-efficient-fp16"
        )
