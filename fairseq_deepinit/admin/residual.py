"""Admin's model helpers: its residual modules in a model, whether they are profiled, the profile constants.

Admin (Liu et al. 2020, sec. 4.3): every Post-LN sub-layer i scales its skip path by a learned vector
omega_i, ``x_i = LN(x_{i-1} * omega_i + f_i(x_{i-1}))``
(:class:`~fairseq_deepinit.modules.residual.AdminResidual`; the method's record is
:mod:`fairseq_deepinit.methods.admin`). omega_i starts at 1 and is set once, before the first update,
from the variances of the residual branches on the first training batch ("profiling"). Two formulas:

- ``code`` (default, the released code; METHODS "decision"): per stack, in forward order, with a
  running ratio r that starts at 1 for the encoder and again for the decoder::

      omega_i = r_i                       (filled into all d entries before sub-layer i runs)
      r_{i+1} = sqrt(Var[x_{i-1} * omega_i] + Var[f_i(x_{i-1})])

  so sub-layer i+1 already sees the output of sub-layer i computed with its new omega_i, exactly as
  the released profiling run does within its single forward pass.
- ``paper`` (sec. 4.3): profile with omega = 1 everywhere, then::

      omega_i = sqrt(sum_{j<i} Var[f_j(x_{j-1})])     for i >= 2;   omega_1 = 1

  (the sum is empty for the first sub-layer of a stack; its omega keeps the profiling value 1, which is
  also what the released code gives it, rather than 0, which would cut the embeddings off the skip path).

Variances are population variances over every element of the tensors (padding included, dropout
on: the model is in training mode), as in the released code. They are gathered by the forward hooks
of :class:`~fairseq_deepinit.diagnostics.hooks.ResidualStatistics`; over several ranks every rank profiles all
ranks' batches merged into one (:mod:`.gather`), so omega is what one process sets on those batches,
the same on every rank and independent of how the batches were split. omega is an ``nn.Parameter`` (trainable
unless ``--admin-freeze-omega``) and each residual module carries a ``profiled`` buffer, so checkpoints
hold everything: generation needs no profile file and a resumed run does not profile again.

Profiling is :mod:`.profiling`, profile files :mod:`.profile_file`, profiling inside fairseq-train
:mod:`.profiling_task` and :mod:`.task`, folding omega into a plain Post-LN checkpoint
:mod:`fairseq_deepinit.export.omega` and :mod:`.export`.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Dict, Iterable, List

import torch.nn as nn

from ..errors import AdminConfigError
from ..methods.admin import FORMULAS, LM_TASK, PROFILING_TASKS, TRANSLATION_TASK
from ..modules.residual import AdminResidual, sublayer_name

__all__ = ["FORMULAS", "LM_TASK", "PROFILING_TASKS", "TRANSLATION_TASK", "AdminResidual"]

PROFILE_FORMAT = "fairseq-deepinit admin profile v1"
# The omega a profile file may set. Both formulas give a square root of accumulated variances of
# LayerNorm-ed sub-layers: ``code`` starts at 1 and only grows (r_{i+1} = sqrt(Var[x * omega_i] +
# Var f_i) with Var x ~ 1 after the norm, so omega >= 1 in practice), ``paper`` is sqrt(sum_{j<i}
# Var f_j); both grow like sqrt(number of sub-layers), i.e. stay below ~100 even for 1000+1000
# layers. The bounds are fp16's normal range, rounded inwards (6.1e-5 .. 65504): omega is a model
# parameter, under --fp16 an fp16 one, and outside that range it is rounded to 0 / inf or loses its
# precision. Within it the values already mean "no skip path" (1e-4) or "no branch" (1e4: the
# sub-layer adds 1e-4 of the skip's scale before the norm), so anything beyond is a broken file
# (a hand edit, a profile of diverged statistics), not a setting.
OMEGA_MIN = 1e-4
OMEGA_MAX = 1e4


# --- model helpers


def admin_residuals(model: nn.Module) -> OrderedDict[str, AdminResidual]:
    """``{sub-layer name: AdminResidual}`` in module order (= forward order within each stack)."""
    return OrderedDict((sublayer_name(name), m) for name, m in model.named_modules() if isinstance(m, AdminResidual))


def unwrap_model(model: nn.Module) -> nn.Module:
    """The fairseq model inside fairseq's DDP / proxy wrappers (``trainer.model`` -> ``trainer.get_model()``)."""
    from fairseq.models import BaseFairseqModel

    while not isinstance(model, BaseFairseqModel) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def is_profiled(model: nn.Module) -> bool:
    """True when every Admin residual module's omega was profiled (or loaded from a profile)."""
    flags = [m.is_profiled() for m in admin_residuals(model).values()]
    if flags and any(flags) != all(flags):
        raise AdminConfigError("some Admin sub-layers are profiled and others are not; this checkpoint is corrupt")
    return bool(flags) and all(flags)


def omega_parameters(model: nn.Module) -> List[nn.Parameter]:
    return [m.omega for m in admin_residuals(model).values()]


def stacks_of(names: Iterable[str]) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = defaultdict(list)
    for name in names:
        out[name.split(".", 1)[0]].append(name)
    return dict(out)


def model_shape(model: nn.Module) -> dict:
    res = admin_residuals(model)
    return {
        "encoder_layers": len(model.encoder.layers) if getattr(model, "encoder", None) is not None else 0,
        "decoder_layers": len(model.decoder.layers),
        "encoder_embed_dim": _dim_of(res, "encoder"),
        "decoder_embed_dim": _dim_of(res, "decoder"),
    }


def _dim_of(res: dict, stack: str) -> int | None:
    for name, m in res.items():
        if name.startswith(stack + "."):
            return m.omega.numel()
    return None
