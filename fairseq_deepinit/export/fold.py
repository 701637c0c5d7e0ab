"""The plugin model as plain weights: every constant of its forward folded into the weights, in float64.

:func:`plain_state_dict` turns a plugin model (built by :func:`.source.build_plugin_model` in float64,
its route from :func:`.route.classify`) into a state dict with fairseq ``transformer`` names in which
each sub-layer is a plain ``x + f(x)`` (Post-LN: then its norm; Pre-LN: ``x + f(N(x))``; Peri-LN:
``x + N_out(f(N(x)))``). It runs the steps the route's declarations name (``route.steps``, from each
record's :class:`~fairseq_deepinit.methods.exporting.Export`), in the order of :data:`STEPS`; every step is
exact in exact arithmetic, the products taken in float64:

- ScaleNorm ``g x / sqrt(||x||^2 + eps^2)`` (:class:`~fairseq_deepinit.modules.norms.ScaleNorm`) is the
  RMSNorm ``x / sqrt(mean(x^2) + eps^2/d) * (g / sqrt(d))``: its scalar becomes a weight vector of
  ``g / sqrt(d)`` (the eps, ``eps^2/d``, is the route's), the q/k ScaleNorm likewise over ``head_dim``;
- a zero-centred RMSNorm ``x / sqrt(mean(x^2) + eps) * (1 + w)``
  (:class:`~fairseq_deepinit.modules.norms.ZeroCentredRMSNorm`) is the RMSNorm of weight ``1 + w``;
- FixNorm (:class:`~fairseq_deepinit.modules.fixnorm.FixNormEmbedding`): the embedding rows as the
  model uses them, ``w / max(||w||, eps)`` (the padding row 0), and the tied output layer over them with
  its per-word bias (TwT eq. 5);
- Admin's omega, and DeepNorm's alpha as a constant omega: :func:`.omega.fold_state_dict`
  (``LN(x * w + f(x))`` -> ``LN'(x' + f'(x'))``, Liu et al. 2020 appendix C; its docstring has the derivation);
- ReZero's ``x + a f(x)`` and depth-muP's ``x + m f(N(x))``: the scalar into the branch's last
  projection (out_proj of each attention, fc2), weight and bias: ``a (W h + b) = (a W) h + a b``;
- LayerNorm Scaling's ``N(x) / sqrt(l)``: the factor into that norm's gain and bias (the stack's final
  norm has none);
- a bias-free projection (Lipschitz ``--lipschitz-bias-free``, whose zero biases are buffers not in the
  state dict) gets its zero bias back.

The residual modules' constants are read from the built model (``layer.residuals``, ``layer.input_scale``),
so the numbers folded are the ones the forward multiplies by. Extra keys the target must place are kept
under the plugin's names (Peri-LN's ``*_out_norm``, the q/k norms ``*.q_proj.norm.*``).
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

import torch
import torch.nn as nn

from ..modules.fixnorm import FixNormEmbedding, FixNormOutputProjection
from ..modules.norms import ScaleNorm, ZeroCentredRMSNorm
from ..modules.residual import AdminResidual, BranchScaleResidual, ConstantResidual, Residual, ReZeroResidual
from .omega import fold_state_dict
from .route import Route

#: the last projection of each sub-layer's branch (where a branch scalar folds in)
BRANCH_OUTPUT = {"self_attn": "self_attn.out_proj", "encoder_attn": "encoder_attn.out_proj", "ffn": "fc2"}
#: each sub-layer's (input) norm in fairseq's names
SUBLAYER_NORMS = ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")


def _stacks(model: nn.Module):
    for stack in ("encoder", "decoder"):
        module = getattr(model, stack, None)
        if module is not None:
            yield stack, module


def _scalenorms_as_rms(model: nn.Module, sd: Dict[str, torch.Tensor]) -> None:
    """Every ScaleNorm's ``g`` as the weight vector ``g / sqrt(d)`` of the RMSNorm it equals."""
    for name, module in model.named_modules():
        if isinstance(module, ScaleNorm):
            g = sd.pop(f"{name}.g")
            sd[f"{name}.weight"] = torch.full((module.dim,), 1.0, dtype=torch.float64) * (g / math.sqrt(module.dim))


def _zero_centred_gains(model: nn.Module, sd: Dict[str, torch.Tensor]) -> None:
    """Every zero-centred RMSNorm's ``w`` as the weight ``1 + w`` of the plain RMSNorm it equals."""
    for name, module in model.named_modules():
        if isinstance(module, ZeroCentredRMSNorm):
            sd[f"{name}.weight"] = 1.0 + sd[f"{name}.weight"]


def _fixnorm(model: nn.Module, sd: Dict[str, torch.Tensor]) -> None:
    """FixNorm's embedding rows as used (unit norm, padding row 0); its output layer as a tied Linear plus bias."""
    for stack, module in _stacks(model):
        emb = module.embed_tokens
        if isinstance(emb, FixNormEmbedding):
            with torch.no_grad():
                sd[f"{stack}.embed_tokens.weight"] = emb.normalized_weight().detach().to(torch.float64).clone()
    projection = model.decoder.output_projection
    if isinstance(projection, FixNormOutputProjection):
        sd.pop("decoder.output_projection.embedding.weight")
        sd["decoder.output_projection.weight"] = sd["decoder.embed_tokens.weight"]


