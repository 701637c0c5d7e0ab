"""DyT and Derf (``fairseq_deepinit/modules/dyt.py``) against the independent port of the released code
(``tests/ports/dyt.py``): init values and names, the per-position alpha table, outputs and gradients
with identical parameters in fp64, fp32, fp16 and bf16 (contiguous and transposed input), dtype
promotion as in the released code, the learnable embedding scale in fairseq's own forward, and the aten
operators of a forward + backward against LayerNorm's and the released formula's.

Tolerances are derived, per element, from the float path (:func:`bounds`); the reference is the port
run in fp64 on the same (exactly representable) values. Notation: ``u`` the unit roundoff of the
module's dtype, ``uc`` that of the precision its kernels compute and accumulate in (fp32 for fp16,
bf16 and fp32: torch's ``opmath`` and reductions; fp64 for fp64), ``n`` the elements of a reduction.

- tanh / erf kernels: relative error ``u + 4 uc`` (the output's rounding and the fp32 or fp64 kernel:
  SLEEF / glibc / CUDA are within 2 ulp; 1.2 u measured on this VM on all three CPU paths), plus, for
  16-bit erf on the CPU, an absolute 4e-7: torch's vectorised CPU erf for fp16/bf16 evaluates the
  Abramowitz-Stegun 7.1.26 approximation (|error| <= 1.5e-7) in fp32 (2.8e-7 measured, native and
  AVX2 paths; 0 on the default path).
- DyT: ``z = alpha x`` rounds once (u); tanh's relative condition number ``2z / sinh 2z <= 1``, so
  ``|t^ - t| <= (2u + kappa)|t|``; ``bias + t weight`` rounds at most twice.
- Derf: ``z = shift + alpha x`` rounds at most twice, ``|dz| <= 2u|alpha x| + u|shift|``, then
  ``|erf(z^) - erf(z)| <= (2/sqrt(pi)) exp(-max(|z| - dz, 0)^2) dz``.
- Backward: each product one rounding, ``1 - t^2`` off by ``|t^ - t| (2|t| + |t^ - t|)``, erf's
  slope ``c exp(-z^2)`` off by its local Lipschitz constant times ``dz`` plus the rounding of its
  argument ``log c - z^2`` (absolute ``u (2 z^2 + |log c|)``, relative after exp), every sum
  ``(2u + n uc)`` times the sum of magnitudes (products, accumulation, final rounding).

Each bound adds the port's own fp64 error (the same bound with fp64's u) and, for fp16, a few
subnormal spacings. A wrong formula (an alpha left out of a gradient, a sign, a missing bias, one more
16-bit rounding) misses them by orders of magnitude: every test here was checked to fail on such
mutations of the module.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from ports import dyt as port

from conftest import TINY_DIMS, build_model
from deepinit_tools.harness.op_counters import OpCounter  # noqa: E402
from fairseq_deepinit.modules.dyt import (
    DERF_ALPHA_INIT,
    DERF_SHIFT_INIT,
    DYT_ALPHA_INIT,
    LLAMA_SIZES,
    LOG_ERF_SLOPE,
    NORM_POSITIONS,
    RELEASED_ALPHA_INIT,
    AlphaInit,
    Derf,
    DyT,
    learnable_embed_scale,
)

F64 = torch.float64
HALF = (torch.float16, torch.bfloat16)
U = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24, F64: 2.0**-53}
UC = {torch.float16: 2.0**-24, torch.bfloat16: 2.0**-24, torch.float32: 2.0**-24, F64: 2.0**-53}
ERF_CPU_16BIT_ABS = 4e-7
ERF_SLOPE = 2.0 / math.sqrt(math.pi)
KINDS = ("dyt", "dyt_llama", "derf", "derf_nobias")
C = 16


def subnormal(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def make(kind: str, dim: int = C, **kw) -> nn.Module:
    if kind == "dyt":
        return DyT(dim, **kw)
    if kind == "dyt_llama":
        return DyT(dim, bias=False, **kw)
    return Derf(dim, bias=kind == "derf", **kw)


def case(kind: str, dtype: torch.dtype, layout: str = "contiguous", seed: int = 0):
    """A module with non-trivial parameters, an input (``(T, B, C)``; ``transposed``: fairseq's
    ``(B, T, C)``.transpose(0, 1)) reaching tanh's and erf's saturation, and a cotangent; all in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    module = make(kind, alpha_init=0.7, **({"shift_init": 0.3} if kind.startswith("derf") else {}))
    with torch.no_grad():
        module.weight.copy_(1 + 0.5 * torch.randn(C, generator=g))
        if module.bias is not None:
            module.bias.copy_(0.2 * torch.randn(C, generator=g))
    module = module.to(dtype)
    x = 2.5 * torch.randn(3, 4, C, generator=g)
    x[0, 0, :4] = torch.tensor([0.0, 40.0, -40.0, 1e-3])
    x = x.to(dtype).transpose(0, 1) if layout == "transposed" else x.transpose(0, 1).contiguous().to(dtype)
    dy = torch.randn(4, 3, C, generator=g).to(dtype)
    return module, x, dy


