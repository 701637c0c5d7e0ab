"""Depth-muP (Yang et al. 2023, "Tensor Programs VI", alpha = 1/2) and CompleteP (Dey et al. 2025, "Don't
be lazy: CompleteP enables compute-efficient deep transformers", Table 1, alpha = 1): ``--depth-mup``.

Every Pre-LN residual branch is multiplied by ``(L / L_base) ** -alpha``, L the layers of the layer's
stack (:class:`~fairseq_deepinit.modules.residual.BranchScaleResidual`, the ``depth-mup`` residual scale)::

    h = x + (L / L_base)^-alpha * F(LN(x))

Released code: EleutherAI/nanoGPT-mup @ 6f8bc3b (branch ``completep``) ``model.py:113,116-119``
(``residual_scaling = 1 / depth_multiplier ** depth_alpha_exp``); Megatron-LM PR 4999
``residual_branch_multiplier`` (``depth_mult ** -1``, alpha fixed to 1). The matching learning-rate and
Adam-eps multipliers per parameter group are the optimizer's side
(:mod:`fairseq_deepinit.training.depth_mup`, installed on fairseq's ``Trainer`` by
:mod:`fairseq_deepinit.training.depth_mup_trainer`: it reads this record's options from the model's
arguments, tags every parameter with its group and refuses optimizers and precision paths that cannot carry
per-group rates).

Defaults: alpha 1 (CompleteP, the newer paper's recommendation and the only value Megatron's recipe
ships, ``residual_branch_depth_power = -1``), L_base 6 (a learning rate tuned at 6 layers, reused at 48),
the eps/lr rule of the paper's Table 1 (``--depth-mup-source paper``). Encoder-decoder translation is this
plugin's extension: each stack has its own ``m_L = L_stack / L_base``; every sub-layer of a decoder layer
(self-attention, cross-attention, FFN) takes the decoder's multiplier.

Refused (one line): Post-LN and the other placements (the rule is defined on Pre-LN: ``LN(x + m F(x))``
normalises the multiplier away), no norm, Mix-LN (Post-LN layers), any other ``--residual-scale`` and
NormFormer's learned residual scale, LayerNorm Scaling (another depth scaling of every branch), and the
depth-scaled inits (CompleteP's init is depth-independent; a depth-scaled one counts depth twice).
"""

from __future__ import annotations

from ..errors import DeepInitConfigError
from ..modules.residual import BranchScaleResidual, depth_branch_multiplier
from ..modules.stacks import ENCODER, StackKind
from .record import Method, Option, ResidualScale, missing_pre_ln_flags

NAME = "depth-mup"
ALPHAS = {"depth-mup": 0.5, "completep": 1.0}  # Yang et al. 2023; Dey et al. 2025
DEFAULTS = {"depth_mup_alpha": 1.0, "depth_mup_base_layers": 6, "depth_mup_source": "paper"}
SOURCES = ("paper", "nanogpt", "megatron")

# init schemes whose weights depend on the depth (CompleteP Table 1: init independent of depth)
DEPTH_SCALED_INITS = {
    "t-fixup": "T-Fixup scales v/out/fc1/fc2 by L^-1/4",
    "ds-init": "DS-Init draws layer l within 1/sqrt(l) of xavier's bound",
    "deepnorm": "DeepNorm's init gain beta shrinks with depth",
    "admin": "Admin's omega is profiled from the depth",
    "normal-scaled": "normal-scaled draws out_proj and fc2 with 0.02/sqrt(2L)",
}


def _alpha_problem(value: float) -> str | None:
    if 0.5 <= value <= 1.0:
        return None
    return (
        f"--depth-mup-alpha {value}: alpha must be in [0.5, 1] (0.5 Depth-muP, 1 CompleteP; nanoGPT-mup model.py:140)"
    )


def _base_problem(value: int) -> str | None:
    return None if value >= 1 else f"--depth-mup-base-layers {value}: the base depth must be at least one layer"


def branch_multiplier(cfg, kind: StackKind) -> float:
    """``(L / L_base) ** -alpha`` of a layer of ``kind``: L the layers of its stack."""
    layers = cfg.encoder.layers if kind == ENCODER else cfg.decoder.layers
    return depth_branch_multiplier(layers, cfg.depth_mup_base_layers, cfg.depth_mup_alpha)


