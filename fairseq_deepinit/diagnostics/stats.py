"""The measurements the papers' arguments rest on, taken on any ``deepinit`` model.

- :func:`grad_norms_per_layer`: the l2 norm of the loss gradient of every layer's parameters
  (Zhang, Titov & Sennrich 2019, "DS-Init", Fig. 1; Liu et al. 2020, "Admin", Fig. 3);
- :class:`GradientFlow`: how the gradient norm changes across the normalisation layer and the
  residual connection of every sub-layer, beta_LN, beta_RC, beta = beta_LN * beta_RC, and the
  variance of the residual output Var(r) (DS-Init, sec. 3 and Table 1; definitions below);
- :func:`output_change`: ``|F(x, W) - F(x, W + delta)|^2`` for a random ``delta`` and for one Adam
  step (Admin, Fig. 4 and Theorem 2: O(N) growth with depth N under Post-LN, O(log N) under Pre-LN),
  and :func:`fit_growth` to turn several depths into fitted slopes;
- :func:`first_nonfinite_output`, :func:`nonfinite_parameters`: where a diverged model first went
  non-finite (the divergence guard of :mod:`fairseq_deepinit.diagnostics.criterion`).

Definitions used for DS-Init's Table 1 (the paper describes, in words, the gradient passing back
through the layer normalisation and then the residual connection of each sub-layer). For a
sub-layer with input ``x`` (the ``residual`` argument of its :class:`~fairseq_deepinit.modules.residual.Residual`),
residual output ``r = skip(x) + f(x)`` and sub-layer output ``y`` (``y = LN(r)`` under Post-LN,
``y = r`` under Pre-LN or without norms)::

    beta_LN = ||dL/dr|| / ||dL/dy||     beta_RC = ||dL/dx|| / ||dL/dr||     beta = ||dL/dx|| / ||dL/dy||

with Frobenius norms over the whole batch (several batches pooled by summing squares) and
``dL/dx`` the total gradient reaching ``x`` (through the skip path and the branch). Var(r) is the
population variance of all elements of ``r``.
"""

from __future__ import annotations

import copy
import math
import re
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, Sequence

import torch
import torch.nn as nn

from .hooks import clean_name, norm_modules, residual_modules, sublayer_name

_LAYER = re.compile(r"^(.*?\blayers\.\d+)\.")


def layer_key(param_name: str) -> str:
    """The layer a parameter belongs to: ``encoder.layers.3`` for anything inside layer 3 of the
    encoder, otherwise the owning module (``encoder.embed_tokens``, ``decoder.output_projection``)."""
    name = clean_name(param_name)
    m = _LAYER.match(name)
    if m:
        return m.group(1)
    return name.rsplit(".", 1)[0] if "." in name else name


def _grad_squares(model: nn.Module, scale: float = 1.0) -> OrderedDict[str, torch.Tensor]:
    sq: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        s = p.grad.detach().double().pow(2).sum()
        key = layer_key(name)
        sq[key] = sq[key] + s if key in sq else s
    return sq


def grad_norms_per_layer(model: nn.Module) -> OrderedDict[str, float]:
    """``{layer: ||grad of its parameters||_2}`` in module order (parameters without a gradient skipped)."""
    sq = _grad_squares(model)
    if not sq:
        return OrderedDict()
    values = torch.stack(list(sq.values())).sqrt().tolist()  # one device sync
    return OrderedDict(zip(sq.keys(), values, strict=True))


def stack_layers(per_layer: Dict[str, float], stack: str) -> List[float]:
    """The values of ``stack.layers.0``, ``stack.layers.1``, ... in depth order."""
    out = []
    i = 0
    while f"{stack}.layers.{i}" in per_layer:
        out.append(per_layer[f"{stack}.layers.{i}"])
        i += 1
    return out


# --------------------------------------------------------------------------------------------
# DS-Init Table 1: gradient flow through LN and residual connection
# --------------------------------------------------------------------------------------------


