"""``--optimizer radam``: Rectified Adam (Liu et al. 2020, "On the Variance of the Adaptive Learning
Rate and Beyond", Algorithm 2), the optimizer of Admin's released recipes (Liu et al. 2020,
Transformer-Clinic ``--optimizer radam``). fairseq 0.12 has no RAdam.

Wraps ``torch.optim.RAdam`` with decoupled weight decay, as the released fairseq RAdam applies it
(``p -= lr * weight_decay * p``, like fairseq's ``adam``/AdamW). While the variance rectification
is undefined (rho_t <= 5, the first updates) the step is the bias-corrected momentum, as the
released code's ``degenerated_to_sgd=True`` does.
"""

from collections.abc import Collection
from dataclasses import dataclass, field  # no `from __future__ import annotations`: fairseq reads real types
from typing import Any, List

import torch
from fairseq.dataclass import FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer
from omegaconf import II, OmegaConf


@dataclass
class FairseqRAdamConfig(FairseqDataclass):
    adam_betas: Any = field(default=(0.9, 0.999), metadata={"help": "betas for RAdam"})
    adam_eps: float = field(default=1e-8, metadata={"help": "epsilon for RAdam"})
    weight_decay: float = field(default=0.0, metadata={"help": "decoupled weight decay"})
    lr: List[float] = II("optimization.lr")


@register_optimizer("radam", dataclass=FairseqRAdamConfig)
class FairseqRAdam(FairseqOptimizer):
    def __init__(self, cfg: FairseqRAdamConfig, params) -> None:
        super().__init__(cfg)
        self._optimizer = torch.optim.RAdam(params, decoupled_weight_decay=True, **self.optimizer_config)

    @property
    def optimizer_config(self) -> dict:
        lr = self.cfg.lr[0] if isinstance(self.cfg.lr, Collection) else self.cfg.lr
        betas = self.cfg.adam_betas
        betas = eval(betas) if isinstance(betas, str) else OmegaConf.to_container(betas)  # fairseq's adam does the same
        return {"lr": lr, "betas": tuple(betas), "eps": self.cfg.adam_eps, "weight_decay": self.cfg.weight_decay}

    @property
    def supports_flat_params(self) -> bool:
        return True
