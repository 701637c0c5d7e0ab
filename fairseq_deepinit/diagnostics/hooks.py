"""Residual-branch statistics gathered by forward hooks, shared by Admin profiling and diagnostics.

Every sub-layer of a ``deepinit`` layer ends in one :class:`~fairseq_deepinit.modules.residual.Residual`
module called as ``residual_module(x, residual)``, with ``x`` the (dropped-out) branch output
f_i(x_{i-1}) and ``residual`` the sub-layer input x_{i-1}. A forward hook on those modules sees
exactly the two quantities the papers reason about, without touching any layer's code path:

- ``branch``: f_i(x_{i-1}), whose variance Admin's omega is built from (Liu et al. 2020, eq. 6 and
  the released code's recurrence) and DS-Init's Var(r) (Zhang et al. 2019, Table 1);
- ``skip``: the skip term as it enters the sum, ``module.scaled_skip(skip)`` (x_{i-1} * omega_i under
  Admin, alpha * x_{i-1} under DeepNorm, x_{i-1} otherwise).

Moments are accumulated in float64 over every element (the released Admin code's convention), so
statistics from several batches or several ranks combine exactly: :meth:`ResidualStatistics.all_reduce`
sums the raw moments across ranks before any variance is taken. Variances are population variances.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List

import torch
import torch.nn as nn

from ..modules.norms import ScaleNorm, is_norm
from ..modules.residual import Residual, residual_modules, sublayer_name

__all__ = [
    "NormInputStatistics",
    "ResidualStatistics",
    "element_count",
    "residual_modules",
    "residual_variance_tensors",
    "residual_variances",
    "sublayer_name",
]

# moment slots of ResidualStatistics: element count, sum and sum of squares of the branch, then of the
# skip term (read them through element_count / residual_variance_tensors / residual_variances)
_N, _SB, _QB, _SS, _QS = range(5)


class _ForwardHookStatistics:
    """Attach/detach/reset of float64 moment sums kept per module by a forward hook (``_hook``)."""

    modules: Dict[str, nn.Module]
    moments: Dict[str, torch.Tensor]
    order: List[str]
    _handles: list

    def _hook(self, name: str):  # pragma: no cover - abstract
        raise NotImplementedError

    def _hook_name(self, module_name: str) -> str:
        return module_name

    def attach(self):
        if not self._handles:
            self._handles = [m.register_forward_hook(self._hook(self._hook_name(n))) for n, m in self.modules.items()]
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self):
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def reset(self) -> None:
        self.moments.clear()
        self.order.clear()


class ResidualStatistics(_ForwardHookStatistics):
    """Accumulate moments of every residual branch and skip term while attached.

    Use as a context manager around forward passes::

        with ResidualStatistics(model) as stats:
            model(**batch["net_input"])
        stats.all_reduce(group)          # optional: combine ranks
        stats.variances()                # {name: {"branch": var, "skip": var}}

    ``order`` lists the sub-layers in the order their forward first ran, which is the order of
    the Admin recurrence within each stack.
    """

    def __init__(self, model: nn.Module) -> None:
        self.modules = residual_modules(model)
        if not self.modules:
            raise ValueError(
                "this model has no deepinit residual modules to measure; use an architecture of the "
                "'deepinit' model (--arch <family>_<size>, see the README)"
            )
        self.moments: Dict[str, torch.Tensor] = {}
        self.order: List[str] = []
        self._handles: list = []

    def _hook(self, name: str):
        def hook(module: Residual, inputs, output) -> None:
            branch, skip = inputs[0], inputs[1]
            with torch.no_grad():
                b = branch.detach().double()
                s = module.scaled_skip(skip).detach().double()  # a stream residual's skip is a tuple
                # the count is filled on the device: a host tensor would be copied in on every call
                row = torch.stack(
                    [torch.full((), float(b.numel()), dtype=torch.float64, device=b.device),
                     b.sum(), b.pow(2).sum(), s.sum(), s.pow(2).sum()]
                )  # fmt: skip
            if name not in self.moments:
                self.moments[name] = torch.zeros(5, dtype=torch.float64, device=b.device)
                self.order.append(name)
            self.moments[name] += row

        return hook

    def _hook_name(self, module_name: str) -> str:
        return sublayer_name(module_name)

    def all_reduce(self, group=None) -> None:
        """Sum the raw moments over the ranks of ``group`` (no-op without torch.distributed).

        Every rank must have run the same sub-layers (always true for one encoder-decoder model);
        the names are taken in model order so that the stacked tensor lines up across ranks.
        """
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        names = [sublayer_name(n) for n in self.modules]
        missing = [n for n in names if n not in self.moments]
        if missing and len(missing) != len(names):
            # a sub-layer that never ran (decoder without cross-attention input): zero moments
            for n in missing:
                self.moments[n] = torch.zeros(5, dtype=torch.float64, device=next(iter(self.moments.values())).device)
        if not self.moments:
            raise RuntimeError("no statistics to reduce: run at least one forward pass while attached")
        stacked = torch.stack([self.moments[n] for n in names])
        from fairseq.distributed import utils as dist_utils

        dist_utils.all_reduce(stacked, group=group)
        for i, n in enumerate(names):
            self.moments[n] = stacked[i]

    def variances(self) -> OrderedDict[str, Dict[str, float]]:
        """``{sub-layer: {"branch": Var(f_i), "skip": Var(skip term), "count": n}}`` in forward order."""
        out: OrderedDict[str, Dict[str, float]] = OrderedDict()
        for name in self.order:
            m = self.moments[name]
            n = m[_N].item()
            if n == 0:
                continue
            out[name] = {
                "branch": (m[_QB] / n - (m[_SB] / n) ** 2).item(),
                "skip": (m[_QS] / n - (m[_SS] / n) ** 2).item(),
                "count": n,
            }
        return out


# --------------------------------------------------------------------------------------------
# Normalisation-layer inputs (T-Fixup Fig. 3), learned scalars of residual and norm modules
# --------------------------------------------------------------------------------------------


def _fused_layernorm_classes() -> tuple:
    """apex's FusedLayerNorm, which fairseq's ``LayerNorm()`` returns on GPU when apex is installed.

    It derives from ``nn.Module``, not ``nn.LayerNorm``, so :func:`fairseq_deepinit.modules.norms.is_norm`
    alone would miss every sub-layer norm of a model built on such a machine.
    """
    from fairseq.modules import layer_norm

    return tuple(c for c in (getattr(layer_norm, "_FusedLayerNorm", None),) if isinstance(c, type))


def is_norm_module(module: nn.Module) -> bool:
    """A normalisation layer of any kind the model can hold (LayerNorm, fused LayerNorm, ScaleNorm, RMSNorm)."""
    return is_norm(module) or isinstance(module, _fused_layernorm_classes())


def norm_modules(model: nn.Module) -> OrderedDict[str, nn.Module]:
    """Every normalisation layer of ``model`` by name (``encoder.layers.0.final_layer_norm``), module order."""
    return OrderedDict((clean_name(n), m) for n, m in model.named_modules() if is_norm_module(m))


def clean_name(module_name: str) -> str:
    """Drop the prefixes that activation checkpointing and FSDP put into module names."""
    return module_name.replace("._checkpoint_wrapped_module", "").replace("_fsdp_wrapped_module.", "")


# moment slots of a norm input: vectors, sum of ||x||_2, sum of ||x||_2^2, elements, sum of elements
_NV, _NS, _NQ, _NE, _NX = range(5)


class NormInputStatistics(_ForwardHookStatistics):
    """Accumulate moments of the input of every normalisation layer while attached.

    The quantity T-Fixup (Huang et al. 2020, Fig. 3) plots is the size of what enters each
    LayerNorm; here it is kept per position as the l2 norm over the model dimension, so that
    :meth:`statistics` gives the mean norm, its root mean square and the element variance.
    Moments are float64 sums, so batches and ranks combine exactly (:meth:`all_reduce`), exactly as
    :class:`ResidualStatistics` does. Use as a context manager around forward passes.
    """

    def __init__(self, model: nn.Module) -> None:
        self.modules = norm_modules(model)
        self.moments: Dict[str, torch.Tensor] = {}
        self.order: List[str] = []
        self._handles: list = []

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs, output) -> None:
            with torch.no_grad():
                x = inputs[0].detach().double()
                norms = x.norm(dim=-1)
                row = torch.stack(
                    [torch.full((), float(norms.numel()), dtype=torch.float64, device=x.device), norms.sum(),
                     x.pow(2).sum(), torch.full((), float(x.numel()), dtype=torch.float64, device=x.device), x.sum()]
                )  # fmt: skip
            if name not in self.moments:
                self.moments[name] = torch.zeros(5, dtype=torch.float64, device=x.device)
                self.order.append(name)
            self.moments[name] += row

        return hook

    def all_reduce(self, group=None) -> None:
        """Sum the raw moments over the ranks of ``group`` (no-op without torch.distributed)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        if not self.moments:
            raise RuntimeError("no statistics to reduce: run at least one forward pass while attached")
        device = next(iter(self.moments.values())).device
        names = list(self.modules)
        for n in names:
            self.moments.setdefault(n, torch.zeros(5, dtype=torch.float64, device=device))
        stacked = torch.stack([self.moments[n] for n in names])
        from fairseq.distributed import utils as dist_utils

        dist_utils.all_reduce(stacked, group=group)
        for i, n in enumerate(names):
            self.moments[n] = stacked[i]

    def statistics(self) -> OrderedDict[str, Dict[str, float]]:
        """``{norm: {"mean_norm", "rms_norm", "var", "count"}}`` in forward order (count: vectors)."""
        return OrderedDict((name, norm_input_statistics(self.moments[name])) for name in self.order)