class GradientFlow:
    """Measure beta_LN, beta_RC, beta and Var(r) of every sub-layer (definitions: module docstring).

    Attach around forward *and* backward passes::

        with GradientFlow(model) as flow:
            loss = criterion(model, sample)[0]
            loss.backward()
        flow.results()  # {sub-layer: {"beta_ln", "beta_rc", "beta", "var_r"}}

    Forward hooks on every residual module see ``x`` and ``r``; under Post-LN a hook on the norm
    whose input *is* ``r`` sees ``y``. Tensor hooks on those three tensors collect the gradients.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.residuals = residual_modules(model)
        if not self.residuals:
            raise ValueError("GradientFlow needs a 'deepinit' model (no residual modules found)")
        self.norms = norm_modules(model)
        self._post_ln: Dict[str, bool] = {}
        for name in self.residuals:
            parent = name.rsplit(".residuals.", 1)[0]
            layer = model.get_submodule(parent) if ".residuals." in name else None
            # the layer's norm placement (modules/sublayer.py); a residual outside a layer counts as Post-LN
            self._post_ln[name] = getattr(layer, "placement", "post") == "post"
        self.order: List[str] = []
        # per sub-layer: squared gradient norms of x, r, y and moments of r (count, sum, sum of squares)
        self.acc: Dict[str, Dict[str, float]] = {}
        self._pending: Dict[int, tuple] = {}
        self._handles: list = []

    def _slot(self, sub: str) -> Dict[str, float]:
        if sub not in self.acc:
            self.acc[sub] = {"gx": 0.0, "gr": 0.0, "gy": 0.0, "y_seen": 0.0, "n": 0.0, "s": 0.0, "q": 0.0}
            self.order.append(sub)
        return self.acc[sub]

    def _add(self, sub: str, key: str):
        def hook(grad: torch.Tensor) -> None:
            self.acc[sub][key] += grad.detach().double().pow(2).sum().item()

        return hook

    def _residual_hook(self, module_name: str):
        sub = clean_name(sublayer_name(module_name))
        post_ln = self._post_ln[module_name]

        def hook(module, inputs, output) -> None:
            # a Post-LN norm runs right after its residual: anything still pending belongs to a
            # sub-layer without a norm (--norm-type none), whose y is r
            self._pending.clear()
            slot = self._slot(sub)
            r = output.detach().double()
            slot["n"] += r.numel()
            slot["s"] += r.sum().item()
            slot["q"] += r.pow(2).sum().item()
            if not torch.is_grad_enabled():
                return
            x = inputs[1]
            if x.requires_grad:
                x.register_hook(self._add(sub, "gx"))
            if output.requires_grad:
                output.register_hook(self._add(sub, "gr"))
                if post_ln:
                    self._pending[id(output)] = (output, sub)

        return hook

    def _norm_hook(self, module, inputs, output) -> None:
        entry = self._pending.pop(id(inputs[0]), None)
        if entry is None or entry[0] is not inputs[0] or not output.requires_grad:
            return
        sub = entry[1]
        self.acc[sub]["y_seen"] = 1.0
        output.register_hook(self._add(sub, "gy"))

    def attach(self) -> GradientFlow:
        if not self._handles:
            self._handles = [m.register_forward_hook(self._residual_hook(n)) for n, m in self.residuals.items()]
            self._handles += [m.register_forward_hook(self._norm_hook) for m in self.norms.values()]
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._pending.clear()

    def __enter__(self) -> GradientFlow:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    def results(self) -> OrderedDict[str, Dict[str, float]]:
        """Per sub-layer in forward order: beta_ln, beta_rc, beta, var_r and the three gradient norms."""
        out: OrderedDict[str, Dict[str, float]] = OrderedDict()
        for sub in self.order:
            a = self.acc[sub]
            # no norm after the residual (Pre-LN, --norm-type none): y is r itself
            gy = a["gy"] if a["y_seen"] else a["gr"]
            gx, gr = math.sqrt(a["gx"]), math.sqrt(a["gr"])
            gy = math.sqrt(gy)
            n = a["n"]
            out[sub] = {
                "beta_ln": gr / gy if gy > 0 else float("nan"),
                "beta_rc": gx / gr if gr > 0 else float("nan"),
                "beta": gx / gy if gy > 0 else float("nan"),
                "var_r": a["q"] / n - (a["s"] / n) ** 2 if n else float("nan"),
                "grad_x": gx,
                "grad_r": gr,
                "grad_y": gy,
            }
        return out


def sublayer_type(sub: str) -> str:
    """``encoder.layers.3.self_attn`` -> ``encoder self_attn`` (DS-Init Table 1 rows)."""
    parts = sub.split(".")
    return f"{parts[0]} {parts[-1]}"


def per_type_means(per_sublayer: Dict[str, Dict[str, float]], keys: Sequence[str]) -> OrderedDict[str, dict]:
    """Average ``keys`` over the sub-layers of each type (DS-Init Table 1 reports one row per type)."""
    groups: OrderedDict[str, List[dict]] = OrderedDict()
    for sub, row in per_sublayer.items():
        groups.setdefault(sublayer_type(sub), []).append(row)
    return OrderedDict(
        (t, {k: sum(r[k] for r in rows) / len(rows) for k in keys} | {"count": len(rows)}) for t, rows in groups.items()
    )


# --------------------------------------------------------------------------------------------
# Admin Fig. 4: output change against depth
# --------------------------------------------------------------------------------------------


def encoder_decoder_features(model: nn.Module, net_input: dict) -> Dict[str, torch.Tensor]:
    """The encoder output (T x B x C) and the decoder's last hidden states (B x T x C) of ``model``;
    a decoder-only model (fairseq's ``FairseqLanguageModel``, its input in ``src_tokens``) has only the latter."""
    if "prev_output_tokens" not in net_input:
        dec, _ = model.decoder(net_input["src_tokens"], features_only=True)
        return {"decoder": dec}
    enc = model.encoder(net_input["src_tokens"], src_lengths=net_input["src_lengths"])
    dec, _ = model.decoder(net_input["prev_output_tokens"], encoder_out=enc, features_only=True)
    return {"encoder": enc["encoder_out"][0], "decoder": dec}


def _kept_positions(net_input: dict, pad: int) -> Dict[str, torch.Tensor]:
    """Non-padding positions, shaped like :func:`encoder_decoder_features`' outputs."""
    if "prev_output_tokens" not in net_input:  # a language model reads and predicts src_tokens
        return {"decoder": net_input["src_tokens"].ne(pad)}
    return {"encoder": net_input["src_tokens"].ne(pad).t(), "decoder": net_input["prev_output_tokens"].ne(pad)}


def perturbed_parameters(model: nn.Module) -> List[nn.Parameter]:
    """The parameters the output-change measurement moves: every parameter inside a layer."""
    return [p for n, p in model.named_parameters() if p.requires_grad and _LAYER.match(clean_name(n))]


def output_change(
    model: nn.Module,
    batches: Sequence[dict],
    kind: str,
    scale: float,
    seed: int = 0,
    loss_fn: Callable[[nn.Module, dict], torch.Tensor] | None = None,
    pad: int = 1,
) -> Dict[str, float]:
    """``mean over positions of ||F(x, W) - F(x, W + delta)||_2^2`` for the encoder and decoder output
    (the decoder's only, for a decoder-only model).

    ``kind="random"``: delta ~ N(0, scale^2) on every layer parameter (Admin Fig. 4 left);
    ``kind="adam"``: delta is one Adam step (lr ``scale``, betas 0.9/0.98) on the summed loss of
    ``batches`` (Admin Fig. 4 right). Both move only parameters inside layers (embeddings and the
    output projection stay), and dropout is off, so the change comes from the layers alone.
    Padded positions are excluded from the means. ``model`` itself is left untouched.
    """
    if kind not in ("random", "adam"):
        raise ValueError(f"unknown perturbation {kind!r}; choose random or adam")
    was_training = model.training
    model.eval()
    moved = copy.deepcopy(model)
    params = perturbed_parameters(moved)
    if kind == "random":
        g = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p) * scale)
    else:
        if loss_fn is None:
            raise ValueError("kind='adam' needs loss_fn(model, batch) -> scalar loss")
        moved.zero_grad()
        for batch in batches:
            loss_fn(moved, batch).backward()
        opt = torch.optim.Adam(params, lr=scale, betas=(0.9, 0.98), eps=1e-8)
        opt.step()
        moved.zero_grad()
    sums: Dict[str, float] = {}
    counts: Dict[str, int] = {}
    with torch.no_grad():
        for batch in batches:
            net_input = batch["net_input"]
            a = encoder_decoder_features(model, net_input)
            b = encoder_decoder_features(moved, net_input)
            for key, keep in _kept_positions(net_input, pad).items():
                d = (a[key].double() - b[key].double()).pow(2).sum(-1)
                sums[key] = sums.get(key, 0.0) + d[keep].sum().item()
                counts[key] = counts.get(key, 0) + int(keep.sum().item())
    model.train(was_training)
    return {k: sums[k] / counts[k] if counts[k] else float("nan") for k in sums}


