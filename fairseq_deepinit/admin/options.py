"""Admin's options (``--admin-formula``, ``--admin-freeze-omega``, ``--admin-profile-*``), registered
with :mod:`fairseq_deepinit.options` on the residual axis and validated at start-up."""

from __future__ import annotations

from .. import options
from ..errors import AdminConfigError
from .closed_form import CLOSED_FORM, DEFAULT_OUTPUT_CHANGE, OUTPUT_CHANGE_SCALES
from .residual import FORMULAS, PROFILING_TASKS

OMEGA_FORMULAS = FORMULAS + (CLOSED_FORM,)

# Admin's options belong to the residual axis, not to one init scheme (``--residual-scale admin``
# composes with e.g. lipschitz init), so they follow the ``_SCHEME_OPTIONS`` pattern keyed on the
# residual (``options.register_residual_options``): defaults under ``--residual-scale admin``, None
# otherwise, which keeps re-validating the arguments stored in a checkpoint idempotent.
ADMIN_OPTIONS = {
    "admin_formula": "code",
    "admin_freeze_omega": False,
    "admin_profile_batches": 1,
    "admin_profile_max_tokens": 8192,
    "admin_profile_path": None,
    "admin_profile_only": False,
    "admin_output_change": None,  # closed-form only (its default is set there)
}
_PROFILING_OPTIONS = ("admin_profile_batches", "admin_profile_max_tokens", "admin_profile_path", "admin_profile_only")


def add_admin_args(g) -> None:
    g.add_argument(
        "--admin-formula",
        choices=OMEGA_FORMULAS,
        help="omega from the released code's recurrence (code, default), the paper's "
        "sqrt(sum_{j<i} Var f_j) (paper), or without profiling from the depth as admin-torch does "
        "(closed-form, see --admin-output-change); docs/admin.md",
    )
    g.add_argument(
        "--admin-output-change",
        choices=OUTPUT_CHANGE_SCALES,
        help="closed-form Admin: the output change scale omega is chosen for (admin-torch's "
        "output_change_scale): O(logn) (default), O(n) (omega = 1) or O(1) (omega = sqrt(n))",
    )
    g.add_argument(
        "--admin-freeze-omega",
        action="store_true",
        default=None,
        help="keep omega fixed after profiling (default: trainable, as in the released code)",
    )
    g.add_argument(
        "--admin-profile-batches",
        type=int,
        metavar="K",
        help="profile on the first K training batches of each rank, merged (default 1, the paper's)",
    )
    g.add_argument(
        "--admin-profile-max-tokens",
        type=int,
        metavar="T",
        help="cap on the profiling batch, padded tokens as --max-tokens counts them (default 8192)",
    )
    g.add_argument(
        "--admin-profile-path",
        metavar="FILE.json",
        help="with --admin-profile-only: where to write the profile; otherwise: a profile to load instead "
        "of profiling (two-step workflow)",
    )
    g.add_argument(
        "--admin-profile-only",
        action="store_true",
        default=None,
        help="profile on the first batch, write --admin-profile-path and stop before the first update",
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate_admin_args(args) -> None:
    """Start-up checks under ``--residual-scale admin`` (after ``options`` filled in the defaults)."""
    if args.admin_formula not in OMEGA_FORMULAS:
        raise AdminConfigError(
            f"unknown --admin-formula {args.admin_formula!r}; choose from {', '.join(OMEGA_FORMULAS)}"
        )
    _validate_closed_form(args)
    if args.norm_type == "none":
        raise AdminConfigError(
            "--residual-scale admin rescales the input of a Post-LN norm and needs one; --norm-type none "
            "removes it. Use --norm-type layernorm (or drop --norm-type)."
        )
    if args.admin_profile_batches < 1:
        raise AdminConfigError(f"--admin-profile-batches must be at least 1, got {args.admin_profile_batches}")
    if args.admin_profile_max_tokens < 1:
        raise AdminConfigError(f"--admin-profile-max-tokens must be positive, got {args.admin_profile_max_tokens}")
    if args.admin_profile_only and not args.admin_profile_path:
        raise AdminConfigError("--admin-profile-only writes the profile to --admin-profile-path; add it")
    for stack in ("encoder", "decoder"):
        if getattr(args, f"{stack}_layerdrop", 0) or getattr(args, f"{stack}_layers_to_keep", None):
            raise AdminConfigError(
                f"Admin profiles every sub-layer in order; --{stack}-layerdrop / --{stack}-layers-to-keep "
                "skip layers. Drop them."
            )
    task = getattr(args, "task", None)
    given = [n for n in _PROFILING_OPTIONS if getattr(args, n) not in (None, False, ADMIN_OPTIONS[n])]
    if given and task is not None and task not in PROFILING_TASKS:
        profiling_task = "translation_admin" if options.has_encoder(args) else "language_modeling_admin"
        raise AdminConfigError(
            f"{', '.join(map(_flag, given))} {'is' if len(given) == 1 else 'are'} read by the profiling task; add "
            f"--task {profiling_task} (got --task {task})"
        )


def _validate_closed_form(args) -> None:
    """``--admin-output-change`` only with closed-form; closed-form never profiles, so no profiling flags."""
    if args.admin_formula != CLOSED_FORM:
        if args.admin_output_change is not None:
            raise AdminConfigError(
                f"--admin-output-change only applies to --admin-formula {CLOSED_FORM}; drop it or add "
                f"--admin-formula {CLOSED_FORM}"
            )
        return
    if args.admin_output_change is None:
        args.admin_output_change = DEFAULT_OUTPUT_CHANGE
    if args.admin_output_change not in OUTPUT_CHANGE_SCALES:
        raise AdminConfigError(
            f"unknown --admin-output-change {args.admin_output_change!r}; choose from {', '.join(OUTPUT_CHANGE_SCALES)}"
        )
    given = [n for n in _PROFILING_OPTIONS if getattr(args, n) not in (None, False, ADMIN_OPTIONS[n])]
    if given:
        raise AdminConfigError(
            f"--admin-formula {CLOSED_FORM} sets omega from the depth and never profiles; drop "
            f"{', '.join(map(_flag, given))} (or use --admin-formula code)"
        )


def describe_admin(args) -> str:
    closed = f",{args.admin_output_change}" if args.admin_formula == CLOSED_FORM else ""
    return f"admin={args.admin_formula}{closed}" + (",frozen" if args.admin_freeze_omega else "")


options.register_residual_options("admin", ADMIN_OPTIONS, add_admin_args, validate_admin_args, describe_admin)
