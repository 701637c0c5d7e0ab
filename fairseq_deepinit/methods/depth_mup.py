"""Depth-muP (Yang et al. 2023, "Tensor Programs VI", alpha = 1/2) and CompleteP (Dey et al. 2025, "Don't
be lazy: CompleteP enables compute-efficient deep transformers", Table 1, alpha = 1): ``--depth-mup``.

Every Pre-LN residual branch is multiplied by ``(L / L_base) ** -alpha``, L the layers of the layer's
stack (:class:`~fairseq_deepinit.modules.residual.BranchScaleResidual`, the ``depth-mup`` residual scale)::

    h = x + (L / L_base)^-alpha * F(LN(x))

Released code: EleutherAI/nanoGPT-mup @ 6f8bc3b (branch ``completep``) ``model.py:113,116-119``
(``residual_scaling = 1 / depth_multiplier ** depth_alpha_exp``); Megatron-LM PR 4999
``residual_branch_multiplier`` (``depth_mult ** -1``, alpha fixed to 1). The matching learning-rate and
Adam-eps multipliers per parameter group are the optimizer's side
(:mod:`fairseq_deepinit.training.depth_mup`), reached through this record's training hooks
(:mod:`fairseq_deepinit.training.depth_mup_trainer`): ``check_training`` refuses optimizers and precision
paths that cannot carry per-group rates, ``param_groups`` tags every parameter with its group.

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
from ..modules.stacks import ENCODER
from ..training.depth_mup_trainer import check_training, tag_groups
from .exporting import EXPORT_NEUTRAL, folds
from .record import DEPTH_SCALED, INIT, TAG, Method, Option, ResidualScaling, Rule, a_norm, pre_ln

NAME = "depth-mup"
ALPHAS = {"depth-mup": 0.5, "completep": 1.0}  # Yang et al. 2023; Dey et al. 2025
SOURCES = ("paper", "nanogpt", "megatron")


def _alpha_problem(value: float) -> str | None:
    if 0.5 <= value <= 1.0:
        return None
    return (
        f"--depth-mup-alpha {value}: alpha must be in [0.5, 1] (0.5 Depth-muP, 1 CompleteP; nanoGPT-mup model.py:140)"
    )


def _base_problem(value: int) -> str | None:
    return None if value >= 1 else f"--depth-mup-base-layers {value}: the base depth must be at least one layer"


def branch_multiplier(p, kind, encoder_layers: int, decoder_layers: int) -> float:
    """``(L / L_base) ** -alpha`` of a layer of ``kind``: L the layers of its stack."""
    layers = encoder_layers if kind == ENCODER else decoder_layers
    return depth_branch_multiplier(layers, p.depth_mup_base_layers, p.depth_mup_alpha)


def validate_depth_mup_args(p, spec) -> None:
    """Megatron-LM's recipe fixes alpha."""
    if p.depth_mup_source == "megatron" and p.depth_mup_alpha != 1.0:
        raise DeepInitConfigError(
            "--depth-mup-source megatron is Megatron-LM's depth_mup recipe, which fixes alpha = 1; use "
            f"--depth-mup-alpha 1, or --depth-mup-source paper for alpha {p.depth_mup_alpha:g}"
        )


def describe_depth_mup(p) -> str:
    return f"depth-mup alpha={p.depth_mup_alpha:g} base-layers={p.depth_mup_base_layers} source={p.depth_mup_source}"


PRE_LN = dict(init_scheme="xavier", norm_placement="pre", depth_mup=True)

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
            1.0,
            "depth-muP: alpha in [0.5, 1]; default 1 (CompleteP, Megatron-LM's constant), 0.5 is Depth-muP",
            metavar="A",
            check=_alpha_problem,
            off=None,
        ),
        Option(
            "depth_mup_base_layers",
            int,
            6,
            "depth-muP: L_base, the depth the hyperparameters were tuned at (default 6), for each stack",
            metavar="N",
            check=_base_problem,
            off=None,
        ),
        Option(
            "depth_mup_source",
            str,
            "paper",
            "depth-muP: whose lr/eps rule per group: paper (CompleteP Table 1, default), nanogpt (one eps for "
            "all groups), megatron (PR 4999: only hidden weights' eps, alpha 1)",
            choices=SOURCES,
            off=None,
        ),
    ),
    residual_scalings=(
        ResidualScaling(
            NAME,
            lambda stack, sublayer, p: BranchScaleResidual(stack.residual_constant),
            "x + (L/L_base)^-alpha f(LN(x)) (set by --depth-mup)",
            constant=branch_multiplier,
            export=folds("depth-muP's (L/L_base)^-alpha (into out_proj and fc2)", "branch-scalar"),
        ),
    ),
    enabled_by="depth_mup",
    sets={"residual_scale": NAME},
    requires=(
        a_norm("is defined on Pre-LN blocks"),
        pre_ln("Post-LN's LN(x + m F(x)) normalises the multiplier away"),
    ),
    excludes=(
        Rule(TAG, ("post-ln-layers",), "its multiplier is defined on Pre-LN blocks"),
        Rule(INIT, (DEPTH_SCALED,), "CompleteP's init is depth-independent (Table 1): depth would count twice"),
        Rule(TAG, ("branch-depth-scale",), "another depth scaling of every branch"),
        Rule(TAG, ("residual-scale",), "a learned scale of the residual"),
    ),
    tags={"branch-depth-scale": (), "residual-scale": ()},
    validate=validate_depth_mup_args,
    describe=describe_depth_mup,
    export=EXPORT_NEUTRAL,  # alpha and the base depth set the multiplier its residual scaling folds
    check_training=check_training,
    param_groups=tag_groups,
    families={
        "depth_mup": dict(PRE_LN, depth_mup_alpha=ALPHAS["depth-mup"]),
        "completep": dict(PRE_LN, depth_mup_alpha=ALPHAS["completep"]),
    },
)
