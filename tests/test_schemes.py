"""Every ``--init-scheme`` against its closed form (METHODS.md, the papers' equations).

Two kinds of checks:

- *distribution* checks on single weights of a wide model (d=512, FFN 1024, vocabulary 1008), so
  that a wrong constant is detectable: a U(-b, b) weight must have max|w| <= b and
  max|w| >= b (1 - 20/n) (for n draws, P(max|w| < b(1 - t)) = (1 - t)^n ~ exp(-20)), std b/sqrt(3)
  and kurtosis 1.8; an N(0, s^2) weight std s and kurtosis 3. Tolerances are 6 standard errors of
  the estimator (std: sqrt((kurtosis - 1) / (4 n)) relative; kurtosis: sqrt(24 / n); mean:
  std / sqrt(n)), so a correct init fails with probability ~1e-9 while a wrong gain of a few
  percent (or uniform instead of normal) fails for sure at n >= 2.6e5 (std tolerance ~0.5-0.8%);
- *exact* checks for schemes that rescale the baseline (T-Fixup, DS-Init embeddings, ReZero):
  the same-seed ``xavier`` model's weight times the factor, bit for bit, and untouched weights
  bit-identical.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from conftest import build_model
from fairseq_deepinit.modules.norms import is_norm
from fairseq_deepinit.modules.residual import ConstantResidual, ReZeroResidual

D, FFN, HEADS, N_SYMBOLS = 512, 1024, 8, 1000
N_E, N_D = 2, 3  # different depths so that an encoder/decoder mix-up in a formula shows


def wide(*cli: str, layers=(N_E, N_D), d: int = D, seed: int = 1):
    dims = [
        "--encoder-embed-dim", str(d), "--decoder-embed-dim", str(d),
        "--encoder-ffn-embed-dim", str(FFN), "--decoder-ffn-embed-dim", str(FFN),
        "--encoder-attention-heads", str(HEADS), "--decoder-attention-heads", str(HEADS),
        "--encoder-layers", str(layers[0]), "--decoder-layers", str(layers[1]),
    ]  # fmt: skip
    return build_model("deepinit", *dims, *cli, n_symbols=N_SYMBOLS, seed=seed)


def _moments(w: torch.Tensor):
    x = w.detach().double().flatten()
    mean = x.mean().item()
    std = x.std(unbiased=False).item()
    kurt = (((x - mean) / std) ** 4).mean().item()
    return x.numel(), mean, std, kurt


def assert_uniform(w: torch.Tensor, bound: float, what: str = "") -> None:
    """``w`` ~ U(-bound, bound)."""
    n, mean, std, kurt = _moments(w)
    wmax = w.detach().abs().max().item()
    assert wmax <= bound * (1 + 1e-6), f"{what}: max|w|={wmax} exceeds the bound {bound}"
    assert wmax >= bound * (1 - 20.0 / n), f"{what}: max|w|={wmax} far below the bound {bound}"
    want = bound / math.sqrt(3.0)
    assert abs(std / want - 1) < 6 * math.sqrt(0.8 / (4 * n)), f"{what}: std {std} != b/sqrt(3) = {want}"
    assert abs(mean) < 6 * want / math.sqrt(n), f"{what}: mean {mean}"
    assert abs(kurt - 1.8) < 6 * math.sqrt(24.0 / n), f"{what}: kurtosis {kurt} is not uniform's 1.8"


def assert_normal(w: torch.Tensor, std_want: float, what: str = "") -> None:
    """``w`` ~ N(0, std_want^2)."""
    n, mean, std, kurt = _moments(w)
    assert abs(std / std_want - 1) < 6 * math.sqrt(2.0 / (4 * n)), f"{what}: std {std} != {std_want}"
    assert abs(mean) < 6 * std_want / math.sqrt(n), f"{what}: mean {mean}"
    assert abs(kurt - 3.0) < 6 * math.sqrt(24.0 / n), f"{what}: kurtosis {kurt} is not normal's 3"


def xavier_bound(lin: nn.Linear, gain: float = 1.0) -> float:
    return gain * math.sqrt(6.0 / (lin.in_features + lin.out_features))


def xavier_std(lin: nn.Linear, gain: float = 1.0) -> float:
    return gain * math.sqrt(2.0 / (lin.in_features + lin.out_features))


def layers(model):
    """``(stack, l, layer)``, l from 1 per stack."""
    for stack in ("encoder", "decoder"):
        for i, layer in enumerate(getattr(model, stack).layers, start=1):
            yield stack, i, layer


def attns(layer):
    return [a for a in (getattr(layer, "self_attn", None), getattr(layer, "encoder_attn", None)) if a is not None]


def layer_biases(model):
    for stack, depth, layer in layers(model):
        for name, p in layer.named_parameters():
            if name.endswith("bias") and "norm" not in name:
                yield f"{stack}.{depth}.{name}", p


def assert_zero_biases(model) -> None:
    checked = 0
    for name, p in layer_biases(model):
        assert torch.count_nonzero(p) == 0, f"{name} should be zero"
        checked += 1
    assert checked > 0


def assert_norms_identity_start(model) -> None:
    for name, m in model.named_modules():
        if isinstance(m, nn.LayerNorm):
            assert torch.equal(m.weight, torch.ones_like(m.weight)), name
            assert torch.equal(m.bias, torch.zeros_like(m.bias)), name


# ---------------------------------------------------------------------------------------------
# baselines


def test_xavier_baseline_matches_fairseq_0_9():
    """METHODS "Baseline initialisation": xavier_uniform everywhere, q/k/v gain 1/sqrt(2), zero biases,
    embeddings N(0, d^-1/2) with a zero padding row."""
    model, args = wide("--init-scheme", "xavier")
    assert args.init_scheme == "xavier"
    for stack, depth, layer in layers(model):
        for attn in attns(layer):
            for proj in ("q_proj", "k_proj", "v_proj"):
                lin = getattr(attn, proj)
                assert_uniform(lin.weight, xavier_bound(lin, 1 / math.sqrt(2)), f"{stack}{depth}.{proj}")
            assert_uniform(attn.out_proj.weight, xavier_bound(attn.out_proj), f"{stack}{depth}.out_proj")
        for fc in (layer.fc1, layer.fc2):
            assert_uniform(fc.weight, xavier_bound(fc), f"{stack}{depth}.fc")
    assert_zero_biases(model)
    assert_norms_identity_start(model)
    for stack in ("encoder", "decoder"):
        emb = getattr(model, stack).embed_tokens
        pad = emb.padding_idx
        assert torch.count_nonzero(emb.weight[pad]) == 0
        rows = torch.cat([emb.weight[:pad], emb.weight[pad + 1 :]])
        assert_normal(rows, D**-0.5, f"{stack} embedding")


def test_fairseq_scheme_keeps_fairseq_0_12_defaults():
    """``fairseq``: fc1/fc2 and q/k/v keep nn.Linear's kaiming_uniform(a=sqrt(5)) bias U(+-1/sqrt(fan_in))."""
    model, _ = wide("--init-scheme", "fairseq")
    layer = model.encoder.layers[0]
    for fc in (layer.fc1, layer.fc2):
        b = 1 / math.sqrt(fc.in_features)  # kaiming_uniform with a=sqrt(5): gain sqrt(1/3) * sqrt(3 / fan_in)
        assert_uniform(fc.weight, b, "fc weight")
        assert torch.count_nonzero(fc.bias) == fc.bias.numel()
        assert fc.bias.abs().max() <= b
    for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
        assert_uniform(proj.weight, xavier_bound(proj, 1 / math.sqrt(2)), "qkv")
        assert torch.count_nonzero(proj.bias) == proj.bias.numel()
    assert torch.count_nonzero(layer.self_attn.out_proj.bias) == 0  # fairseq zeroes only this one
    # and it is not the xavier scheme: same seed, different fc biases
    xav, _ = wide("--init-scheme", "xavier")
    assert not torch.equal(xav.encoder.layers[0].fc1.bias, layer.fc1.bias)


