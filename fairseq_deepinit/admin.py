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
of :class:`~fairseq_deepinit.hooks.ResidualStatistics`; over several ranks the raw moments are summed
before any variance is taken, so every rank sets the same omega. omega is an ``nn.Parameter`` (trainable
unless ``--admin-freeze-omega``) and each residual module carries a ``profiled`` buffer, so checkpoints
hold everything: generation needs no profile file and a resumed run does not profile again.

This module registers ``--residual-scale admin``, the ``admin`` init scheme, the ``admin_<size>``
architectures and the ``--admin-*`` options; profiling inside fairseq-train is done by
:mod:`fairseq_deepinit.admin_task`, folding omega into a plain Post-LN checkpoint by
:mod:`fairseq_deepinit.export_admin`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import OrderedDict, defaultdict
from typing import Dict, Iterable, List

import torch
import torch.nn as nn

from . import options
from .architectures import register_family
from .diagnostics.hooks import _N, _QB, _QS, _SB, _SS, ResidualStatistics, sublayer_name
from .errors import AdminConfigError, AdminNotProfiledError
from .modules.residual import Residual, register_residual
from .schemes import WITH_NORM, SchemeSpec, register_scheme
from .schemes.baseline import apply_baseline

logger = logging.getLogger(__name__)

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
    """

    def __init__(self, dim: int, trainable: bool = True) -> None:
        super().__init__()
        self.omega = nn.Parameter(torch.ones(dim), requires_grad=trainable)
        self.register_buffer("profiled", torch.zeros((), dtype=torch.uint8))
        self._in_fairseq_training = False
        self._checked = False
        self._profiling = False

    def skip(self, residual: torch.Tensor) -> torch.Tensor:
        return residual * self.omega

    def set_num_updates(self, num_updates: int) -> None:
        self._in_fairseq_training = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.training and self._in_fairseq_training and not (self._checked or self._profiling):
            if not bool(self.profiled):
                raise AdminNotProfiledError(
                    "Admin's omega was never profiled, so this would train plain Post-LN with omega = 1. "
                    "Train with --task translation_admin (it profiles before the first update), or load a "
                    "profile with --admin-profile-path under that task."
                )
            self._checked = True
        return super().forward(x, residual)

    def extra_repr(self) -> str:
        return f"dim={self.omega.numel()}, trainable={self.omega.requires_grad}"


def _build_admin_residual(cfg, stack: str, sublayer: str, layer_idx: int) -> AdminResidual:
    dim = cfg.encoder.embed_dim if stack == "encoder" else cfg.decoder.embed_dim
    return AdminResidual(dim, trainable=not getattr(cfg, "admin_freeze_omega", None))


register_residual("admin", _build_admin_residual)
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


# ----------------------------------------------------------------------------------------------
# options

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
}
_PROFILING_OPTIONS = ("admin_profile_batches", "admin_profile_max_tokens", "admin_profile_path", "admin_profile_only")


def add_admin_args(g) -> None:
    g.add_argument(
        "--admin-formula",
        choices=FORMULAS,
        help="omega from the released code's recurrence (code, default) or the paper's "
        "sqrt(sum_{j<i} Var f_j) (paper); see docs/admin.md",
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
    if args.admin_formula not in FORMULAS:
        raise AdminConfigError(f"unknown --admin-formula {args.admin_formula!r}; choose from {', '.join(FORMULAS)}")
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
        raise AdminConfigError(
            f"{', '.join(map(_flag, given))} {'is' if len(given) == 1 else 'are'} read by the profiling task; add "
            f"--task {' or '.join(sorted(PROFILING_TASKS)) or 'translation_admin'} (got --task {task})"
        )


def describe_admin(args) -> str:
    return f"admin={args.admin_formula}" + (",frozen" if args.admin_freeze_omega else "")


options.register_residual_options("admin", ADMIN_OPTIONS, add_admin_args, validate_admin_args, describe_admin)


# ----------------------------------------------------------------------------------------------
# model helpers


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
    flags = [bool(m.profiled) for m in admin_residuals(model).values()]
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


def _model_shape(model: nn.Module) -> dict:
    res = admin_residuals(model)
    return {
        "encoder_layers": len(model.encoder.layers),
        "decoder_layers": len(model.decoder.layers),
        "encoder_embed_dim": _dim_of(res, "encoder"),
        "decoder_embed_dim": _dim_of(res, "decoder"),
    }


def _dim_of(res: dict, stack: str) -> int | None:
    for name, m in res.items():
        if name.startswith(stack + "."):
            return m.omega.numel()
    return None


# ----------------------------------------------------------------------------------------------
# profiling


def code_ratio(var_skip: float, var_branch: float) -> float:
    """The released code's recurrence: r_{i+1} = sqrt(Var[x_{i-1} * omega_i] + Var[f_i(x_{i-1})])."""
    return math.sqrt(var_skip + var_branch)


