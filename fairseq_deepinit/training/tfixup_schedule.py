"""T-Fixup's warmup-free learning-rate schedule (Huang et al. 2020, sec. 4, released code):
``lr_t = lr * sqrt(P / (P + t))`` with decay period P (4000 in the paper), t the update number.

``--lr-scheduler tfixup [--decay-period P]``. The rate is a closed form of the update number, so a
resumed run continues exactly (fairseq restores the update count); it takes no warmup flags. A
period <= 0, a list of rates or a rate that is not a finite number > 0 is refused when the scheduler
is built, before the first update (:class:`~fairseq_deepinit.errors.DeepInitConfigError`).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field  # no `from __future__ import annotations`: fairseq reads real types
from typing import List

from fairseq.dataclass import FairseqDataclass
from fairseq.optim.lr_scheduler import FairseqLRScheduler, register_lr_scheduler
from omegaconf import II

from ..errors import DeepInitConfigError


@dataclass
class TFixupScheduleConfig(FairseqDataclass):
    decay_period: int = field(default=4000, metadata={"help": "P in lr * sqrt(P / (P + t))"})
    lr: List[float] = II("optimization.lr")


def tfixup_lr(lr: float, decay_period: int, num_updates: int) -> float:
    """``lr * sqrt(P / (P + t))``: ``lr`` at t = 0, half of it at t = 3P."""
    return lr * math.sqrt(decay_period / (decay_period + num_updates))


@register_lr_scheduler("tfixup", dataclass=TFixupScheduleConfig)
class TFixupSchedule(FairseqLRScheduler):
    """No warmup: the learning rate starts at ``--lr`` and decays as sqrt(P / (P + t))."""

    def __init__(self, cfg: TFixupScheduleConfig, optimizer) -> None:
        super().__init__(cfg, optimizer)
        lrs = list(cfg.lr) if isinstance(cfg.lr, Sequence) and not isinstance(cfg.lr, str) else [cfg.lr]
        if len(lrs) != 1:
            raise DeepInitConfigError(
                f"--lr-scheduler tfixup takes one --lr value, not a list (got --lr {','.join(map(str, lrs))}); "
                "give the starting rate only, e.g. --lr 5e-4"
            )
        if not (math.isfinite(float(lrs[0])) and float(lrs[0]) > 0):
            raise DeepInitConfigError(
                f"--lr-scheduler tfixup: --lr must be a finite number > 0 (the rate at update 0), got {lrs[0]}; "
                "T-Fixup's IWSLT recipe uses --lr 5e-4"
            )
        if cfg.decay_period <= 0:
            raise DeepInitConfigError(
                f"--decay-period must be positive, got {cfg.decay_period} (P in lr * sqrt(P / (P + t)); "
                "T-Fixup uses 4000)"
            )
        self.base_lr = float(lrs[0])
        self.optimizer.set_lr(self.base_lr)

    def step_update(self, num_updates: int) -> float:
        lr = tfixup_lr(self.base_lr, self.cfg.decay_period, num_updates)
        self.optimizer.set_lr(lr)
        return lr
