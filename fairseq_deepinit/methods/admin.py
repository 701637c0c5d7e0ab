"""Admin, adaptive model initialisation (Liu et al. 2020, "Understanding the Difficulty of Training
Transformers", sec. 4.3 and appendix C; released code: LiyuanLucasLiu/Transformer-Clinic):
``--init-scheme admin`` / ``--residual-scale admin`` and the ``--admin-*`` options.

Every Post-LN sub-layer i of a stack scales its skip path by a per-dimension vector omega_i
(:class:`~fairseq_deepinit.modules.residual.AdminResidual`)::

    x_i = LN(x_{i-1} * omega_i + f_i(x_{i-1}))                              (Liu et al. 2020, sec. 4.3)

omega_i starts at 1 and is set once, before the first update, from the variances of the residual
branches on the first training batch ("profiling", :mod:`fairseq_deepinit.admin.profiling`, inside
``--task translation_admin`` / ``language_modeling_admin``), by the released code's recurrence
(``--admin-formula code``, default) or the paper's (``paper``); or, without profiling, from the depth
as admin-torch does (``closed-form``, below, set by :func:`set_closed_form_omega` when the model is
built). Profiling, profile files, the tasks and the export to plain Post-LN are Admin's machinery,
:mod:`fairseq_deepinit.admin`.

Profiling-free Admin, omega as a closed form of the depth (admin-torch, the Admin author's package):
``--admin-formula closed-form`` sets every omega of a stack, once, when the model is built::

    O(logn) (default):  omega = sqrt((n + 1) / ln(n + 1) - 1)
    O(n):               omega = 1          (plain Post-LN)
    O(1):               omega = sqrt(n)

with n the number of residual sub-layers of the stack (released code: microsoft/admin-torch @ 08b6605,
``admin_torch/admin.py:54-81``, ``calculate_init``; its docstring, admin.py:64, counts "2n residual
layers" for an n-layer encoder, and the package's example, admin.py:125, passes one count per stack).
The plugin counts as that docstring does, per stack, the residual sub-layers its layers were built
with (``layer.residuals``, one per sub-layer of the layer's kind, :mod:`~fairseq_deepinit.modules.stacks`):
2N for the encoder (self-attention, FFN), 3M for a decoder with cross-attention (self-attention,
cross-attention, FFN), 2M for a decoder-only stack (the language model, or ``--no-cross-attention``)
and for a MAtt decoder (merged attention, FFN). The fairseq integration the package README points
to (LiyuanLucasLiu/fairseq commit 33ad76a) is not in the public snapshot available here, so the
decoder's 3M is the docstring's rule applied to three sub-layers, not read from that commit. omega
is set after the model is built (:func:`set_closed_form_omega`) and is the same
per-dimension vector as profiled Admin's (``as_parameter``, trainable
unless ``--admin-freeze-omega``, as admin-torch's example script's ``--encoder-as-parameter``), so
checkpoints, export to plain Post-LN and the diagnostics are unchanged; no profiling pass is needed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, List

import torch
import torch.nn as nn

from ..errors import AdminConfigError
from ..modules.init import apply_baseline
from ..modules.residual import AdminResidual
from ..modules.stacks import iter_layers
from .exporting import EXPORT_NEUTRAL, folds
from .record import FLAG, WITH_NORM, InitScheme, Method, Option, ResidualScaling, Rule, a_norm, flag, post_ln

FORMULAS = ("code", "paper")  # the profiled ones (fairseq_deepinit.admin.profiling)
CLOSED_FORM = "closed-form"
OUTPUT_CHANGE_SCALES = ("O(logn)", "O(n)", "O(1)")
DEFAULT_OUTPUT_CHANGE = "O(logn)"


def closed_form_omega(num_res_layers: int, output_change_scale: str = DEFAULT_OUTPUT_CHANGE) -> float:
    """admin-torch's ``calculate_init`` (admin_torch/admin.py:73-81) for ``num_res_layers`` >= 1."""
    if num_res_layers < 1:
        raise ValueError(f"closed-form Admin needs at least one residual sub-layer, got {num_res_layers}")
    if output_change_scale == "O(logn)":
        value = (num_res_layers + 1) / math.log(num_res_layers + 1) - 1
    elif output_change_scale == "O(n)":
        value = 1.0
    elif output_change_scale == "O(1)":
        value = float(num_res_layers)
    else:
        raise ValueError(f"unknown output change scale {output_change_scale!r}; choose from {OUTPUT_CHANGE_SCALES}")
    return value**0.5