def _deepnorm_omegas(model: nn.Module, sd: Dict[str, torch.Tensor]) -> None:
    """DeepNorm's ``LN(alpha x + f(x))`` is Admin's ``LN(x * omega + f(x))`` with omega = alpha everywhere."""
    for stack, module in _stacks(model):
        for i, layer in enumerate(module.layers):
            for sub, residual in layer.residuals.items():
                if isinstance(residual, ConstantResidual):
                    dim = layer.embed_dim
                    sd[f"{stack}.layers.{i}.residuals.{sub}.omega"] = torch.full(
                        (dim,), residual.alpha, dtype=torch.float64
                    )


def _branch_scalars(model: nn.Module, sd: Dict[str, torch.Tensor]) -> None:
    """ReZero's ``a`` and depth-muP's multiplier into each branch's last projection (weight and bias)."""
    for stack, module in _stacks(model):
        for i, layer in enumerate(module.layers):
            for sub, residual in layer.residuals.items():
                if isinstance(residual, ReZeroResidual):
                    scale = residual.alpha.detach().to(torch.float64)
                elif isinstance(residual, BranchScaleResidual):
                    scale = torch.tensor(residual.multiplier, dtype=torch.float64)
                else:
                    continue
                prefix = f"{stack}.layers.{i}.{BRANCH_OUTPUT[sub]}"
                for p in ("weight", "bias"):
                    if f"{prefix}.{p}" in sd:
                        sd[f"{prefix}.{p}"] = sd[f"{prefix}.{p}"] * scale


def _input_scales(model: nn.Module, sd: Dict[str, torch.Tensor]) -> None:
    """LayerNorm Scaling: each Pre-LN norm's output times the layer's ``input_scale``, into its gain and bias."""
    for stack, module in _stacks(model):
        for i, layer in enumerate(module.layers):
            scale = float(getattr(layer, "input_scale", 1.0))
            if scale == 1.0:
                continue
            for norm in SUBLAYER_NORMS:
                for p in ("weight", "bias"):
                    key = f"{stack}.layers.{i}.{norm}.{p}"
                    if key in sd:
                        sd[key] = sd[key] * scale


def _zero_biases(model: nn.Module, sd: Dict[str, torch.Tensor]) -> None:
    """A layer Linear whose bias is not in the state dict (a bias-free projection's zero buffer) gets zeros."""
    for stack, module in _stacks(model):
        for i, layer in enumerate(module.layers):
            for name, sub in layer.named_modules():
                if isinstance(sub, nn.Linear) and f"{stack}.layers.{i}.{name}.weight" in sd:
                    key = f"{stack}.layers.{i}.{name}.bias"
                    if key not in sd:
                        sd[key] = torch.zeros(sub.out_features, dtype=torch.float64)


def check_residuals(model: nn.Module) -> None:
    """Every residual module is one the folds handle (the route refused the others before any weight was read)."""
    known = (AdminResidual, ConstantResidual, ReZeroResidual, BranchScaleResidual)
    for _stack, module in _stacks(model):
        for layer in module.layers:
            for residual in layer.residuals.values():
                if type(residual) is not Residual and not isinstance(residual, known):
                    raise TypeError(f"no fold for the residual {type(residual).__name__}")


def _omega(model: nn.Module, sd: Dict[str, torch.Tensor], args) -> dict:
    """Admin's omega (and a constant omega) folded into the norms, input projections and embeddings."""
    folded, changes = fold_state_dict(sd, args, dtype=torch.float64)
    sd.clear()
    sd.update(folded)
    return changes


#: the function of each fold step a record may declare (:data:`~fairseq_deepinit.methods.exporting.FOLD_STEPS`,
#: same order): ``step(model, sd, args)`` changes ``sd`` in place and returns the model arguments it changes
STEPS = {
    "scalenorm-as-rms": lambda model, sd, args: _scalenorms_as_rms(model, sd),
    "zero-centred-gain": lambda model, sd, args: _zero_centred_gains(model, sd),
    "unit-rows": lambda model, sd, args: _fixnorm(model, sd),
    "constant-omega": lambda model, sd, args: _deepnorm_omegas(model, sd),
    "omega": _omega,
    "branch-scalar": lambda model, sd, args: _branch_scalars(model, sd),
    "input-scale": lambda model, sd, args: _input_scales(model, sd),
    "zero-biases": lambda model, sd, args: _zero_biases(model, sd),
}


def plain_state_dict(model: nn.Module, args, route: Route) -> Tuple[Dict[str, torch.Tensor], dict]:
    """``(float64 state dict, changed model arguments)`` of the plain model equal to ``model`` (module docstring)."""
    check_residuals(model)
    sd = {
        k: (v.detach().to(torch.float64) if v.is_floating_point() else v).clone() for k, v in model.state_dict().items()
    }
    changes: dict = {}
    for name, step in STEPS.items():
        if name in route.steps:
            changes.update(step(model, sd, args) or {})
    sd = {k: v for k, v in sd.items() if ".residuals." not in k}
    return sd, changes