def paper_omegas(var_branches: List[float]) -> List[float]:
    """Paper sec. 4.3: omega_i = sqrt(sum_{j<i} Var[f_j]) for i >= 2 and omega_1 = 1, for one stack."""
    out, total = [], 0.0
    for i, v in enumerate(var_branches):
        out.append(1.0 if i == 0 else math.sqrt(total))
        total += v
    return out


def _variance(moments: torch.Tensor) -> tuple:
    n = moments[_N].item()
    if n == 0:
        return float("nan"), float("nan")
    branch = (moments[_QB] / n - (moments[_SB] / n) ** 2).item()
    skip = (moments[_QS] / n - (moments[_SS] / n) ** 2).item()
    return skip, branch


def _dist_group():
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from fairseq.distributed import utils as dist_utils

    return dist_utils.get_data_parallel_group()


def _world_size(group) -> int:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    from fairseq.distributed import utils as dist_utils

    return dist_utils.get_world_size(group)


class _ProgressiveOmega:
    """Forward pre-hooks that set omega_i just before sub-layer i runs (released-code recurrence).

    The pre-hook of sub-layer i reads the moments the statistics hook recorded for sub-layer i-1 of
    the same stack, sums them over the ranks (once), and fills omega_i with the new ratio.
    """

    def __init__(self, stats: ResidualStatistics, residuals: OrderedDict[str, AdminResidual], group) -> None:
        self.stats = stats
        self.group = group
        self.reduce = _world_size(group) > 1
        self.reduced: set = set()
        self.ratios: Dict[str, float] = {}
        self.previous: Dict[str, str | None] = {}
        for names in stacks_of(residuals).values():
            for i, name in enumerate(names):
                self.previous[name] = names[i - 1] if i else None
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in residuals.items()]

    def reduce_moments(self, name: str) -> torch.Tensor:
        moments = self.stats.moments[name]
        if self.reduce and name not in self.reduced:
            from fairseq.distributed import utils as dist_utils

            dist_utils.all_reduce(moments, group=self.group)
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
                ratio = code_ratio(*_variance(self.reduce_moments(prev)))
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
    ``torch.no_grad``; only the encoder and the decoder's features run (no output projection).
    ``group``: the process group to reduce over (default: fairseq's data-parallel group when
    torch.distributed is initialised). Every rank must call this at the same time.
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
        group = _dist_group()
    start = time.perf_counter()
    stats = ResidualStatistics(model)
    progressive = _ProgressiveOmega(stats, residuals, group) if formula == "code" else None
    with torch.no_grad():
        for m in residuals.values():
            m.omega.fill_(1.0)
            m._profiling = True
    try:
        with stats, torch.no_grad():
            encoder_out = model.encoder(net_input["src_tokens"], src_lengths=net_input.get("src_lengths"))
            model.decoder.extract_features(net_input["prev_output_tokens"], encoder_out=encoder_out)
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
    elif _world_size(group) > 1:
        stats.all_reduce(group)

    variances = {name: _variance(stats.moments[name]) for name in residuals}
    omegas: Dict[str, float] = {}
    if formula == "code":
        omegas = {name: progressive.ratios[name] for name in residuals}
    else:
        for names in stacks_of(residuals).values():
            omegas.update(zip(names, paper_omegas([variances[n][1] for n in names]), strict=True))
    bad = {n: w for n, w in omegas.items() if not (math.isfinite(w) and w > 0)}
    if bad:
        raise FloatingPointError(
            f"Admin profiling gave a non-positive or non-finite omega for {', '.join(bad)}: the profiling batch "
            "produced degenerate statistics (empty batch, NaN/inf activations). Check the data and --fp16 scale."
        )
    with torch.no_grad():
        for name, m in residuals.items():
            m.omega.fill_(omegas[name])
            m.profiled.fill_(1)
            m._checked = False

    src = net_input["src_tokens"]
    profile = {
        "format": PROFILE_FORMAT,
        "formula": formula,
        **_model_shape(model),
        "ranks": _world_size(group),
        "sentences_per_rank": int(src.size(0)),
        "source_shape": list(src.shape),
        "target_shape": list(net_input["prev_output_tokens"].shape),
        "seconds": round(time.perf_counter() - start, 4),
        "sublayers": [
            {
                "name": name,
                "var_branch": variances[name][1],
                "var_skip": variances[name][0],
                "elements": int(stats.moments[name][_N].item()),
                "omega": omegas[name],
            }
            for name in residuals
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


# ----------------------------------------------------------------------------------------------
# profile files (two-step workflow)


def _create_temporary(folder: str, stem: str) -> tuple:
    """A new file ``folder/stem.<pid>.<n>.tmp`` opened for writing: ``(fd, path)``.

    Not ``tempfile.mkstemp``: its files are mode 0600, and the profile renamed from it would lose
    the permissions a plain ``open`` gives (0666 minus the umask).
    """
    for n in range(100):
        tmp = os.path.join(folder, f"{stem}.{os.getpid()}.{n}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary file name {stem}.{os.getpid()}.N.tmp in {folder}")


def check_profile_destination(path: str) -> None:
    """Refuse, at start-up, a ``--admin-profile-only`` destination the profile could not be written to.

    Checked before any data is loaded or profiled, so that a run does not profile (or, under
    several ranks, wait for every rank) only to fail at the end. The parent folder is created if
    missing (as :func:`save_profile` does); writability is tested by creating and removing a probe
    file in it, which is what the write needs (a temporary file there, then an atomic rename) and,
    unlike ``os.access``, also sees read-only mounts and the rights of root.
    """
    if os.path.isdir(path):
        raise AdminConfigError(
            f"--admin-profile-path {path} is a folder; give the profile's file name, e.g. "
            f"--admin-profile-path {os.path.join(path, 'admin.json')}"
        )
    if os.path.exists(path) and not os.path.isfile(path):
        raise AdminConfigError(f"--admin-profile-path {path} exists and is not a regular file; give another path")
    folder = os.path.dirname(os.path.abspath(path))
    existing = folder
    while not os.path.exists(existing):  # the deepest folder that exists (the root always does)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise AdminConfigError(
            f"--admin-profile-path {path} cannot be written: {existing} is a file, not a folder; give another path"
        )
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = _create_temporary(folder, ".admin-profile-probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise AdminConfigError(
            f"--admin-profile-path {path} cannot be written ({e.strerror or e} in {folder}); give a path in a "
            "writable folder"
        ) from e


def save_profile(profile: dict, path: str) -> None:
    """Write ``profile`` as JSON to ``path`` atomically: a temporary file in the same folder, then a rename.

    On any failure the temporary file is removed and :class:`AdminConfigError` names the path, so a
    half-written profile or a stray temporary file is never left behind.
    """
    check_profile_destination(path)  # also creates the folder
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = _create_temporary(folder, f".{os.path.basename(path)}")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(profile, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as e:
        raise AdminConfigError(f"cannot write the Admin profile to {path}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_profile(path: str) -> dict:
    if os.path.isdir(path):
        raise AdminConfigError(
            f"--admin-profile-path {path} is a folder, not a profile; give the profile's file name (written by "
            "--admin-profile-only)"
        )
    if not os.path.exists(path):
        raise AdminConfigError(
            f"Admin profile {path} not found. Write it first with --admin-profile-only --admin-profile-path "
            f"{path}, or drop --admin-profile-path to profile on the first batch of this run."
        )
    try:
        with open(path, encoding="utf-8") as f:
            profile = json.load(f)
    except (OSError, ValueError) as e:
        raise AdminConfigError(f"cannot read Admin profile {path}: {e}") from e
    if not isinstance(profile, dict) or profile.get("format") != PROFILE_FORMAT:
        raise AdminConfigError(f"{path} is not an Admin profile written by this plugin (format {PROFILE_FORMAT!r})")
    return profile


def check_profile_rows(path: str, names: list, expected: List[str]) -> None:
    """The profile's sub-layer rows must be this model's sub-layers, each once, in forward order.

    The message names exactly the rows that are missing, unexpected or repeated (the depth and dims
    were already checked, so these are files edited by hand or written by another layer layout).
    """
    if names == expected:
        return
    present, wanted = set(names), set(expected)
    problems = []
    missing = [n for n in expected if n not in present]
    unexpected = [str(n) for n in dict.fromkeys(names) if n not in wanted]
    repeated = [str(n) for n in dict.fromkeys(names) if n in wanted and names.count(n) > 1]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected)}")
    if repeated:
        problems.append(f"repeated {', '.join(repeated)}")
    if not problems:
        start = ", ".join(expected[:3])
        problems.append(f"the same sub-layers in another order (this model's forward order starts {start})")
    raise AdminConfigError(
        f"Admin profile {path} does not match this model's sub-layers: {'; '.join(problems)}. "
        "Re-profile this model with --admin-profile-only."
    )


def check_omega(path: str, name, w) -> float:
    """One profile row's omega as a float in [OMEGA_MIN, OMEGA_MAX] (see there why), else a one-line error."""
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
        raise AdminConfigError(
            f"Admin profile {path}: omega of {name} is {w!r}, not a finite number; re-profile with --admin-profile-only"
        )
    if not OMEGA_MIN <= w <= OMEGA_MAX:
        raise AdminConfigError(
            f"Admin profile {path}: omega of {name} is {w!r}, outside [{OMEGA_MIN:g}, {OMEGA_MAX:g}] (profiled omegas "
            "are near 1 and grow like sqrt(depth); see docs/admin.md); re-profile with --admin-profile-only"
        )
    return float(w)


def apply_profile(model: nn.Module, profile: dict, formula: str, path: str = "profile") -> None:
    """Set omega from a profile after checking that it was made for this model's depth and dims."""
    residuals = admin_residuals(model)
    if not residuals:
        raise AdminConfigError("this model has no Admin omega to load a profile into; use --arch admin_<size>")
    shape = _model_shape(model)
    for key, value in shape.items():
        if profile.get(key) != value:
            raise AdminConfigError(
                f"Admin profile {path} was made for {key.replace('_', ' ')} = {profile.get(key)}, but this model "
                f"has {value}. Re-profile this model with --admin-profile-only, or fix --encoder-layers/"
                "--decoder-layers/--*-embed-dim."
            )
    rows = profile.get("sublayers")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise AdminConfigError(
            f"Admin profile {path} has no list of sub-layer rows; re-profile with --admin-profile-only"
        )
    check_profile_rows(path, [r.get("name") for r in rows], list(residuals))
    if profile.get("formula") != formula:
        raise AdminConfigError(
            f"Admin profile {path} was computed with --admin-formula {profile.get('formula')}, but this run asks for "
            f"--admin-formula {formula}; pass --admin-formula {profile.get('formula')} or re-profile"
        )
    values = [check_omega(path, row.get("name"), row.get("omega")) for row in rows]
    with torch.no_grad():
        for m, w in zip(residuals.values(), values, strict=True):
            m.omega.fill_(w)
            m.profiled.fill_(1)
            m._checked = False


# ----------------------------------------------------------------------------------------------
# mixed precision


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
