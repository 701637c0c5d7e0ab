"""Profiling Admin's omega on the first batch(es): the variances of every residual branch and skip
path, turned into omega by the ``code`` or ``paper`` formula (see :mod:`.residual`); and refreshing
fp16 master weights after omega changed.

With several ranks every rank profiles the same batch, all ranks' batches merged (:mod:`.gather`), and
takes the moments of the group's first rank (a broadcast per sub-layer for ``code``, once for
``paper``): every rank sets the omega one process sets on that batch, bit for bit, whatever kernels
each rank's device runs.

The recurrence runs on the device (omega is filled from device scalars as the forward goes); the
profile's numbers (variances, element counts, omegas, for the log and the profile file) are read to
the host once, at the end.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, defaultdict
from typing import Dict, List

import torch
import torch.nn as nn

from ..diagnostics.hooks import ResidualStatistics, element_count, residual_variance_tensors
from ..errors import AdminConfigError
from ..modules.attention import exact_padding_rows
from .residual import FORMULAS, PROFILE_FORMAT, AdminResidual, admin_residuals, model_shape, stacks_of

logger = logging.getLogger(__name__)


def code_ratio(var_skip: float, var_branch: float) -> float:
    """The released code's recurrence: r_{i+1} = sqrt(Var[x_{i-1} * omega_i] + Var[f_i(x_{i-1})])."""
    return math.sqrt(var_skip + var_branch)


def paper_omegas(var_branches: List) -> List:
    """Paper sec. 4.3: omega_i = sqrt(sum_{j<i} Var[f_j]) for i >= 2 and omega_1 = 1, for one stack
    (numbers, or device scalars: then device scalars, with no host read)."""
    out, total = [], 0.0
    for i, v in enumerate(var_branches):
        if torch.is_tensor(v):
            out.append(torch.ones_like(v) if i == 0 else torch.sqrt(total))
        else:
            out.append(1.0 if i == 0 else math.sqrt(total))
        total = total + v
    return out