def norm_input_statistics(moments: torch.Tensor) -> Dict[str, float]:
    """Mean and root-mean-square l2 norm of the input vectors, and the element variance, from raw moments."""
    n, e = moments[_NV].item(), moments[_NE].item()
    if n == 0:
        return {"mean_norm": float("nan"), "rms_norm": float("nan"), "var": float("nan"), "count": 0.0}
    return {
        "mean_norm": (moments[_NS] / n).item(),
        "rms_norm": (moments[_NQ] / n).sqrt().item(),
        "var": (moments[_NQ] / e - (moments[_NX] / e) ** 2).item(),
        "count": n,
    }


def element_count(moments: torch.Tensor) -> torch.Tensor:
    """The number of elements behind one row of :class:`ResidualStatistics` moments (a device scalar)."""
    return moments[_N]


def residual_variance_tensors(moments: torch.Tensor) -> tuple:
    """``(Var(skip), Var(branch))`` of one row of :class:`ResidualStatistics` moments, as device scalars
    (NaN without elements): for computations that must not read the device (Admin's recurrence)."""
    n = moments[_N]
    n = torch.where(n > 0, n, torch.full_like(n, float("nan")))
    branch = moments[_QB] / n - (moments[_SB] / n) ** 2
    skip = moments[_QS] / n - (moments[_SS] / n) ** 2
    return skip, branch