# ---------------------------------------------------------------------------------------------
# Lipschitz (Xu et al. 2020)


def test_lipschitz_closed_form():
    model, _ = wide("--init-scheme", "lipschitz")
    for stack, depth, layer in layers(model):
        for lin in [m for m in layer.modules() if isinstance(m, nn.Linear)]:
            assert_uniform(lin.weight, 1 / math.sqrt(lin.in_features), f"{stack}{depth} {lin}")
    assert_zero_biases(model)
    assert_norms_identity_start(model)
    for stack in ("encoder", "decoder"):
        emb = getattr(model, stack).embed_tokens
        v, d = emb.weight.shape
        assert v == 1008  # 1000 words + 4 specials, padded to a multiple of 8
        assert torch.count_nonzero(emb.weight[emb.padding_idx]) == 0
        rows = torch.cat([emb.weight[: emb.padding_idx], emb.weight[emb.padding_idx + 1 :]])
        assert_uniform(rows, math.sqrt(2.0 / (v + d)), f"{stack} embedding")
    # the untied output projection is a d -> V weight like any other
    out = model.decoder.output_projection
    assert_uniform(out.weight, 1 / math.sqrt(D), "output projection")


def test_lipschitz_tied_output_is_the_embedding():
    model, _ = wide("--init-scheme", "lipschitz", "--share-decoder-input-output-embed")
    emb = model.decoder.embed_tokens
    assert model.decoder.output_projection.weight is emb.weight
    v, d = emb.weight.shape
    assert emb.weight.abs().max() <= math.sqrt(2.0 / (v + d))  # not overwritten by the 1/sqrt(d) rule
    assert torch.count_nonzero(emb.weight[emb.padding_idx]) == 0