OMEGA_FORMULAS = FORMULAS + (CLOSED_FORM,)
# the tasks that profile omega before the first update (fairseq_deepinit.admin.task, fairseq_deepinit.lm.task)
TRANSLATION_TASK = "translation_admin"
LM_TASK = "language_modeling_admin"
PROFILING_TASKS = (TRANSLATION_TASK, LM_TASK)
# read by the profiling task only: a resumed run may change them
_PROFILING_OPTIONS = ("admin_profile_batches", "admin_profile_max_tokens", "admin_profile_path", "admin_profile_only")

OPTIONS = (
    Option(
        "admin_formula",
        str,
        "code",
        "omega from the released code's recurrence (code, default), the paper's "
        "sqrt(sum_{j<i} Var f_j) (paper), or without profiling from the depth as admin-torch does "
        "(closed-form, see --admin-output-change); docs/admin.md",
        choices=OMEGA_FORMULAS,
    ),
    Option(
        "admin_output_change",
        str,
        None,  # closed-form only; its default is set there
        "closed-form Admin: the output change scale omega is chosen for (admin-torch's "
        "output_change_scale): O(logn) (default), O(n) (omega = 1) or O(1) (omega = sqrt(n))",
        choices=OUTPUT_CHANGE_SCALES,
    ),
    Option(
        "admin_freeze_omega",
        bool,
        False,
        "keep omega fixed after profiling (default: trainable, as in the released code)",
    ),
    Option(
        "admin_profile_batches",
        int,
        1,
        "profile on the first K training batches of each rank, merged (default 1, the paper's)",
        metavar="K",
        check=lambda k: None if k >= 1 else f"--admin-profile-batches must be at least 1, got {k}",
        resume=False,
    ),
    Option(
        "admin_profile_max_tokens",
        int,
        8192,
        "cap on the profiling batch, padded tokens as --max-tokens counts them (default 8192)",
        metavar="T",
        check=lambda t: None if t >= 1 else f"--admin-profile-max-tokens must be positive, got {t}",
        resume=False,
    ),
    Option(
        "admin_profile_path",
        str,
        None,
        "with --admin-profile-only: where to write the profile; otherwise: a profile to load instead "
        "of profiling (two-step workflow)",
        metavar="FILE.json",
        resume=False,
    ),
    Option(
        "admin_profile_only",
        bool,
        False,
        "profile on the first batch, write --admin-profile-path and stop before the first update",
        resume=False,
    ),
)
_DEFAULTS = {o.name: o.default for o in OPTIONS}


@torch.no_grad()
def set_closed_form_omega(model: nn.Module, p, spec) -> None:
    """Post-init: profiling-free Admin (closed_form.py), omega from the depth, so it counts as profiled.

    n is counted per stack over the residual modules its layers were built with (one per sub-layer
    of each layer: 2N encoder, 3M decoder with cross-attention, 2M decoder-only), admin-torch's
    "total number of residual layers" (admin_torch/admin.py:64).
    """
    if p.admin_formula != CLOSED_FORM:
        return
    stacks: Dict[str, List[nn.Module]] = defaultdict(list)
    for stack, _l, layer in iter_layers(model):
        stacks[stack] += list(layer.residuals.values())
    for modules in stacks.values():
        omega = closed_form_omega(len(modules), p.admin_output_change)
        for res in modules:
            res.omega.fill_(omega)
            res.mark_profiled()