def fit_growth(depths: Sequence[float], values: Sequence[float]) -> Dict[str, float]:
    """Least-squares fits of ``values`` against depth N: linear ``a + b N``, logarithmic ``a + b ln N``
    and power law ``c N^p`` (fitted in log-log). ``relative_slope`` is ``b`` divided by the value at
    the smallest depth, so that slopes of differently scaled curves compare (Admin Fig. 4)."""
    if len(depths) < 2 or len(depths) != len(values):
        raise ValueError("fit_growth needs at least two (depth, value) pairs")
    n = torch.tensor([float(d) for d in depths], dtype=torch.float64)
    v = torch.tensor([float(x) for x in values], dtype=torch.float64)

    def linfit(x: torch.Tensor, y: torch.Tensor) -> tuple:
        a = torch.stack([torch.ones_like(x), x], dim=1)
        coef = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1)
        pred = a @ coef
        ss_res = (y - pred).pow(2).sum()
        ss_tot = (y - y.mean()).pow(2).sum()
        r2 = (1 - ss_res / ss_tot).item() if ss_tot > 0 else 1.0
        return coef[0].item(), coef[1].item(), r2

    lin_a, lin_b, lin_r2 = linfit(n, v)
    log_a, log_b, log_r2 = linfit(n.log(), v)
    out = {
        "slope": lin_b,
        "intercept": lin_a,
        "r2_linear": lin_r2,
        "log_slope": log_b,
        "log_intercept": log_a,
        "r2_log": log_r2,
        "relative_slope": lin_b / v[torch.argmin(n)].item() if v[torch.argmin(n)] != 0 else float("nan"),
    }
    if bool((v > 0).all()):
        _, p, p_r2 = linfit(n.log(), v.log())
        out.update(exponent=p, r2_power=p_r2)
    else:
        out.update(exponent=float("nan"), r2_power=float("nan"))
    return out