def test_lipschitz_bias_free_drops_exactly_the_released_biases():
    model, args = wide("--init-scheme", "lipschitz", "--lipschitz-bias-free", layers=(1, 1), d=64)
    assert args.lipschitz_bias_free is True
    names = {n for n, _ in model.named_parameters()}
    for stack, _l, layer in layers(model):
        prefix = f"{stack}.layers.0."
        for attn_name in ("self_attn", "encoder_attn"):
            if getattr(layer, attn_name, None) is None:
                continue
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                assert f"{prefix}{attn_name}.{proj}.bias" not in names
                bias = getattr(getattr(layer, attn_name), proj).bias
                assert bias is not None and torch.count_nonzero(bias) == 0  # a zero buffer
        assert f"{prefix}fc2.bias" not in names
        assert f"{prefix}fc1.bias" in names and torch.count_nonzero(layer.fc1.bias) == 0
        assert_uniform(layer.fc1.weight, 1 / math.sqrt(layer.fc1.in_features), "fc1")


# ---------------------------------------------------------------------------------------------
# T-Fixup (Huang et al. 2020): exact factors against the same-seed baseline


def _pairs(model, base):
    b = dict(base.named_parameters())
    return {n: (p, b[n]) for n, p in model.named_parameters()}


@pytest.mark.parametrize("share", ["none", "all", "decoder-io"])
def test_tfixup_scales_baseline_exactly(share):
    flags = {"none": (), "all": ("--share-all-embeddings",), "decoder-io": ("--share-decoder-input-output-embed",)}
    model, args = build_model("deepinit_tiny", "--encoder-layers", "2", "--decoder-layers", "3", "--init-scheme",
                              "t-fixup", *flags[share])  # fmt: skip
    base, _ = build_model("deepinit_tiny", "--encoder-layers", "2", "--decoder-layers", "3", "--init-scheme",
                          "xavier", *flags[share])  # fmt: skip
    assert args.norm_type == "none"
    enc = 0.67 * N_E**-0.25
    dec = (9 * N_D) ** -0.25
    factors = {
        "fc1.weight": (enc, dec),
        "fc2.weight": (enc, dec),
        "self_attn.out_proj.weight": (enc, dec),
        "encoder_attn.out_proj.weight": (None, dec),
        "self_attn.v_proj.weight": (enc * math.sqrt(2), dec * math.sqrt(2)),
        "encoder_attn.v_proj.weight": (None, dec * math.sqrt(2)),
    }
    emb_enc = (9 * N_E) ** -0.25
    emb_dec = emb_enc if share == "all" else (9 * N_D) ** -0.25
    scaled, untouched = 0, 0
    for name, (p, q) in _pairs(model, base).items():
        stack = name.split(".")[0]
        suffix = name.split(".", 3)[-1] if ".layers." in name else None
        if suffix in factors:
            f = factors[suffix][0 if stack == "encoder" else 1]
            torch.testing.assert_close(p, q * f, rtol=0, atol=0, msg=f"{name}: not baseline x {f}")
            scaled += 1
        elif name == "encoder.embed_tokens.weight":
            torch.testing.assert_close(p, q * emb_enc, rtol=0, atol=0)
        elif name == "decoder.embed_tokens.weight":
            torch.testing.assert_close(p, q * emb_dec, rtol=0, atol=0)
        else:  # q, k, biases, untied output projection
            assert torch.equal(p, q), f"{name} should be the baseline's"
            untouched += suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight")
    assert scaled == 2 * 4 + 3 * 6
    assert untouched == 2 * (N_E + N_D)  # q and k of every self-attention
    if share == "all":
        assert model.decoder.embed_tokens is model.encoder.embed_tokens  # scaled once, by the encoder factor
    if share == "decoder-io":
        assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight
    assert not any(is_norm(m) for m in model.modules())