def validate_admin_args(p, spec) -> None:
    """Admin's options among themselves: ``--admin-output-change`` only with closed-form, which never profiles;
    the profiling options only under a profiling task, and ``--admin-profile-only`` with a path to write."""
    given = [n for n in _PROFILING_OPTIONS if p[n] not in (None, False, _DEFAULTS[n])]
    if p.admin_formula != CLOSED_FORM and p.admin_output_change is not None:
        raise AdminConfigError(
            f"--admin-output-change only applies to --admin-formula {CLOSED_FORM}; drop it or add "
            f"--admin-formula {CLOSED_FORM}"
        )
    if p.admin_formula == CLOSED_FORM and given:
        raise AdminConfigError(
            f"--admin-formula {CLOSED_FORM} sets omega from the depth and never profiles; drop "
            f"{', '.join(map(flag, given))} (or use --admin-formula code)"
        )
    if p.admin_profile_only and not p.admin_profile_path:
        raise AdminConfigError("--admin-profile-only writes the profile to --admin-profile-path; add it")
    task = spec.task
    if given and task is not None and task not in PROFILING_TASKS:
        profiling_task = TRANSLATION_TASK if spec.encoder is not None else LM_TASK
        raise AdminConfigError(
            f"{', '.join(map(flag, given))} {'is' if len(given) == 1 else 'are'} read by the profiling task; add "
            f"--task {profiling_task} (got --task {task})"
        )


def derive_output_change(p, layers) -> dict:
    """closed-form's ``--admin-output-change`` default (the other formulas have none)."""
    if p.admin_formula == CLOSED_FORM and p.admin_output_change is None:
        return {"admin_output_change": DEFAULT_OUTPUT_CHANGE}
    return {}


def profiling_task(p, spec) -> str | None:
    """The task a run trains under: a profiling task while omega is profiled (closed-form omega: the user's)."""
    if p.admin_formula == CLOSED_FORM:
        return None
    return TRANSLATION_TASK if spec.encoder is not None else LM_TASK


def describe_admin(p) -> str:
    closed = f",{p.admin_output_change}" if p.admin_formula == CLOSED_FORM else ""
    return f"admin={p.admin_formula}{closed}" + (",frozen" if p.admin_freeze_omega else "")


METHOD = Method(
    name="admin",
    title="Admin",
    paper="Liu et al. 2020, sec. 4.3, appendix C; admin-torch's closed form",
    summary="`LN(x * omega + f(x))`, omega profiled on the first batch (`--task translation_admin`) or "
    "`--admin-formula closed-form` from the depth; exportable to plain Post-LN",
    code="LiyuanLucasLiu/Transformer-Clinic; microsoft/admin-torch @ 08b6605 admin_torch/admin.py:54-81",
    enabled_by="residual_scale=admin",
    options=OPTIONS,
    init_schemes=(
        InitScheme(
            "admin",
            apply_baseline,  # omega starts at 1; profiling sets it before the first update
            "Admin (Liu et al. 2020): LN(x*omega + f(x)), omega profiled on the first batch, Post-LN",
            allowed_norms=WITH_NORM,
            norm_reason="Admin is a Post-LN method: x_i = LN(x_{i-1} * omega_i + f_i(x_{i-1}))",
            residual="admin",
            requires=(post_ln(),),
            depth_scaled="Admin's omega is profiled from the depth",
        ),
    ),
    residual_scalings=(
        ResidualScaling(
            "admin",
            lambda stack, sublayer, p: AdminResidual(stack.dim, trainable=not p.admin_freeze_omega),
            "x * omega + f(x), omega a learned vector set by profiling",
            requires=(post_ln(), a_norm("rescales the input of a Post-LN norm and needs one")),
            export=folds("Admin's omega (previous norm and next input projections)", "omega"),
        ),
    ),
    excludes=(
        Rule(
            FLAG,
            ("encoder_layerdrop", "decoder_layerdrop", "encoder_layers_to_keep", "decoder_layers_to_keep"),
            "Admin profiles every sub-layer in order, and it skips layers",
        ),
    ),
    derive=derive_output_change,
    validate=validate_admin_args,
    describe=describe_admin,
    training_task=profiling_task,
    post_init=set_closed_form_omega,
    export=EXPORT_NEUTRAL,  # formula, profiling, freezing: how omega is found; the fold reads omega itself
    families={
        "admin": dict(init_scheme="admin"),
        # profiling-free Admin (admin-torch's closed form, O(logn)); trains under --task translation
        "admin_closed": dict(init_scheme="admin", admin_formula=CLOSED_FORM),
    },
    error=AdminConfigError,
)
