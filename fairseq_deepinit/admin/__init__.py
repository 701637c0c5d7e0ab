"""Admin's machinery beyond the model (Liu et al. 2020): profiling, profile files, tasks, export.

The method itself (options, validation, the ``admin`` init scheme and residual scale, the closed form
set at build time, the ``admin_<size>`` architectures) is its record, :mod:`fairseq_deepinit.methods.admin`;
its residual module is :class:`~fairseq_deepinit.modules.residual.AdminResidual`. Here:

- :mod:`.residual`: the model helpers (Admin's residual modules in a model, profiled or not) and the
  profile constants;
- :mod:`.profiling`: omega from the variances of the first batch (released code's or paper's formula);
- :mod:`.profile_file`: the JSON profile of the two-step workflow;
- :mod:`.profiling_task`: the profiling lifecycle inside fairseq-train, on every rank (one mixin for
  every profiling task);
- :mod:`.task`: ``--task translation_admin`` (registered when the plugin imports it);
- :mod:`.export`: ``deepinit-export-admin``, an alias of ``deepinit-export --to fairseq`` for Admin models
  (the fold of omega into a stock Post-LN checkpoint is :mod:`fairseq_deepinit.export.omega`).
"""

from .profile_file import apply_profile, check_profile_destination, check_profile_rows, load_profile, save_profile
from .profiling import code_ratio, log_profile, paper_omegas, profile_model, refresh_master_params
from .profiling_task import AdminProfilingMixin
from .residual import (
    FORMULAS,
    OMEGA_MAX,
    OMEGA_MIN,
    PROFILE_FORMAT,
    PROFILING_TASKS,
    AdminResidual,
    admin_residuals,
    is_profiled,
    omega_parameters,
    unwrap_model,
)

__all__ = [
    "FORMULAS",
    "OMEGA_MAX",
    "OMEGA_MIN",
    "PROFILE_FORMAT",
    "PROFILING_TASKS",
    "AdminProfilingMixin",
    "AdminResidual",
    "admin_residuals",
    "apply_profile",
    "check_profile_destination",
    "check_profile_rows",
    "code_ratio",
    "is_profiled",
    "load_profile",
    "log_profile",
    "omega_parameters",
    "paper_omegas",
    "profile_model",
    "refresh_master_params",
    "save_profile",
    "unwrap_model",
]