# ---------------------------------------------------------------------------------------------
# DS-Init (Zhang et al. 2019, eq. 15) and the released code's bound


def tf_variance_scaling_bound(fan_in: int, fan_out: int, scale: float) -> float:
    """``tf.variance_scaling_initializer(scale, mode="fan_avg", distribution="uniform")``: the released
    DS-Init code's initializer (bzhangGo/zero models/transformer.py lines 38-42), U(+-sqrt(3 scale / fan_avg))."""
    return math.sqrt(3.0 * scale / ((fan_in + fan_out) / 2.0))


@pytest.mark.parametrize(
    "variant,alpha",
    [("paper", 1.0), ("paper", 0.5), ("code", 0.5), ("code", 1.0)],
)
def test_dsinit_bound_per_depth(variant, alpha):
    cli = ["--init-scheme", "ds-init", "--ds-init-variant", variant, "--ds-init-alpha", str(alpha)]
    model, args = wide(*cli)
    assert (args.ds_init_variant, args.ds_init_alpha) == (variant, alpha)
    for stack, depth, layer in layers(model):
        for name, lin in [(n, m) for n, m in layer.named_modules() if isinstance(m, nn.Linear)]:
            if variant == "paper":
                bound = math.sqrt(6.0 / (lin.in_features + lin.out_features)) * alpha / math.sqrt(depth)
            else:
                fused = name.startswith("self_attn.") and name[len("self_attn.") :] in ("q_proj", "k_proj", "v_proj")
                bound = tf_variance_scaling_bound(lin.in_features, 3 * lin.out_features if fused else lin.out_features,
                                                  alpha * (depth**-0.5))  # fmt: skip
            assert_uniform(lin.weight, bound, f"{stack} layer {depth} {name}")
    assert_zero_biases(model)
    assert_norms_identity_start(model)
    # embeddings untouched: identical to the same-seed baseline
    base, _ = wide("--init-scheme", "xavier")
    for stack in ("encoder", "decoder"):
        assert torch.equal(getattr(model, stack).embed_tokens.weight, getattr(base, stack).embed_tokens.weight)
    assert torch.equal(model.decoder.output_projection.weight, base.decoder.output_projection.weight)


def test_dsinit_code_fuses_self_attention_fans():
    """The released code's self-attention q/k/v are one d x 3d matrix (func.py line 196): their bound is
    1/sqrt(2) of a separate d x d matrix's, the cross-attention's (separate q_map/k_map/v_map) is not;
    MAtt's W_v shared with the cross-attention keeps the cross-attention's fans (func.py line 260)."""
    model, _ = wide("--init-scheme", "ds-init", "--ds-init-variant", "code", layers=(1, 1))
    layer = model.decoder.layers[0]
    ratio = layer.self_attn.v_proj.weight.abs().max() / layer.encoder_attn.v_proj.weight.abs().max()
    assert ratio.item() == pytest.approx(2**-0.5, rel=0.01)
    matt, _ = wide("--init-scheme", "ds-init", "--ds-init-variant", "code", "--decoder-layer-type", "matt",
                   "--matt-self-branch", "self-attn", layers=(1, 1))  # fmt: skip
    layer = matt.decoder.layers[0]
    assert layer.self_branch.v_proj is layer.encoder_attn.v_proj  # shared W_v (the default)
    assert_uniform(layer.self_branch.q_proj.weight, tf_variance_scaling_bound(D, 3 * D, 1.0), "self-attn q")
    assert_uniform(layer.encoder_attn.v_proj.weight, tf_variance_scaling_bound(D, D, 1.0), "shared W_v")


