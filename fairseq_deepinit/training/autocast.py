"""bf16 mixed precision through the task (``--autocast-bf16``), with fp32 weights.

fairseq's ``--bf16`` casts the model's weights to bf16 and is meant for TPUs; ``--amp`` is fp16
autocast with a loss scaler. ``--autocast-bf16`` is the usual GPU recipe (Micikevicius et al. 2018,
"Mixed Precision Training", with bf16's fp32 exponent range so no loss scaling): the forward pass
and the loss run under ``torch.autocast(device_type, dtype=torch.bfloat16)`` (matrix products in
bf16, reductions such as softmax / log-softmax / norms in fp32, as autocast decides per op),
while weights, gradients and the optimizer state stay fp32 and the backward pass runs outside
autocast (as PyTorch recommends; its ops follow the dtypes the forward chose).

It is a task option, so it lives in :class:`AutocastTaskMixin` (train, valid and inference
steps) plus :class:`AutocastConfig` (the ``--autocast-bf16`` field). ``--task translation_deepinit``
is fairseq's translation task with it; another translation task gets it with::

    @dataclass
    class MyConfig(TranslationConfig, AutocastConfig): ...

    @register_task("my_task", dataclass=MyConfig)
    class MyTask(AutocastTaskMixin, MyTranslationTask): ...

Only the criterion call (model forward + loss) is wrapped: fairseq's ``train_step`` runs it inside
``torch.cuda.amp.autocast(enabled=<--amp>)``, which would switch an outer CUDA autocast off again.
"""

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from fairseq.dataclass import FairseqDataclass
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from ..errors import AutocastConfigError
from .cpu_bf16 import native_bf16

logger = logging.getLogger(__name__)
TASK_NAME = "translation_deepinit"
# fairseq precision flags that cast weights (fp16/bf16 wrappers) or add their own autocast (amp)
_CONFLICTING_FLAGS = ("fp16", "bf16", "memory_efficient_fp16", "memory_efficient_bf16", "amp")


# no ``from __future__ import annotations`` here: fairseq builds the parser from the fields' real types
@dataclass
class AutocastConfig(FairseqDataclass):
    autocast_bf16: bool = field(
        default=False,
        metadata={
            "help": "bf16 mixed precision: forward and loss under torch.autocast(bfloat16), weights, gradients "
            "and optimizer state in fp32 (not with --fp16/--bf16/--amp; fairseq's --bf16 is for TPUs)"
        },
    )


def check_precision_flags(cfg: Any) -> None:
    """Refuse fairseq's own precision modes next to ``--autocast-bf16`` (``cfg``: any namespace/config)."""
    given = [f"--{name.replace('_', '-')}" for name in _CONFLICTING_FLAGS if _get(cfg, name)]
    if given:
        raise AutocastConfigError(
            f"--autocast-bf16 keeps the weights in fp32 and runs the forward under bf16 autocast; it does not combine "
            f"with {' / '.join(given)} (which cast the weights or add fp16 autocast). Drop {' and '.join(given)}, "
            "or drop --autocast-bf16."
        )


def _get(cfg: Any, name: str) -> Any:
    for container in (cfg, getattr(cfg, "common", None)):
        if container is None:
            continue
        try:
            value = getattr(container, name, None)
        except Exception:  # omegaconf raises on missing keys in struct mode
            value = None
        if value:
            return value
    return None


def autocast_device_type(model: torch.nn.Module) -> str:
    """The ``torch.autocast`` device type of ``model``'s weights, after checking bf16 works there."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        if not torch.cuda.is_bf16_supported():
            raise AutocastConfigError(
                f"--autocast-bf16: {torch.cuda.get_device_name(device)} has no bf16 support; use --amp (fp16 "
                "autocast with loss scaling) instead"
            )
    elif device.type != "cpu":
        raise AutocastConfigError(f"--autocast-bf16 supports CUDA and CPU models, not {device.type}")
    return device.type


def check_fp32_training(model: torch.nn.Module, optimizer: Any) -> None:
    """Weights must be fp32 and the optimizer fairseq's plain fp32 one."""
    from fairseq.optim.amp_optimizer import AMPOptimizer
    from fairseq.optim.fp16_optimizer import _FP16OptimizerMixin, _MemoryEfficientFP16OptimizerMixin

    if isinstance(optimizer, (_FP16OptimizerMixin, _MemoryEfficientFP16OptimizerMixin, AMPOptimizer)):
        raise AutocastConfigError(
            f"--autocast-bf16 needs fp32 weights and fairseq's fp32 optimizer, got {type(optimizer).__name__} "
            "(from --fp16/--bf16/--amp); drop those flags or drop --autocast-bf16"
        )
    wrong = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if wrong:
        raise AutocastConfigError(
            f"--autocast-bf16 keeps the weights in fp32, but the model has {', '.join(wrong)} parameters; drop "
            "--fp16/--bf16 or drop --autocast-bf16"
        )