# --------------------------------------------------------------------------------------------
# Divergence: where did the model first go non-finite?
# --------------------------------------------------------------------------------------------


def _float_tensors(obj) -> Iterable[torch.Tensor]:
    if torch.is_tensor(obj):
        if obj.is_floating_point():
            yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _float_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _float_tensors(o)


def first_nonfinite_output(model: nn.Module, run: Callable[[], object]) -> str | None:
    """Run ``run()`` with a forward hook on every module; return the name of the first module (in the
    order modules *finish*, so the innermost culprit) whose output holds a NaN or Inf, or ``None``."""
    found: List[str] = []

    def make(name: str):
        def hook(module, inputs, output) -> None:
            if not found and any(not bool(torch.isfinite(t).all()) for t in _float_tensors(output)):
                found.append(name)

        return hook

    handles = [m.register_forward_hook(make(clean_name(n))) for n, m in model.named_modules() if n]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def nonfinite_parameters(model: nn.Module) -> List[str]:
    """Names of the parameters holding a NaN or Inf, in module order."""
    names = [n for n, _ in model.named_parameters()]
    if not names:
        return []
    flags = torch.stack([torch.isfinite(p.detach()).all() for _, p in model.named_parameters()]).tolist()
    return [clean_name(n) for n, ok in zip(names, flags, strict=True) if not ok]