# ---------------------------------------------------------------------------------------------
# SmallInit (Nguyen & Salazar 2019, sec. 2.1)


def test_smallinit_std():
    model, _ = wide("--init-scheme", "smallinit", layers=(1, 1))
    std_attn = math.sqrt(2.0 / (5 * D))  # the std itself, i.e. xavier normal as if fan_out = 4d
    for stack, _l, layer in layers(model):
        for attn in attns(layer):
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                assert_normal(getattr(attn, proj).weight, std_attn, f"{stack} {proj}")
        for fc in (layer.fc1, layer.fc2):
            assert_normal(fc.weight, xavier_std(fc), f"{stack} fc")
    assert_zero_biases(model)
    base, _ = wide("--init-scheme", "xavier", layers=(1, 1))
    assert torch.equal(model.encoder.embed_tokens.weight, base.encoder.embed_tokens.weight)


# ---------------------------------------------------------------------------------------------
# DeepNorm (Wang et al. 2022, Table 1 and Figure 2)


def test_deepnorm_gains_and_alphas():
    model, args = wide("--init-scheme", "deepnorm")
    assert args.residual_scale == "deepnorm"
    beta = {"encoder": 0.87 * (N_E**4 * N_D) ** (-1 / 16), "decoder": (12 * N_D) ** -0.25}
    alpha = {"encoder": 0.81 * (N_E**4 * N_D) ** (1 / 16), "decoder": (3 * N_D) ** 0.25}
    for stack, depth, layer in layers(model):
        for attn in attns(layer):
            for proj in ("v_proj", "out_proj"):
                lin = getattr(attn, proj)
                assert_normal(lin.weight, xavier_std(lin, beta[stack]), f"{stack}{depth} {proj}")
            for proj in ("q_proj", "k_proj"):
                lin = getattr(attn, proj)
                assert_normal(lin.weight, xavier_std(lin, 1.0), f"{stack}{depth} {proj}")
        for fc in (layer.fc1, layer.fc2):
            assert_normal(fc.weight, xavier_std(fc, beta[stack]), f"{stack}{depth} fc")
        for res in layer.residuals.values():
            assert isinstance(res, ConstantResidual)
            assert res.alpha == pytest.approx(alpha[stack], rel=1e-12)
    assert_zero_biases(model)
    assert_norms_identity_start(model)
    assert alpha["encoder"] == pytest.approx(0.81 * 2 ** (4 / 16) * 3 ** (1 / 16))  # sanity of the literal


# ---------------------------------------------------------------------------------------------
# ReZero and ReZero + Post-LN (Admin paper, Table 3)


@pytest.mark.parametrize("scheme", ["rezero", "rezero+postln"])
def test_rezero_starts_at_zero_on_the_baseline(scheme):
    model, args = build_model("deepinit_tiny", "--init-scheme", scheme)
    base, _ = build_model("deepinit_tiny", "--init-scheme", "xavier")
    assert args.residual_scale == "rezero"
    alphas = [m for m in model.modules() if isinstance(m, ReZeroResidual)]
    assert len(alphas) == 2 * 2 + 2 * 3
    assert all(a.alpha.item() == 0.0 and a.alpha.requires_grad for a in alphas)
    b = dict(base.named_parameters())
    for name, p in model.named_parameters():
        if ".residuals." in name:
            continue
        assert torch.equal(p, b[name]), name
    has_norm = any(is_norm(m) for m in model.modules())
    assert has_norm == (scheme == "rezero+postln")
    assert args.norm_type == ("none" if scheme == "rezero" else "layernorm")