def data_parallel_group():
    """fairseq's data-parallel process group, or None when torch.distributed is not initialised."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from fairseq.distributed import utils as dist_utils

    return dist_utils.get_data_parallel_group()


def world_size(group) -> int:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    from fairseq.distributed import utils as dist_utils

    return dist_utils.get_world_size(group)


def _from_first_rank(tensor: torch.Tensor, group) -> None:
    """Overwrite ``tensor`` with the group's first rank's (a broadcast; every rank calls it)."""
    src = torch.distributed.get_process_group_ranks(group)[0] if group is not None else 0
    torch.distributed.broadcast(tensor, src=src, group=group)


class _ProgressiveOmega:
    """Forward pre-hooks that set omega_i just before sub-layer i runs (released-code recurrence).

    The pre-hook of sub-layer i reads the moments the statistics hook recorded for sub-layer i-1 of
    the same stack, takes the first rank's (once; every rank profiled the same batch), and fills
    omega_i with the new ratio.
    """

    def __init__(self, stats: ResidualStatistics, residuals: OrderedDict[str, AdminResidual], group) -> None:
        self.stats = stats
        self.group = group
        self.reduce = world_size(group) > 1
        self.reduced: set = set()
        self.ratios: Dict[str, torch.Tensor | float] = {}
        self.previous: Dict[str, str | None] = {}
        for names in stacks_of(residuals).values():
            for i, name in enumerate(names):
                self.previous[name] = names[i - 1] if i else None
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in residuals.items()]

    def reduce_moments(self, name: str) -> torch.Tensor:
        moments = self.stats.moments[name]
        if self.reduce and name not in self.reduced:
            _from_first_rank(moments, self.group)
        self.reduced.add(name)
        return moments

    def _hook(self, name: str):
        def hook(module: AdminResidual, inputs) -> None:
            prev = self.previous[name]
            if prev is None:
                ratio = 1.0
            else:
                if prev not in self.stats.moments:
                    raise RuntimeError(f"Admin profiling: {prev} did not run before {name}")
                var_skip, var_branch = residual_variance_tensors(self.reduce_moments(prev))
                ratio = torch.sqrt(var_skip + var_branch)  # code_ratio, on the device
            self.ratios[name] = ratio
            with torch.no_grad():
                module.omega.fill_(ratio)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def profile_model(model: nn.Module, net_input: dict, formula: str = "code", group=None) -> dict:
    """Profile ``model`` on one batch, set omega and mark the model profiled; returns the profile.

    ``model`` is an (unwrapped) deepinit model with ``--residual-scale admin``; it is run in its
    current mode (fairseq-train: training, so dropout is on, as in the released code) under
    ``torch.no_grad``; only the encoder and the decoder's features run (no output projection). A
    decoder-only language model (no ``encoder``) runs its decoder on ``net_input["src_tokens"]``, fairseq's
    language-modeling batch; the recurrence then covers its one stack.
    ``group``: the process group whose first rank's moments every rank takes (default: fairseq's
    data-parallel group when torch.distributed is initialised). Every rank must call this at the same
    time, on the same batch (:func:`.gather.gather_net_inputs`).
    """
    if formula not in FORMULAS:
        raise AdminConfigError(f"unknown Admin formula {formula!r}; choose from {', '.join(FORMULAS)}")
    residuals = admin_residuals(model)
    if not residuals:
        raise AdminConfigError(
            "this model has no Admin omega to profile; use --arch admin_<size> (or --init-scheme admin / "
            "--residual-scale admin)"
        )
    if group is None:
        group = data_parallel_group()
    start = time.perf_counter()
    stats = ResidualStatistics(model)
    progressive = _ProgressiveOmega(stats, residuals, group) if formula == "code" else None
    with torch.no_grad():
        for m in residuals.values():
            m.omega.fill_(1.0)
            m._profiling = True
    try:
        # the statistics count padding positions, as the released code's: keep fairseq's values there
        with stats, torch.no_grad(), exact_padding_rows(model):
            encoder = getattr(model, "encoder", None)
            # padded target positions are in the statistics (released code), computed as there: masked
            if encoder is None:  # decoder-only language model
                model.decoder.extract_features(net_input["src_tokens"], encoder_out=None, mask_padding=True)
            else:
                encoder_out = encoder(net_input["src_tokens"], src_lengths=net_input.get("src_lengths"))
                model.decoder.extract_features(
                    net_input["prev_output_tokens"], encoder_out=encoder_out, mask_padding=True
                )
    finally:
        for m in residuals.values():
            m._profiling = False
        if progressive is not None:
            progressive.remove()

    ran = [n for n in stats.order if n in residuals]
    for stack, names in stacks_of(residuals).items():
        order = [n for n in ran if n.startswith(stack + ".")]
        if order != names:
            missing = [n for n in names if n not in order]
            raise AdminConfigError(
                f"Admin profiling expects every {stack} sub-layer to run once, in order; "
                f"{'missing: ' + ', '.join(missing) if missing else 'got order ' + ', '.join(order)}"
            )
    if progressive is not None:
        for name in residuals:
            progressive.reduce_moments(name)
    elif world_size(group) > 1:
        for name in residuals:
            _from_first_rank(stats.moments[name], group)

    variances = {name: residual_variance_tensors(stats.moments[name]) for name in residuals}
    omegas: Dict[str, torch.Tensor | float] = {}
    if formula == "code":
        omegas = {name: progressive.ratios[name] for name in residuals}
    else:
        for names in stacks_of(residuals).values():
            omegas.update(zip(names, paper_omegas([variances[n][1] for n in names]), strict=True))
    # the one read of the profile: per sub-layer Var(skip), Var(branch), elements, omega
    device = stats.moments[next(iter(residuals))].device

    def row(n: str) -> torch.Tensor:
        omega = torch.as_tensor(omegas[n], dtype=torch.float64, device=device)
        return torch.stack([*variances[n], element_count(stats.moments[n]), omega])

    rows = torch.stack([row(n) for n in residuals]).tolist()
    read = dict(zip(residuals, rows, strict=True))
    bad = [n for n, r in read.items() if not (math.isfinite(r[3]) and r[3] > 0)]
    if bad:
        raise FloatingPointError(
            f"Admin profiling gave a non-positive or non-finite omega for {', '.join(bad)}: the profiling batch "
            "produced degenerate statistics (empty batch, NaN/inf activations). Check the data and --fp16 scale."
        )
    with torch.no_grad():
        for name, m in residuals.items():
            m.omega.fill_(omegas[name])
            m.mark_profiled()

    src = net_input["src_tokens"]
    profile = {
        "format": PROFILE_FORMAT,
        "formula": formula,
        **model_shape(model),
        "ranks": world_size(group),
        "sentences": int(src.size(0)),
        "source_shape": list(src.shape),
        "target_shape": list(net_input.get("prev_output_tokens", src).shape),
        "seconds": round(time.perf_counter() - start, 4),
        "sublayers": [
            {"name": name, "var_branch": r[1], "var_skip": r[0], "elements": int(r[2]), "omega": r[3]}
            for name, r in read.items()
        ],
    }
    return profile


def log_profile(profile: dict, source: str) -> None:
    logger.info(
        f"admin: omega from {source} (formula={profile['formula']}, {profile.get('ranks', 1)} rank(s), "
        f"{profile.get('seconds', 0):.3f} s)"
    )
    logger.info(f"admin: {'sub-layer':<36} {'Var(f_i)':>12} {'Var(skip)':>12} {'omega':>10}")
    for row in profile["sublayers"]:
        logger.info(
            f"admin: {row['name']:<36} {row['var_branch']:>12.6g} {row['var_skip']:>12.6g} {row['omega']:>10.6g}"
        )


# --- mixed precision


def refresh_master_params(optimizer, params: List[nn.Parameter]) -> int:
    """Copy ``params`` (just changed in place) into fairseq's fp32 master copy, if the optimizer keeps one.

    ``--fp16`` (FP16Optimizer) copies the fp16 weights into fp32 master weights when it is built,
    before the first batch; its first step would write the master omega = 1 back into the model.
    Returns the number of tensors refreshed (0 for optimizers that update the model's own tensors).
    """
    fp16_params = getattr(optimizer, "fp16_params", None)
    fp32_params = getattr(optimizer, "fp32_params", None)
    if fp16_params is None or fp32_params is None:
        return 0
    wanted = {id(p) for p in params}
    done = 0
    if optimizer.has_flat_params:
        by_device: Dict[object, list] = defaultdict(list)
        for p in fp16_params:
            if p.requires_grad:
                by_device[p.device.index].append(p)
        for device, flat in fp32_params.items():
            offset = 0
            for p in by_device[device]:
                n = p.numel()
                if id(p) in wanted:
                    flat.data[offset : offset + n].copy_(p.data.view(-1))
                    done += 1
                offset += n
    else:
        for p, p32 in zip(fp16_params, fp32_params, strict=True):
            if id(p) in wanted:
                p32.data.copy_(p.data)
                done += 1
    return done