def validate_depth_mup_args(args) -> None:
    """The feature's options and the combinations depth-muP is not defined for (one-line errors)."""
    if not args.depth_mup:
        given = [f"--{n.replace('_', '-')}" for n in DEFAULTS if getattr(args, n, None) is not None]
        if given:
            raise DeepInitConfigError(f"{', '.join(given)} needs --depth-mup; add it or drop the option")
        if args.residual_scale == NAME:
            raise DeepInitConfigError(
                "--residual-scale depth-mup is set by --depth-mup (which also scales the optimizer's groups); "
                "use --depth-mup instead"
            )
        return
    for name, default in DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    if args.depth_mup_source == "megatron" and args.depth_mup_alpha != 1.0:
        raise DeepInitConfigError(
            "--depth-mup-source megatron is Megatron-LM's depth_mup recipe, which fixes alpha = 1; use "
            f"--depth-mup-alpha 1, or --depth-mup-source paper for alpha {args.depth_mup_alpha:g}"
        )
    if args.residual_scale not in ("none", NAME):
        raise DeepInitConfigError(
            f"--depth-mup scales each residual branch by (L/L_base)^-alpha and --residual-scale "
            f"{args.residual_scale} scales the residual its own way; drop --residual-scale"
        )
    if args.init_scheme in DEPTH_SCALED_INITS:
        raise DeepInitConfigError(
            f"--depth-mup's init is depth-independent (CompleteP Table 1) and --init-scheme {args.init_scheme} "
            f"is not ({DEPTH_SCALED_INITS[args.init_scheme]}): depth would count twice; use --init-scheme xavier, "
            "fairseq or normal"
        )
    if args.norm_type == "none":
        raise DeepInitConfigError("--depth-mup is defined on Pre-LN blocks and --norm-type none removes the norms")
    flags = missing_pre_ln_flags(args)
    if flags:
        raise DeepInitConfigError(
            "--depth-mup is defined on Pre-LN (Post-LN's LN(x + m F(x)) normalises the multiplier away); add "
            f"{flags} (the depth_mup_* / completep_* architectures set them)"
        )
    placement = getattr(args, "norm_placement", "auto")
    if placement not in ("auto", "pre"):
        raise DeepInitConfigError(
            f"--depth-mup is defined on Pre-LN and --norm-placement {placement} is another placement; use "
            "--norm-placement pre or drop --depth-mup"
        )
    others = [
        ("mix_ln", "--mix-ln (its first layers are Post-LN)"),
        ("layernorm_scaling", "--layernorm-scaling (another depth scaling of every branch)"),
        ("scale_resids", "--scale-resids (NormFormer's learned residual scale)"),
    ]
    for name, what in others:
        if getattr(args, name, False):
            raise DeepInitConfigError(f"--depth-mup does not combine with {what}; drop one")
    args.residual_scale = NAME


def describe_depth_mup(args) -> str:
    if not args.depth_mup:
        return ""
    return (
        f"depth-mup alpha={args.depth_mup_alpha:g} base-layers={args.depth_mup_base_layers} "
        f"source={args.depth_mup_source}"
    )


PRE_LN = dict(init_scheme="xavier", encoder_normalize_before=True, decoder_normalize_before=True, depth_mup=True)

METHOD = Method(
    name="depth_mup",
    title="Depth-muP / CompleteP",
    paper="Yang et al. 2023 (Tensor Programs VI); Dey et al. 2025 (CompleteP), Table 1",
    summary="Pre-LN with each residual branch times (L/L_base)^-alpha (alpha 1 CompleteP, 1/2 Depth-muP) and the "
    "matching lr / Adam-eps multipliers per parameter group (`--optimizer adam_foreach`)",
    code="EleutherAI/nanoGPT-mup @ 6f8bc3b (completep) model.py:113,116-119,305-363; Megatron-LM PR 4999",
    options=(
        Option(
            "depth_mup",
            bool,
            False,
            "Depth-muP / CompleteP: each Pre-LN residual branch times (L/L_base)^-alpha, L the stack's layers, and "
            "per-group lr / Adam-eps multipliers (needs --optimizer adam_foreach; docs/schemes.md)",
        ),
        Option(
            "depth_mup_alpha",
            float,
            None,
            "depth-muP: alpha in [0.5, 1]; default 1 (CompleteP, Megatron-LM's constant), 0.5 is Depth-muP",
            metavar="A",
            check=_alpha_problem,
        ),
        Option(
            "depth_mup_base_layers",
            int,
            None,
            "depth-muP: L_base, the depth the hyperparameters were tuned at (default 6), for each stack",
            metavar="N",
            check=_base_problem,
        ),
        Option(
            "depth_mup_source",
            str,
            None,
            "depth-muP: whose lr/eps rule per group: paper (CompleteP Table 1, default), nanogpt (one eps for "
            "all groups), megatron (PR 4999: only hidden weights' eps, alpha 1)",
            choices=SOURCES,
        ),
    ),
    residual_scales=(
        ResidualScale(
            NAME,
            lambda cfg, kind, sub, idx: BranchScaleResidual(branch_multiplier(cfg, kind)),
            "x + (L/L_base)^-alpha f(LN(x)) (set by --depth-mup)",
        ),
    ),
    validate=validate_depth_mup_args,
    describe=describe_depth_mup,
    families={
        "depth_mup": dict(PRE_LN, depth_mup_alpha=ALPHAS["depth-mup"]),
        "completep": dict(PRE_LN, depth_mup_alpha=ALPHAS["completep"]),
    },
)
