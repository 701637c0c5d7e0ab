"""Admin: adaptive model initialisation (Liu et al. 2020, "Understanding the Difficulty of Training
Transformers", sec. 4.3 and appendix C; released code: LiyuanLucasLiu/Transformer-Clinic).

Every Post-LN sub-layer i of a stack scales its skip path by a per-dimension vector omega_i::

    x_i = LN(x_{i-1} * omega_i + f_i(x_{i-1}))                              (Liu et al. 2020, sec. 4.3)

omega_i starts at 1 and is set once, before the first update, from the variances of the residual
branches on the first training batch ("profiling"). Two formulas:

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
of :class:`~fairseq_deepinit.diagnostics.hooks.ResidualStatistics`; over several ranks the raw moments are summed
before any variance is taken, so every rank sets the same omega. omega is an ``nn.Parameter`` (trainable
unless ``--admin-freeze-omega``) and each residual module carries a ``profiled`` buffer, so checkpoints
hold everything: generation needs no profile file and a resumed run does not profile again.

This module holds the residual module and registers ``--residual-scale admin``, the ``admin`` init
scheme and the ``admin_<size>`` architectures; the ``--admin-*`` options are :mod:`.options`,
profiling :mod:`.profiling`, profile files :mod:`.profile_file`, profiling inside fairseq-train
:mod:`.task`, folding omega into a plain Post-LN checkpoint :mod:`.export`.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Dict, Iterable, List

import torch
import torch.nn as nn

from .. import options
from ..architectures import register_family
from ..diagnostics.hooks import sublayer_name
from ..errors import AdminConfigError, AdminNotProfiledError
from ..modules.residual import Residual, register_residual
from ..modules.stacks import StackKind
from ..schemes import WITH_NORM, SchemeSpec, iter_layers, register_post_init_hook, register_scheme
from ..schemes.baseline import apply_baseline
from .closed_form import CLOSED_FORM, closed_form_omega

FORMULAS = ("code", "paper")
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
# tasks that profile omega before the first update (the task module adds its name)
PROFILING_TASKS: set = set()


class AdminResidual(Residual):
    """``x_{i-1} * omega + f_i(x_{i-1})`` with ``omega`` a learned vector of size d starting at 1.

    ``profiled`` (a buffer, so it travels in checkpoints) records whether omega was set by profiling
    or from a profile file. fairseq's training step calls ``set_num_updates`` on every module before
    its forward; a training-mode forward after that with omega never profiled is an error (the model
    would silently train as Post-LN with omega = 1, e.g. under ``--task translation``).

    The host keeps a copy of the flag (:meth:`is_profiled`), so that no training step reads the
    buffer back from the device: set by :meth:`mark_profiled` and by loading a state dict, kept
    across ``.to()``, and valid while the buffer's version counter (bumped by any in-place write)
    is the one it was taken at; after any other write the buffer is read once.
    """

    def __init__(self, dim: int, trainable: bool = True) -> None:
        super().__init__()
        self.omega = nn.Parameter(torch.ones(dim), requires_grad=trainable)
        self.register_buffer("profiled", torch.zeros((), dtype=torch.uint8))
        self._remember(False)
        self._in_fairseq_training = False
        self._profiling = False

    def _remember(self, flag: bool) -> None:
        self.host_profiled = flag  # the host's copy of ``profiled`` ...
        self._host_version = self.profiled._version  # ... taken at this version of the buffer

    def is_profiled(self) -> bool:
        """The ``profiled`` flag, from the host's copy while it is current (otherwise read once)."""
        if self._host_version != self.profiled._version:
            self._remember(bool(self.profiled))
        return self.host_profiled

    def mark_profiled(self) -> None:
        """Record that omega is set (by profiling, a profile file or the closed form)."""
        with torch.no_grad():
            self.profiled.fill_(1)
        self._remember(True)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # a checkpoint's flag (fairseq loads checkpoints on the CPU: reading it waits for no device)
        flag = state_dict.get(prefix + "profiled")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if flag is not None:
            self._remember(bool(flag))

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .to_empty() make a new buffer (a new version counter): the flag is the same
        current = self._host_version == self.profiled._version
        out = super()._apply(fn, *args, **kwargs)
        if current:
            self._remember(self.host_profiled)
        return out

    def skip(self, residual: torch.Tensor) -> torch.Tensor:
        return residual * self.omega

    def set_num_updates(self, num_updates: int) -> None:
        self._in_fairseq_training = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # a plain attribute first: once profiled, the check reads no tensor state (nor does torch.compile)
        if (
            self.training
            and self._in_fairseq_training
            and not (self._profiling or self.host_profiled or self.is_profiled())
        ):
            raise AdminNotProfiledError(
                "Admin's omega was never profiled, so this would train plain Post-LN with omega = 1. "
                "Train with --task translation_admin (language_modeling_admin for a language model; it "
                "profiles before the first update), or load a profile with --admin-profile-path under that task."
            )
        return super().forward(x, residual)

    def extra_repr(self) -> str:
        return f"dim={self.omega.numel()}, trainable={self.omega.requires_grad}"


def _build_admin_residual(cfg, kind: StackKind, sublayer: str, layer_idx: int) -> AdminResidual:
    dim = cfg.encoder.embed_dim if kind.stack == "encoder" else cfg.decoder.embed_dim
    return AdminResidual(dim, trainable=not getattr(cfg, "admin_freeze_omega", None))


@torch.no_grad()
def set_closed_form_omega(model: nn.Module, cfg) -> None:
    """Post-init hook: profiling-free Admin (closed_form.py), omega from the depth, so it counts as profiled.

    n is counted per stack over the residual modules its layers were built with (one per sub-layer
    of each layer: 2N encoder, 3M decoder with cross-attention, 2M decoder-only), admin-torch's
    "total number of residual layers" (admin_torch/admin.py:64).
    """
    if getattr(cfg, "residual_scale", None) != "admin" or getattr(cfg, "admin_formula", None) != CLOSED_FORM:
        return
    stacks: Dict[str, List[nn.Module]] = defaultdict(list)
    for stack, _l, layer in iter_layers(model):
        stacks[stack] += list(layer.residuals.values())
    for modules in stacks.values():
        omega = closed_form_omega(len(modules), cfg.admin_output_change)
        for res in modules:
            res.omega.fill_(omega)
            res.mark_profiled()


register_residual("admin", _build_admin_residual)
register_post_init_hook(set_closed_form_omega)
options.POST_LN_RESIDUALS.add("admin")
register_scheme(
    SchemeSpec(
        "admin",
        apply_baseline,  # omega starts at 1; profiling sets it before the first update
        "Admin (Liu et al. 2020): LN(x*omega + f(x)), omega profiled on the first batch, Post-LN",
        allowed_norms=WITH_NORM,
        norm_reason="Admin is a Post-LN method: x_i = LN(x_{i-1} * omega_i + f_i(x_{i-1}))",
        residual="admin",
        needs_post_ln=True,
    )
)
register_family("admin", dict(init_scheme="admin"))
# profiling-free Admin (admin-torch's closed form, O(logn)); trains under --task translation
register_family("admin_closed", dict(init_scheme="admin", admin_formula=CLOSED_FORM))


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