class AutocastCriterion:
    """A criterion whose call (model forward + loss) runs under bf16 autocast; everything else is the
    wrapped criterion's."""

    def __init__(self, criterion: Any, device_type: str) -> None:
        self._criterion = criterion
        self._device_type = device_type

    def __call__(self, model, sample, *args, **kwargs):
        with torch.autocast(device_type=self._device_type, dtype=torch.bfloat16):
            return self._criterion(model, sample, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._criterion, name)


class AutocastTaskMixin:
    """Runs the criterion under bf16 autocast in ``train_step`` / ``valid_step``, and generation in
    ``inference_step``, when the task config has ``autocast_bf16`` (see the module docstring)."""

    cfg: Any
    _autocast_checked_optimizer: bool = False
    _autocast_checked_model: bool = False
    _autocast_logged: bool = False

    @property
    def autocast_bf16(self) -> bool:
        # fairseq's legacy tasks (language_modeling) keep their options in ``args`` and leave ``cfg`` None
        cfg = self.cfg if getattr(self, "cfg", None) is not None else getattr(self, "args", None)
        return bool(getattr(cfg, "autocast_bf16", False))

    def build_model(self, cfg, from_checkpoint: bool = False):
        if self.autocast_bf16 and not from_checkpoint:
            # fairseq-train hands legacy (argparse) models the whole namespace, precision flags included;
            # a checkpoint's flags are those of its training run, not of this one
            check_precision_flags(cfg)
        return super().build_model(cfg, from_checkpoint)

    def _autocast_device(self, model, optimizer=None) -> str:
        if optimizer is not None and not self._autocast_checked_optimizer:
            check_fp32_training(model, optimizer)
            self._autocast_checked_optimizer = self._autocast_checked_model = True
        elif not self._autocast_checked_model:
            check_fp32_training(model, None)
            self._autocast_checked_model = True
        device_type = autocast_device_type(model)
        if device_type == "cpu" and not self._autocast_logged:
            native, why = native_bf16()
            how = "native bf16" if native else "bf16 is emulated (slower than fp32)"
            (logger.info if native else logger.warning)(f"--autocast-bf16 on the CPU: {how}: {why}")
            self._autocast_logged = True
        return device_type

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False, **kwargs):
        if self.autocast_bf16:
            criterion = AutocastCriterion(criterion, self._autocast_device(model, optimizer))
        return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad=ignore_grad, **kwargs)

    def valid_step(self, sample, model, criterion):
        if self.autocast_bf16:
            criterion = AutocastCriterion(criterion, self._autocast_device(model))
        return super().valid_step(sample, model, criterion)

    def inference_step(self, generator, models, sample, prefix_tokens=None, constraints=None):
        if not self.autocast_bf16:
            return super().inference_step(
                generator, models, sample, prefix_tokens=prefix_tokens, constraints=constraints
            )
        with torch.autocast(device_type=self._autocast_device(models[0]), dtype=torch.bfloat16):
            return super().inference_step(
                generator, models, sample, prefix_tokens=prefix_tokens, constraints=constraints
            )


@dataclass
class TranslationDeepInitConfig(TranslationConfig, AutocastConfig):
    pass


@register_task(TASK_NAME, dataclass=TranslationDeepInitConfig)
class TranslationDeepInitTask(AutocastTaskMixin, TranslationTask):
    """fairseq's translation task plus ``--autocast-bf16``."""
