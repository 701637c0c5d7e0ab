"""Depth-muP / CompleteP on fairseq's trainer, the record's training hooks: the training options that cannot
carry per-group rates are refused (:func:`check_training`), and every parameter is tagged with its group
(:mod:`.depth_mup`, :func:`tag_groups`) right before fairseq's ``Trainer._build_optimizer``
(``fairseq/trainer.py:289-382``) hands the optimizer its flat parameter list
(:func:`fairseq_deepinit.patches.build_optimizer`, the one wrapper of that method, calls both). Why the trainer
and not the model build: docs/schemes.md, "Depth-muP and CompleteP".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

import torch.nn as nn

from ..errors import DeepInitConfigError
from .depth_mup import describe, param_groups, tag_parameters

logger = logging.getLogger(__name__)

# optimizers whose update is Adam's (Table 1 is for AdamW; Megatron's recipe rejects SGD and Muon) and that
# build one param group per tagged group (fairseq's own ``adam`` builds one group: refused, adam_foreach named)
ADAM_OPTIMIZERS = ("adam_foreach",)


# --- options that cannot work ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingOptions:
    """fairseq's training options :func:`check_training_config` reads, with fairseq's defaults
    (``fairseq/dataclass/configs.py``, the line in each comment)."""

    optimizer: str | None = None  # configs.py:1142 (FairseqConfig.optimizer; its ``_name`` in a config)
    fp16: bool = False  # configs.py:155
    memory_efficient_fp16: bool = False  # configs.py:156
    memory_efficient_bf16: bool = False  # configs.py:149
    fp16_no_flatten_grads: bool = False  # configs.py:162
    zero_sharding: str = "none"  # configs.py:435
    ddp_backend: str = "pytorch_ddp"  # configs.py:301

    @classmethod
    def of_args(cls, args: Any) -> TrainingOptions:
        """From fairseq's flat namespace (``fairseq-train``'s parsed arguments); one it lacks has the default."""
        return cls(**{f.name: getattr(args, f.name, f.default) for f in fields(cls)})

    @classmethod
    def of_cfg(cls, cfg: Any) -> TrainingOptions:
        """From fairseq's ``Trainer.cfg`` (its ``optimizer``, ``common`` and ``distributed_training`` sections)."""
        common, dist = cfg.common, cfg.distributed_training
        return cls(
            optimizer=getattr(cfg.optimizer, "_name", None), fp16=common.fp16,
            memory_efficient_fp16=common.memory_efficient_fp16, memory_efficient_bf16=common.memory_efficient_bf16,
            fp16_no_flatten_grads=common.fp16_no_flatten_grads, zero_sharding=dist.zero_sharding,
            ddp_backend=dist.ddp_backend,
        )  # fmt: skip


def check_training_config(args: Any) -> None:
    """Refuse, with one line, training options under which per-group multipliers cannot reach the update.

    ``args`` is fairseq's flat namespace (``fairseq-train``'s parsed arguments), or its :class:`TrainingOptions`.
    """
    opts = args if isinstance(args, TrainingOptions) else TrainingOptions.of_args(args)
    optimizer = opts.optimizer
    if optimizer == "adam":
        raise DeepInitConfigError(
            "--optimizer adam (fairseq's FairseqAdam) builds one parameter group and depth-muP needs one per group: "
            "use --optimizer adam_foreach (the same Adam update and flags; it resumes adam's state)"
        )
    if optimizer not in ADAM_OPTIMIZERS:
        raise DeepInitConfigError(
            f"depth-muP scales Adam's learning rate and eps per parameter group (CompleteP Table 1 is for AdamW; "
            f"Megatron's recipe rejects SGD and Muon), which --optimizer {optimizer} does not do: use --optimizer "
            "adam_foreach"
        )
    efficient = opts.memory_efficient_fp16 or opts.memory_efficient_bf16
    if opts.fp16 and not efficient and not opts.fp16_no_flatten_grads:
        raise DeepInitConfigError(
            "--fp16 flattens every parameter into one fp32 tensor (fairseq's FP16Optimizer), which has one learning "
            "rate, and depth-muP needs one per parameter group: add --fp16-no-flatten-grads, or use "
            "--memory-efficient-fp16"
        )
    if opts.zero_sharding != "none":
        raise DeepInitConfigError(
            f"--zero-sharding {opts.zero_sharding} rebuilds the optimizer inside fairscale's OSS, where depth-muP's "
            "per-group multipliers are not supported: drop --zero-sharding"
        )
    if opts.ddp_backend == "fully_sharded":
        raise DeepInitConfigError(
            "--ddp-backend fully_sharded flattens the parameters, which leaves one learning rate for all of them, "
            "and depth-muP needs one per parameter group: use --ddp-backend pytorch_ddp or legacy_ddp"
        )


# --- fairseq's trainer ----------------------------------------------------------------------------------


def check_training(p: Any, spec: Any, cfg: Any) -> None:
    """Depth-muP's :class:`~fairseq_deepinit.methods.record.CheckTraining`: :func:`check_training_config` of
    fairseq's ``Trainer.cfg``."""
    check_training_config(TrainingOptions.of_cfg(cfg))


def tag_groups(p: Any, spec: Any, model: nn.Module) -> None:
    """Depth-muP's :class:`~fairseq_deepinit.methods.record.ParamGroups`: tag every parameter of ``model`` with
    its group (``p``: the record's options) and log the groups."""
    groups = param_groups(model, p.depth_mup_base_layers, p.depth_mup_alpha, p.depth_mup_source)
    tag_parameters(model, groups)
    logger.info("depth-muP optimizer groups: " + describe(groups))