def residual_variances(moments: torch.Tensor) -> Dict[str, float]:
    """Population variances of branch and skip term from one row of :class:`ResidualStatistics` moments."""
    n = moments[_N].item()
    if n == 0:
        return {"branch": float("nan"), "skip": float("nan"), "count": 0.0}
    return {
        "branch": (moments[_QB] / n - (moments[_SB] / n) ** 2).item(),
        "skip": (moments[_QS] / n - (moments[_SS] / n) ** 2).item(),
        "count": n,
    }


def residual_parameters(model: nn.Module) -> OrderedDict[str, Dict[str, torch.Tensor]]:
    """The learned parameters that residual modules own themselves, by sub-layer.

    Read generically (``named_parameters(recurse=False)``) so that any residual scaling shows up
    without this module knowing it: Admin's per-sub-layer vector ``omega`` (Liu et al. 2020,
    eq. 6), ReZero's scalar ``alpha`` (Bachlechner et al. 2020, eq. 5), and any added later.
    """
    out: OrderedDict[str, Dict[str, torch.Tensor]] = OrderedDict()
    for name, module in residual_modules(model).items():
        params = {p_name: p for p_name, p in module.named_parameters(recurse=False)}
        if params:
            out[clean_name(sublayer_name(name))] = params
    return out


def scalenorm_gain_tensors(model: nn.Module) -> OrderedDict[str, torch.Tensor]:
    """The learned scale ``g`` of every ScaleNorm (Nguyen & Salazar 2019, eq. 3; their Fig. 3), by norm
    name, as the (scalar) parameters themselves."""
    return OrderedDict((clean_name(n), m.g) for n, m in model.named_modules() if isinstance(m, ScaleNorm))


def scalenorm_gains(model: nn.Module) -> OrderedDict[str, float]:
    """:func:`scalenorm_gain_tensors` as numbers (read from the device in one copy)."""
    gains = scalenorm_gain_tensors(model)
    if not gains:
        return OrderedDict()
    values = torch.stack([g.detach().float().reshape(()) for g in gains.values()]).tolist()
    return OrderedDict(zip(gains.keys(), values, strict=True))
