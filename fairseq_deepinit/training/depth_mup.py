"""Depth-muP (Yang et al. 2023, "Tensor Programs VI", alpha = 1/2) and CompleteP (Dey et al. 2025, Table 1,
alpha = 1): the constants and the optimizer's parameter groups.

Every residual branch of a Pre-LN block is multiplied by ``m_L ** -alpha``, ``m_L = L / L_base`` per stack
(:func:`branch_multiplier`), and Adam's lr, eps and weight decay change per parameter group
(:func:`group_scales`) as one of three released sources (:data:`SOURCES`): ``paper`` (CompleteP Table 1,
the default), ``nanogpt`` (EleutherAI/nanoGPT-mup @ 6f8bc3b, branch ``completep``, ``model.py:305-363``),
``megatron`` (NVIDIA/Megatron-LM PR 4999, alpha 1). Groups (:data:`KINDS`): ``hidden_weight`` (matrices in
a stack's ``layers``), ``hidden_bias`` (a ``Linear``'s bias there), ``hidden_norm`` (every other parameter
there), ``embedding`` (a tied output projection included), ``final_norm`` (norms outside the layers),
``output``; one set per stack. The sources' differences and why ``paper`` is the default: docs/schemes.md,
"Depth-muP and CompleteP"; the training side: :mod:`.depth_mup_trainer`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from torch import nn

from ..errors import DeepInitConfigError
from ..modules.residual import depth_branch_multiplier
from .param_groups import GroupScale, tag_parameter

# the flags the messages name (added by the method's record, fairseq_deepinit/methods/depth_mup.py)
OPT_ALPHA = "--depth-mup-alpha"
OPT_BASE = "--depth-mup-base-layers"
OPT_SOURCE = "--depth-mup-source"

ALPHAS = {"depth-mup": 0.5, "completep": 1.0}
DEFAULT_ALPHA = 1.0
DEFAULT_BASE_LAYERS = 6  # the "a learning rate tuned at 6 layers transfers to 48"
SOURCES = ("paper", "nanogpt", "megatron")
DEFAULT_SOURCE = "paper"
KINDS = ("embedding", "hidden_weight", "hidden_bias", "hidden_norm", "final_norm", "output")
BLOCK_KINDS = ("hidden_weight", "hidden_bias", "hidden_norm")
STACKS = ("encoder", "decoder")
# children of fairseq's TransformerEncoderBase / TransformerDecoderBase outside ``layers``
EMBEDDING_CHILDREN = ("embed_tokens", "embed_positions", "project_in_dim")
OUTPUT_CHILDREN = ("output_projection", "project_out_dim", "adaptive_softmax")
OUTER_NORM_CHILDREN = ("layer_norm", "layernorm_embedding")


def depth_multiplier(n_layers: int, base_layers: int) -> float:
    """``m_L = L / L_base`` (nanoGPT-mup ``model.py:139``; Megatron ``depth_mult``)."""
    if n_layers <= 0:
        raise DeepInitConfigError(f"depth-muP needs at least one layer per stack, not {n_layers}")
    if base_layers <= 0:
        raise DeepInitConfigError(f"{OPT_BASE} {base_layers}: the base depth must be a positive number of layers")
    return n_layers / base_layers


def check_alpha(alpha: float, source: str = DEFAULT_SOURCE) -> None:
    """alpha in [1/2, 1] (Table 1's two values and nanoGPT-mup's range, ``model.py:140``); Megatron's recipe
    fixes 1; ``source`` one of :data:`SOURCES`."""
    if source not in SOURCES:
        raise DeepInitConfigError(f"{OPT_SOURCE} {source!r}: choose one of {', '.join(SOURCES)}")
    if not (isinstance(alpha, (int, float)) and 0.5 <= alpha <= 1.0):
        raise DeepInitConfigError(
            f"{OPT_ALPHA} {alpha}: alpha must be in [0.5, 1] (0.5 Depth-muP, 1 CompleteP; the residual branch is "
            "multiplied by (L / L_base)^-alpha)"
        )
    if source == "megatron" and alpha != 1.0:
        raise DeepInitConfigError(
            f"{OPT_SOURCE} megatron is Megatron-LM's depth_mup recipe, which fixes alpha = 1 "
            f"(residual_branch_depth_power -1); use {OPT_ALPHA} 1, or {OPT_SOURCE} paper for alpha = {alpha}"
        )


def branch_multiplier(n_layers: int, base_layers: int, alpha: float = DEFAULT_ALPHA) -> float:
    """``m_L ** -alpha``, the factor on every residual branch: ``x + m_L**-alpha * F(LN(x))``.

    nanoGPT-mup ``completep`` ``model.py:113`` (``residual_scaling``, applied at 117-118); Megatron
    ``ResolvedModelPolicy.residual_branch_multiplier`` (``depth_mult ** -1``, also applied to the branch's
    bias, ``scale_residual_branch_output``).
    """
    check_alpha(alpha)
    depth_multiplier(n_layers, base_layers)  # the one-line refusals of a bad depth
    return depth_branch_multiplier(n_layers, base_layers, alpha)


def group_scales(
    n_layers: int,
    base_layers: int,
    alpha: float = DEFAULT_ALPHA,
    source: str = DEFAULT_SOURCE,
    width_mult: float = 1.0,
) -> Dict[str, GroupScale]:
    """Multipliers of the base lr, Adam eps and weight decay for each group of :data:`KINDS`.

    The weight-decay multiplier is on the value the optimizer receives (fairseq's Adam, like PyTorch's AdamW,
    multiplies it by the group's lr: ``p -= lr * wd * p``). Module docstring for the three sources.
    """
    check_alpha(alpha, source)
    m_l = depth_multiplier(n_layers, base_layers)
    base = GroupScale()
    if source == "megatron":
        # hidden_lr_multiplier = m_N^-1 m_L^0; hidden_eps_multiplier = m_N^-1 m_L^-1; vector-like and
        # embedding/output keep the base values
        hidden = GroupScale(lr=1.0 / width_mult, eps=(1.0 / width_mult) * m_l**-1.0)
        return {k: hidden if k == "hidden_weight" else base for k in KINDS}
    lr_depth = m_l ** (alpha - 1.0)  # Table 1 / model.py:331
    eps_block = (1.0 / width_mult) * m_l**-alpha  # Table 1 / model.py:335
    if source == "paper":
        return {
            "embedding": base,
            "hidden_weight": GroupScale(lr=lr_depth / width_mult, eps=eps_block, weight_decay=width_mult),
            "hidden_bias": GroupScale(lr=lr_depth, eps=eps_block),
            "hidden_norm": GroupScale(lr=lr_depth, eps=eps_block),
            "final_norm": base,
            "output": base,
        }
    # nanogpt: one eps for all groups (335); weight decay per group (339-359); output tied to embedding (162)
    return {
        "embedding": GroupScale(lr=1.0, eps=eps_block, weight_decay=1.0),
        "hidden_weight": GroupScale(lr=lr_depth / width_mult, eps=eps_block, weight_decay=1.0 / (1.0 / width_mult)),
        "hidden_bias": GroupScale(lr=lr_depth, eps=eps_block, weight_decay=0.0),
        "hidden_norm": GroupScale(lr=lr_depth, eps=eps_block, weight_decay=0.0),
        "final_norm": GroupScale(lr=1.0, eps=eps_block, weight_decay=0.0),
        "output": GroupScale(lr=1.0, eps=eps_block, weight_decay=1.0),
    }


# --- the model's parameters ----------------------------------------------------------------------------


def stacks(model: nn.Module, who: str = "depth-muP") -> Dict[str, nn.Module]:
    """The model's ``encoder`` and ``decoder`` (a language model: the decoder only), each with ``layers`` (``who``:
    the option the refusal names)."""
    found = {name: getattr(model, name) for name in STACKS if isinstance(getattr(model, name, None), nn.Module)}
    if not found or any(not isinstance(getattr(s, "layers", None), nn.ModuleList) for s in found.values()):
        raise DeepInitConfigError(
            f"{who} needs a model whose encoder/decoder hold their blocks in 'layers' (fairseq's transformer), "
            f"not {type(model).__name__}"
        )
    return found


def stack_depths(model: nn.Module) -> Dict[str, int]:
    """``{stack: L}``: the number of layers of each stack."""
    return {name: len(stack.layers) for name, stack in stacks(model).items()}


def group_kinds(model: nn.Module, who: str = "depth-muP") -> Dict[str, str]:
    """``{parameter name: group name}`` for every parameter of ``model`` (module docstring, "Groups").

    In ``model.named_parameters()`` order and names (a tied parameter once, under its first name); block
    groups are prefixed with their stack (``decoder.hidden_weight``). A parameter outside every rule stops
    with one line naming it (and ``who``, the option that needs the groups): a new module must be given its group
    on purpose, never by default.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    assigned: Dict[int, str] = {}

    def put(p: torch.Tensor, group: str) -> None:
        old = assigned.setdefault(id(p), group)
        if old != group and {old, group} != {"embedding", "output"}:  # a tied output projection
            raise DeepInitConfigError(f"parameter {names.get(id(p))} is shared by groups {old} and {group}")

    for stack_name, stack in stacks(model, who).items():
        for child_name, child in stack.named_children():
            if child_name == "layers":
                for layer in child:
                    for module in layer.modules():
                        for p_name, p in module.named_parameters(recurse=False):
                            if p.dim() >= 2:
                                kind = "hidden_weight"
                            elif isinstance(module, nn.Linear) and p_name == "bias":
                                kind = "hidden_bias"
                            else:
                                kind = "hidden_norm"
                            put(p, f"{stack_name}.{kind}")
                continue
            kind = (
                "embedding"
                if child_name in EMBEDDING_CHILDREN
                else "output"
                if child_name in OUTPUT_CHILDREN
                else "final_norm"
                if child_name in OUTER_NORM_CHILDREN
                else None
            )
            if kind is not None:
                for p in child.parameters():
                    put(p, kind)
    unknown = [n for i, n in names.items() if i not in assigned]
    if unknown:
        raise DeepInitConfigError(
            f"{who} has no parameter-group rule for {', '.join(unknown[:3])}"
            + (f" (and {len(unknown) - 3} more)" if len(unknown) > 3 else "")
            + ": the rule covers fairseq transformer stacks (embeddings, layers, final norms, output projection)"
        )
    return {name: assigned[i] for i, name in names.items()}