def params64(module: nn.Module) -> dict:
    return {n: p.detach().to(F64) for n, p in module.named_parameters()}


def port_forward(kind: str, x: torch.Tensor, p: dict) -> torch.Tensor:
    if kind == "dyt":
        return port.dyt(x, p["alpha"], p["weight"], p["bias"])
    if kind == "dyt_llama":
        return port.dyt_llama(x, p["alpha"], p["weight"])
    return port.derf(x, p["alpha"], p["shift"], p["weight"], p.get("bias"))


def reference(kind: str, module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict:
    """Output and gradients of the port in fp64 on the module's values (autograd through the port)."""
    p = {n: v.requires_grad_() for n, v in params64(module).items()}
    x64 = x.detach().to(F64).requires_grad_()
    y = port_forward(kind, x64, p)
    y.backward(dy.to(F64))
    return {"y": y.detach(), "x": x64.grad, **{n: v.grad for n, v in p.items()}}


def run(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict:
    x = x.detach().requires_grad_()
    y = module(x)
    names = [n.removeprefix("_orig_mod.") for n, _ in module.named_parameters()]  # torch.compile's wrapper
    grads = torch.autograd.grad(y, [x, *module.parameters()], dy)
    return {"y": y.detach(), **dict(zip(["x", *names], grads, strict=True))}


def bounds(kind: str, module: nn.Module, x: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype) -> dict:
    """Per-element bounds on |module - exact| for output and gradients computed in ``dtype``
    (derivation in the module docstring); ``module``, ``x``, ``dy`` hold the exact inputs."""
    u, uc = U[dtype], UC[dtype]
    kappa = 4 * uc
    eta = 4 * subnormal(dtype)
    p = params64(module)
    a, w = p["alpha"], p["weight"]
    b = p["bias"].abs() if "bias" in p else torch.zeros_like(w)
    x, dy = x.to(F64), dy.to(F64)
    ax = (a * x).abs()
    rows = tuple(range(x.dim() - 1))
    n, m = x.numel(), x.numel() // x.size(-1)
    g = dy * w
    if kind.startswith("dyt"):
        t = torch.tanh(a * x)
        dt = (2 * u + kappa) * t.abs() + eta
        d1mt2 = dt * (2 * t.abs() + dt)
        dz = g * (1 - t * t)
        pre = u * g.abs() * (1 - t * t + d1mt2) + g.abs() * d1mt2 + 6 * uc * g.abs() * (1 + u)
        e_dz = pre + u * (dz.abs() + pre) + eta
    else:
        s = p["shift"]
        z = a * x + s
        dz_in = u * ax + u * (ax * (1 + u) + s.abs())
        lo, hi = (z.abs() - dz_in).clamp(min=0), z.abs() + dz_in
        slope_max = ERF_SLOPE * torch.exp(-lo * lo)
        t = torch.erf(z)
        erf_abs = ERF_CPU_16BIT_ABS if dtype in HALF else 0.0
        dt = slope_max * dz_in + (u + kappa) * (t.abs() + slope_max * dz_in) + erf_abs + eta
        # erf's slope c exp(-z^2): Lipschitz constant 2 c zeta exp(-zeta^2) at the zeta of [lo, hi] nearest 1/sqrt(2)
        zeta = torch.minimum(torch.maximum(torch.full_like(lo, 0.5**0.5), lo), hi)
        lipschitz = 2 * ERF_SLOPE * zeta * torch.exp(-zeta * zeta)
        e = ERF_SLOPE * torch.exp(-z * z)
        de_rel = u * (2 * hi * hi * (1 + u) + abs(LOG_ERF_SLOPE)) + uc + u + kappa
        e_e = lipschitz * dz_in + (e + lipschitz * dz_in) * de_rel * 1.01 + eta
        dz = g * e
        e_dz = g.abs() * (e_e * (1 + u) + u * e + u * (1 + u) * (e + e_e)) + eta
    tw = w.abs() * (t.abs() + dt)
    out = {
        "y": w.abs() * dt + u * tw * (2 + u) + u * b + eta,
        "x": a.abs() * e_dz + u * a.abs() * (dz.abs() + e_dz) + eta,
        "alpha": ((x.abs() * e_dz).sum() + (2 * u + 1.01 * n * uc) * (x.abs() * (dz.abs() + e_dz)).sum()).reshape(1),
        "weight": (dy.abs() * dt).sum(rows) + (2 * u + 1.01 * m * uc) * (dy.abs() * (t.abs() + dt)).sum(rows),
    }
    if "bias" in p:
        out["bias"] = (u + 1.01 * m * uc) * dy.abs().sum(rows) + eta
    if "shift" in p:
        out["shift"] = (e_dz.sum() + (u + 1.01 * n * uc) * (dz.abs() + e_dz).sum()).reshape(1)
    return out


def tolerance(kind: str, module: nn.Module, x: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype) -> dict:
    """The bound in ``dtype`` plus the port's own fp64 error."""
    ours, ports = bounds(kind, module, x, dy, dtype), bounds(kind, module, x, dy, F64)
    return {k: v + ports[k] for k, v in ours.items()}


def assert_within(got: dict, ref: dict, tol: dict) -> None:
    assert set(got) == set(ref) == set(tol)
    for name in ref:
        err = (got[name].to(F64) - ref[name]).abs()
        worst = (err / tol[name]).max().item()
        assert worst <= 1.0, f"{name}: error {err.max().item():.3g} is {worst:.3g} x its bound"


# --- init values and names as released ----------------------------------------------------------


def test_init_as_released():
    """Parameter names, shapes and values of the released modules (``dynamic_tanh.py:13-15``,
    ``llama.py:38-43``, ``ViT/dynamic_erf.py:14-17``), so that their state dicts load."""
    d = 12
    cases = [
        (DyT(d), port.init_params("dyt", d)),
        (DyT(d, bias=False, alpha_init=1.0), port.init_params("dyt_llama", d)),  # LLaMAConfig default 1.0
        (DyT(d, bias=False, alpha_init=0.2), port.init_params("dyt_llama", d, alpha_init=0.2)),
        (Derf(d), port.init_params("derf", d)),
    ]
    for module, released in cases:
        assert set(dict(module.named_parameters())) == set(released), module
        for name, value in module.state_dict().items():
            assert value.dtype == torch.float32 and value.shape == released[name].shape, name
            torch.testing.assert_close(value, released[name].float(), rtol=0, atol=0, msg=name)
    assert DYT_ALPHA_INIT == port.DYT_ALPHA_INIT and DERF_ALPHA_INIT == port.DERF_ALPHA_INIT
    assert DERF_SHIFT_INIT == port.DERF_SHIFT_INIT


def test_builder_interface_and_reset():
    """``(dim, eps)`` as a norm builder calls every norm (eps unused: nothing is divided), the released
    options as keywords; ``reset_parameters`` restores the init; ``repr`` names the options."""
    m = DyT(8, 1e-5)
    n = Derf(8, eps=1e-6, alpha_init=0.3, shift_init=-0.1, bias=False)
    with torch.no_grad():
        for p in [*m.parameters(), *n.parameters()]:
            p.add_(1.0)
    m.reset_parameters()
    n.reset_parameters()
    assert m.alpha.item() == 0.5 and m.weight.eq(1).all() and m.bias.eq(0).all()
    assert n.alpha.item() == pytest.approx(0.3) and n.shift.item() == pytest.approx(-0.1) and n.bias is None
    assert "bias" not in n.state_dict()
    assert repr(m) == "DyT(8, alpha_init=0.5, bias=True)"
    assert repr(n) == "Derf(8, alpha_init=0.3, shift_init=-0.1, bias=False)"


def test_alpha_init_table_as_released():
    """The LLaMA README's per-position alphas (the port's table) and the config defaults; a module built
    with a position's value starts there."""
    for name, vals in port.LLAMA_ALPHA_INIT.items():
        ours = RELEASED_ALPHA_INIT[name]
        assert (ours.attn, ours.ffn, ours.final) == (vals["attn"], vals["ffn"], vals["dec"]), name
        assert LLAMA_SIZES[name] == (vals["width"], vals["layers"]), name
    assert RELEASED_ALPHA_INIT["llama-config"] == AlphaInit(1.0, 1.0, 1.0)
    assert RELEASED_ALPHA_INIT["dyt"] == AlphaInit(0.5, 0.5, 0.5) == RELEASED_ALPHA_INIT["derf"]
    table = RELEASED_ALPHA_INIT["llama2_13b"]
    for position, released in zip(NORM_POSITIONS, ("attn", "ffn", "dec"), strict=True):
        assert table.at(position) == port.alpha_init_for(released, "llama2_13b")
        module = DyT(16, alpha_init=table.at(position), bias=False)
        assert module.alpha.item() == torch.tensor(table.at(position), dtype=torch.float32).item()
    with pytest.raises(ValueError, match="unknown norm position 'dec'; choose from attn, ffn, final"):
        table.at("dec")


# --- outputs and gradients against the port ------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_equals_port(kind, dtype, layout):
    """Output, input gradient and every parameter gradient within the derived bound of the port's fp64
    values on identical parameters; the output contiguous (as LayerNorm's) and in the input's dtype."""
    module, x, dy = case(kind, dtype, layout)
    got = run(module, x, dy)
    ref = reference(kind, module, x, dy)
    tol = tolerance(kind, module, x, dy, dtype)
    assert_within(got, ref, tol)
    assert got["y"].dtype == dtype and got["y"].is_contiguous() and got["x"].dtype == dtype
    if dtype == torch.float32:  # the bounds are not vacuous: fp32 output within 1e-6 of its scale
        assert (tol["y"] <= 1e-6 * (1 + ref["y"].abs())).all()


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck(kind):
    """The hand-written backward against finite differences (fp64), transposed input."""
    module, x, _ = case(kind, F64, "transposed")
    x = (x / 2.5).detach().requires_grad_()  # away from saturation, where the differences are informative
    assert torch.autograd.gradcheck(lambda x, *p: module(x), (x, *module.parameters()))


@pytest.mark.parametrize("kind", KINDS)
def test_promotes_like_the_released_code(kind):
    """A 16-bit input with fp32 parameters (autocast, Sub-LN's inner norm after a bf16 Linear) computes in
    fp32 as the released formula does (the one-element alpha promotes); the input's gradient comes back
    in its dtype; under ``torch.autocast`` the output dtype is the released formula's."""
    module, x, dy = case(kind, torch.float32, "transposed")
    xh = x.bfloat16()
    got = run(module, xh, dy)
    assert got["y"].dtype == torch.float32 and got["x"].dtype == torch.bfloat16
    ref = reference(kind, module, xh, dy)
    tol = bounds(kind, module, xh, dy, torch.float32)
    tol["x"] = tol["x"] + U[torch.bfloat16] * ref["x"].abs() + 4 * subnormal(torch.bfloat16)  # the cast back
    assert_within(got, ref, tol)
    p = {n: v.detach() for n, v in module.named_parameters()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert module(xh).dtype == port_forward(kind, xh, p).dtype == torch.float32
        assert module(x).dtype == port_forward(kind, x, p).dtype == torch.float32


@pytest.mark.slow  # torch.compile: seconds
def test_compiles_without_graph_breaks():
    """``torch.compile(fullgraph=True)`` traces both functions, backward included; the traced graph
    lays its buffers out on its own (sums may run in another order), so it is held to the same bound."""
    for kind in ("dyt", "derf"):
        torch._dynamo.reset()
        module, x, dy = case(kind, torch.float32, "transposed")
        compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
        traced = run(compiled, x, dy)
        assert_within(traced, reference(kind, module, x, dy), tolerance(kind, module, x, dy, torch.float32))
    torch._dynamo.reset()


# --- the learnable embedding scale ----------------------------------------------------------------


def test_learnable_embed_scale_in_fairseqs_forward():
    """Assigned to a stock fairseq encoder's and decoder's ``embed_scale``, fairseq's own
    ``embed_scale * embed_tokens(tokens)`` keeps its output at init (``sqrt(d)``, the LLaMA init,
    ``llama.py:209``) and trains the scalar: its gradient is ``sum(dL/dx * tok)``."""
    model, _ = build_model("transformer", *TINY_DIMS, "--dropout", "0")
    d = model.encoder.embed_tokens.embedding_dim
    assert model.encoder.embed_scale == math.sqrt(d) == port.embedding_scale_init(d)
    src = torch.randint(4, 50, (2, 5))
    before, _ = model.encoder.forward_embedding(src)
    model.encoder.embed_scale = learnable_embed_scale(model.encoder.embed_scale)
    model.decoder.embed_scale = learnable_embed_scale(model.decoder.embed_scale)
    assert model.encoder.embed_scale.shape == (1,) and "encoder.embed_scale" in model.state_dict()
    after, embed = model.encoder.forward_embedding(src)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    tok = model.encoder.embed_tokens(src).detach()
    torch.testing.assert_close(embed, port.embed_llama(tok, model.encoder.embed_scale), rtol=0, atol=0)
    cot = torch.randn_like(after)
    (scale_grad,) = torch.autograd.grad(after, [model.encoder.embed_scale], cot)
    expected = (cot.double() * tok.double()).sum()
    n_terms = tok.numel()
    bound = (2 * U[torch.float32] + 1.01 * n_terms * U[torch.float32]) * (cot.double() * tok.double()).abs().sum()
    assert abs(scale_grad.double().item() - expected.item()) <= bound.item()
    prev = torch.randint(4, 50, (2, 4))
    logits, _ = model(src, torch.tensor([5, 5]), prev)
    logits.sum().backward()
    assert model.decoder.embed_scale.grad is not None and model.decoder.embed_scale.grad.ne(0).all()


# --- kernels --------------------------------------------------------------------------------------


def released_formula(kind: str, module: nn.Module):
    """The released forward through autograd (``dynamic_tanh.py:17-23``, ``llama.py:45-46``,
    ``ViT/dynamic_erf.py:19-26``), for its operator count."""
    if kind == "dyt":
        return lambda x: torch.tanh(module.alpha * x) * module.weight + module.bias
    if kind == "dyt_llama":
        return lambda x: module.weight * torch.tanh(module.alpha * x)
    if kind == "derf":
        return lambda x: torch.erf(module.alpha * x + module.shift) * module.weight + module.bias
    return lambda x: torch.erf(module.alpha * x + module.shift) * module.weight


def op_count(fn, params, dtype: torch.dtype, layout: str = "contiguous", then=None) -> OpCounter:
    """aten operators of ``fn``'s forward and backward (input and parameter gradients, no accumulation)
    on the ``meta`` device (what a GPU would launch; no data); ``then``: a module applied after ``fn``."""
    x = torch.randn(3, 5, 64, device="meta", dtype=dtype)
    x = (x.transpose(0, 1) if layout == "transposed" else x.transpose(0, 1).contiguous()).requires_grad_()
    dy = torch.randn(5, 3, 64, device="meta", dtype=dtype)
    with OpCounter() as ops:
        y = fn(x)
        y = then(y) if then is not None else y
        torch.autograd.grad(y, [x, *params], dy)
    return ops


# forward + backward operators: (this module, the released formula through autograd)
EXPECTED_OPS = {"dyt": (10, 12), "dyt_llama": (9, 10), "derf": (14, 18), "derf_nobias": (13, 16)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
def test_op_counts(kind, dtype):
    """Fewer operators than autograd through the released formula (LayerNorm: 2): forward ``mul``
    (``addcmul`` for Derf's ``alpha x + shift``), ``tanh_`` / ``erf``, one ``addcmul`` for ``bias + t
    weight``; backward one ``dot`` for alpha's gradient, one sum per parameter, no copy."""
    module = make(kind, 64).to("meta", dtype)
    params = list(module.parameters())
    ln = nn.LayerNorm(64).to("meta", dtype)
    assert op_count(ln, list(ln.parameters()), dtype).total == 2
    ops = op_count(module, params, dtype)
    released = op_count(released_formula(kind, module), params, dtype)
    assert (ops.total, released.total) == EXPECTED_OPS[kind], (ops.counts, released.counts)
    assert ops.counts["aten.dot.default"] == 1 and "aten.clone.default" not in ops.counts, ops.counts
    if module.bias is not None:
        assert ops.counts["aten.addcmul.default"] == 1, ops.counts


@pytest.mark.parametrize("kind", ["dyt", "derf"])
def test_transposed_input_keeps_the_next_linear_one_addmm(kind):
    """On fairseq's transposed ``(T, B, C)`` input the output is contiguous, like LayerNorm's: the next
    Linear runs as one ``addmm`` (the released formula's output keeps the input's strides and the Linear
    then copies, ``mm`` and adds). Alpha's gradient falls back to ``mul`` + ``sum`` (one more operator)."""
    module = make(kind, 64).to("meta")
    linear = nn.Linear(64, 64).to("meta")
    params = [*module.parameters(), *linear.parameters()]
    ours = op_count(module, params, torch.float32, "transposed", then=linear)
    released = op_count(released_formula(kind, module), params, torch.float32, "transposed", then=linear)
    assert ours.counts["aten.addmm.default"] == 1 and "aten.clone.default" not in ours.counts, ours.counts
    assert released.counts["aten.clone.default"] == 1 and "aten.addmm.default" not in released.counts
    assert ours.total == EXPECTED_OPS[kind][0] + 1 + 4  # + mul/sum for alpha; Linear: addmm, 2 mm, sum