@dataclass(frozen=True)
class ParamGroup:
    """One optimizer group: its name, multipliers and the names of its parameters (model order)."""

    name: str
    scale: GroupScale
    param_names: Tuple[str, ...]


def _per_stack(value: int | Mapping[str, int], present: List[str]) -> Dict[str, int]:
    if isinstance(value, Mapping):
        missing = [s for s in present if s not in value]
        if missing:
            raise DeepInitConfigError(f"{OPT_BASE}: no base depth for the {', '.join(missing)}")
        return {s: int(value[s]) for s in present}
    return {s: int(value) for s in present}


def param_groups(
    model: nn.Module,
    base_layers: int | Mapping[str, int] = DEFAULT_BASE_LAYERS,
    alpha: float = DEFAULT_ALPHA,
    source: str = DEFAULT_SOURCE,
    width_mult: float = 1.0,
) -> List[ParamGroup]:
    """The rule function: ``model`` -> its optimizer groups with their multipliers (first-appearance order).

    ``base_layers`` is one base depth for every stack or ``{"encoder": .., "decoder": ..}``. Block groups take
    their own stack's ``m_L``; the groups outside the layers do not depend on ``m_L`` except under
    ``"nanogpt"`` (one eps for all), which therefore needs the same ``m_L`` in both stacks.
    """
    depths = stack_depths(model)
    bases = _per_stack(base_layers, list(depths))
    scales = {s: group_scales(depths[s], bases[s], alpha, source, width_mult) for s in depths}
    if source == "nanogpt" and len({depths[s] / bases[s] for s in depths}) > 1:
        ratios = ", ".join(f"{s} {depths[s]}/{bases[s]}" for s in depths)
        raise DeepInitConfigError(
            f"{OPT_SOURCE} nanogpt scales one Adam eps for every parameter by m_L^-alpha, which needs one depth "
            f"ratio L/L_base, but the stacks have {ratios}; use {OPT_SOURCE} paper or megatron, or equal ratios"
        )
    any_stack = next(iter(depths))
    members: Dict[str, List[str]] = {}
    for name, group in group_kinds(model).items():
        members.setdefault(group, []).append(name)
    out = []
    for group, names in members.items():
        stack, _, kind = group.rpartition(".")
        out.append(ParamGroup(group, scales[stack or any_stack][kind], tuple(names)))
    return out


def tag_parameters(model: nn.Module, groups: List[ParamGroup]) -> None:
    """Tag every parameter of ``model`` with its group (:func:`.param_groups.tag_parameter`), which the
    optimizer (:class:`.param_groups.ScaledParamGroups`) turns into torch param groups."""
    params = dict(model.named_parameters())
    for group in groups:
        for name in group.param_names:
            tag_parameter(params[name], group.name, group.scale)


def describe(groups: List[ParamGroup]) -> str:
    """One line per group for the training log: name, parameter count, multipliers."""
    return "; ".join(
        f"{g.name} ({len(g.param_names)}): lr x{g.scale.lr:.4g}, eps x{g.scale.eps:.4g}, wd x{g.scale.weight_decay:.4g}"
        for g in groups
    )
