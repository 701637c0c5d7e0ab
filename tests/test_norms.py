"""Norm layers (ScaleNorm, RMSNorm, FixNorm) against by-hand formulas, and the Post-LN / Pre-LN
computation order of a layer recomputed from its own sub-modules."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import TINY_DIMS, build_model, tiny_batch
from fairseq_deepinit.modules.fixnorm import FixNormEmbedding, FixNormOutputProjection
from fairseq_deepinit.modules.norms import RMSNorm, ScaleNorm, build_norm, is_norm
from fairseq_deepinit.modules.residual import ConstantResidual, ReZeroResidual

# ---------------------------------------------------------------------------------------------
# ScaleNorm (Nguyen & Salazar 2019, eq. 3)


def test_scalenorm_formula_and_init():
    d = 48
    norm = ScaleNorm(d, eps=1e-3)
    assert norm.g.item() == pytest.approx(math.sqrt(d))  # sqrt(d), not 1
    assert [n for n, _ in norm.named_parameters()] == ["g"] and norm.g.dim() == 0  # one scalar
    with torch.no_grad():
        norm.g.fill_(2.5)
    x = torch.randn(4, 5, d, dtype=torch.float64)
    x[0, 0] = 0.0  # zero vector: output 0
    x[0, 1] = 1e-5  # ||x|| = 1e-5 * sqrt(48) < eps: divided by hypot(||x||, eps), about eps
    y = norm(x.float()).double()
    n = x.norm(dim=-1, keepdim=True)
    want = 2.5 * x / torch.hypot(n, torch.tensor(1e-3, dtype=torch.float64))  # ScaleNorm's docstring
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-7)
    assert torch.all(y[0, 0] == 0)
    # below eps: the released max(||x||, eps) divides by eps; hypot(n, eps) = eps sqrt(1 + n^2/eps^2)
    twt = 2.5 * x[0, 1] / 1e-3
    ratio = (1 + (n[0, 1] / 1e-3) ** 2).rsqrt()
    torch.testing.assert_close(y[0, 1], twt * ratio, rtol=1e-5, atol=1e-7)
    assert (y[0, 1] - twt).abs().max() > 1e-3 * twt.abs().max()  # the difference is there and measured
    # every (non-tiny) output vector has length g
    torch.testing.assert_close(y[1:].norm(dim=-1), torch.full((3, 5), 2.5, dtype=torch.float64), rtol=1e-5, atol=0)


def test_scalenorm_gradient_of_g():
    norm = ScaleNorm(16)
    x = torch.randn(3, 16)
    c = torch.randn(3, 16)
    (norm(x) * c).sum().backward()
    want = (c * x / x.norm(dim=-1, keepdim=True)).sum()
    torch.testing.assert_close(norm.g.grad, want)


def test_scalenorm_keeps_half_precision_finite():
    # ||x||^2 of a d=512 fp16 vector of entries ~20 is 2e5 > fp16 max 65504: computed in fp32
    x = torch.full((2, 512), 20.0, dtype=torch.float16)
    y = ScaleNorm(512)(x)
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), torch.full((2, 512), 1.0), rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------------------------
# RMSNorm (Zhang & Sennrich 2019, eq. 4; TwT Table 7)


def test_rmsnorm_formula():
    d = 32
    norm = RMSNorm(d, eps=1e-6)
    assert torch.equal(norm.weight, torch.ones(d))
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, d))
    x = torch.randn(2, 7, d, dtype=torch.float64) * 3
    x[1] *= 1e-3  # mean(x^2) ~ 1e-5, where eps = 1e-6 changes the result by ~5%
    y = norm(x.float()).double()
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.linspace(0.5, 2.0, d).double()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


def test_build_norm_registry():
    assert isinstance(build_norm("layernorm", 8, eps=1e-6), nn.LayerNorm)
    assert build_norm("layernorm", 8, eps=1e-6).eps == 1e-6
    assert isinstance(build_norm("scalenorm", 8), ScaleNorm) and isinstance(build_norm("rmsnorm", 8), RMSNorm)
    ident = build_norm("none", 8)
    assert isinstance(ident, nn.Identity) and not list(ident.parameters())
    dyt = build_norm("dyt", 8, None, alpha_init=0.3, bias=False)
    assert type(dyt).__name__ == "DyT" and dyt.alpha.item() == pytest.approx(0.3) and dyt.bias is None
    assert type(build_norm("derf", 8, shift_init=0.1)).__name__ == "Derf"
    with pytest.raises(ValueError, match="--norm-type layernorm takes no alpha_init"):
        build_norm("layernorm", 8, alpha_init=0.5)
    with pytest.raises(ValueError, match="layernorm, scalenorm, rmsnorm, zc-rmsnorm, dyt, derf, none"):
        build_norm("batchnorm", 8)


@pytest.mark.parametrize("norm_type,cls", [("scalenorm", ScaleNorm), ("rmsnorm", RMSNorm)])
@pytest.mark.parametrize("pre", [False, True])
def test_norm_type_replaces_every_layernorm(norm_type, cls, pre):
    flags = ["--encoder-normalize-before", "--decoder-normalize-before"] if pre else []
    model, _ = build_model("deepinit_tiny", "--norm-type", norm_type, *flags)
    norms = [m for m in model.modules() if is_norm(m)]
    assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())
    # 2 per encoder layer, 3 per decoder layer (2+2 layers), plus the final norm of each Pre-LN stack
    assert len(norms) == 2 * 2 + 3 * 2 + (2 if pre else 0)
    assert all(isinstance(m, cls) for m in norms)


# ---------------------------------------------------------------------------------------------
# FixNorm (Nguyen & Chiang 2018; TwT sec. 2.3, eq. 5)


def _fixnorm_pair(v: int = 20, d: int = 16, pad: int = 1):
    torch.manual_seed(0)
    emb = FixNormEmbedding(v, d, padding_idx=pad)
    return emb, FixNormOutputProjection(emb)


def test_fixnorm_embedding_and_output_by_hand():
    emb, out = _fixnorm_pair()
    w = emb.weight.detach()
    assert w.abs().max() <= 0.01 and torch.count_nonzero(w[1]) == 0  # U(-0.01, 0.01), zero padding row
    tokens = torch.tensor([[0, 1, 2, 19], [5, 5, 1, 3]])
    y = emb(tokens)
    for i in range(2):
        for j in range(4):
            t = tokens[i, j].item()
            want = torch.zeros(16) if t == 1 else w[t] / w[t].norm()
            torch.testing.assert_close(y[i, j], want)
    with torch.no_grad():
        out.bias.copy_(torch.randn(20))
    h = torch.randn(3, 16)
    logits = out(h)
    for k in range(20):
        unit = torch.zeros(16) if k == 1 else w[k] / w[k].norm()
        torch.testing.assert_close(logits[:, k], h @ unit + out.bias[k])
    # g * cos + b: with ||h|| = g the logit is g * cos(h, w) + b (TwT eq. 5)
    g = 3.0
    hn = g * h / h.norm(dim=-1, keepdim=True)
    cos = F.cosine_similarity(h[:, None, :], w[None, 4:5, :], dim=-1)[:, 0]
    torch.testing.assert_close(out(hn)[:, 4], g * cos + out.bias[4])
    assert out.weight is emb.weight


def test_fixnorm_padding_row_gets_no_gradient():
    emb, out = _fixnorm_pair()
    h = torch.randn(5, 16)
    tokens = torch.tensor([[1, 2, 3, 1]])
    loss = F.cross_entropy(out(h), torch.tensor([2, 3, 4, 0, 19])) + emb(tokens).pow(2).sum()
    loss.backward()
    grad = emb.weight.grad
    assert torch.isfinite(grad).all()
    assert torch.count_nonzero(grad[1]) == 0  # the padding row stays exactly zero
    assert torch.count_nonzero(emb.weight[1]) == 0
    # the other rows get exactly F.normalize's gradient (which is well defined away from 0)
    w2 = emb.weight.detach().clone().requires_grad_(True)
    unit = F.normalize(w2, dim=-1)
    keep = torch.ones(20, 1)
    keep[1] = 0
    ref = F.cross_entropy(F.linear(h, unit * keep, out.bias), torch.tensor([2, 3, 4, 0, 19]))
    ref = ref + F.embedding(tokens, unit * keep).pow(2).sum()
    ref.backward()
    rows = [i for i in range(20) if i != 1]
    torch.testing.assert_close(grad[rows], w2.grad[rows])


def test_twt_model_gradient_norm_is_moderate():
    """The twt_* arch logged gnorm ~1.6e8 at its first steps: F.normalize's 1/eps gradient at the
    zero padding row. One backward of the tiny twt model must give a gradient of ordinary size."""
    model, args = build_model("twt_iwslt_de_en", *TINY_DIMS)
    assert args.fixnorm and args.norm_type == "scalenorm"
    emb = model.decoder.embed_tokens
    assert isinstance(emb, FixNormEmbedding) and model.decoder.output_projection.weight is emb.weight
    batch = tiny_batch()
    logits, _ = model(**batch)
    target = torch.randint(4, 54, logits.shape[:2], generator=torch.Generator().manual_seed(0))
    F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1)).backward()
    total = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None))
    assert torch.isfinite(total)
    # rows of U(+-0.01) embeddings at d=64 have norm ~0.046, so d(w/||w||)/dw ~ 20: gnorm O(10-100)
    assert total < 1e3, f"gradient norm {total:.3g}: a row is being divided by eps again"
    pad = emb.padding_idx
    assert torch.count_nonzero(emb.weight.grad[pad]) == 0
    assert torch.count_nonzero(model.encoder.embed_tokens.weight.grad[pad]) == 0


# ---------------------------------------------------------------------------------------------
# Post-LN / Pre-LN computation order (Xu et al. 2020 eq. 1-2; METHODS "Post-LN / Pre-LN")


def _capture(layer):
    """Record the positional/keyword inputs and the output of ``layer``'s forward."""
    seen = {}

    def pre(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, kwargs

    def post(module, args, kwargs, output):
        seen["out"] = output

    h1 = layer.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = layer.register_forward_hook(post, with_kwargs=True)
    return seen, (h1, h2)


def _res(layer, name: str, branch: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """The residual sum written out from the residual module's own constants."""
    mod = layer.residuals[name]
    if isinstance(mod, ConstantResidual):
        return mod.alpha * skip + branch
    if isinstance(mod, ReZeroResidual):
        return skip + mod.alpha * branch
    assert type(mod).__name__ == "Residual"
    return skip + branch


def _ffn(layer, x):
    return layer.fc2(layer.activation_fn(layer.fc1(x)))


def _sublayer(layer, name, x, f, pre: bool):
    """Post-LN: LN(x (+) f(x)); Pre-LN: x (+) f(LN(x)); (+) the layer's residual sum."""
    norm = {
        "self_attn": layer.self_attn_layer_norm,
        "encoder_attn": getattr(layer, "encoder_attn_layer_norm", None),
        "ffn": layer.final_layer_norm,
    }[name]
    if pre:
        return _res(layer, name, f(norm(x)), x)
    return norm(_res(layer, name, f(x), x))


CASES = [
    # (pre, norm type, init scheme / residual flags)
    (False, "layernorm", ()),
    (True, "layernorm", ()),
    (False, "scalenorm", ()),
    (True, "scalenorm", ()),
    (True, "rmsnorm", ()),
    (False, "layernorm", ("--init-scheme", "deepnorm")),
    (False, "layernorm", ("--init-scheme", "rezero+postln")),
    (False, "none", ("--init-scheme", "rezero")),
]


@pytest.mark.parametrize("pre,norm_type,extra", CASES)
def test_layer_computation_order(pre, norm_type, extra):
    flags = ["--encoder-normalize-before", "--decoder-normalize-before"] if pre else []
    model, args = build_model(
        "deepinit_tiny", "--encoder-layers", "1", "--decoder-layers", "1", "--dropout", "0",
        "--norm-type", norm_type, *flags, *extra,
    )  # fmt: skip
    model.eval()
    with torch.no_grad():  # ReZero's a starts at 0, which would hide the branch: give it a value
        for i, m in enumerate(m for m in model.modules() if isinstance(m, ReZeroResidual)):
            m.alpha.fill_(0.3 + 0.1 * i)
        for m in model.modules():  # and non-trivial norm gains, so that a skipped norm shows
            if isinstance(m, (nn.LayerNorm, RMSNorm)):
                m.weight.uniform_(0.5, 1.5)
            if isinstance(m, ScaleNorm):
                m.g.fill_(2.0)
    enc_layer, dec_layer = model.encoder.layers[0], model.decoder.layers[0]
    enc_seen, h_enc = _capture(enc_layer)
    dec_seen, h_dec = _capture(dec_layer)
    batch = tiny_batch()
    with torch.no_grad():
        enc_out = model.encoder(batch["src_tokens"], src_lengths=batch["src_lengths"])
        feats, _ = model.decoder.extract_features(batch["prev_output_tokens"], encoder_out=enc_out)
    for h in h_enc + h_dec:
        h.remove()

    with torch.no_grad():
        # encoder: self-attention, then FFN
        def self_attn(z):
            return enc_layer.self_attn(query=z, key=z, value=z, key_padding_mask=None, need_weights=False)[0]

        def encoder_layer(x, order_pre):
            x = _sublayer(enc_layer, "self_attn", x, self_attn, order_pre)
            return _sublayer(enc_layer, "ffn", x, lambda z: _ffn(enc_layer, z), order_pre)

        x = encoder_layer(enc_seen["args"][0], pre)
        torch.testing.assert_close(enc_seen["out"], x, rtol=1e-5, atol=1e-5)
        if norm_type != "none":  # the other order is measurably different: the check has power
            other = encoder_layer(enc_seen["args"][0], not pre)
            assert (other - enc_seen["out"]).abs().max() > 1e-2
        final = model.encoder.layer_norm
        assert (final is not None) == (pre and norm_type != "none")  # the Pre-LN stack's final norm
        torch.testing.assert_close(enc_out["encoder_out"][0], final(x) if final is not None else x)

        # decoder: causal self-attention, cross-attention on the encoder output, FFN
        y = dec_seen["args"][0]
        mem = enc_out["encoder_out"][0]
        t = y.size(0)
        causal = torch.triu(torch.full((t, t), float("-inf")), 1)

        def dec_self(z):
            return dec_layer.self_attn(query=z, key=z, value=z, attn_mask=causal, need_weights=False)[0]

        def cross(z):
            return dec_layer.encoder_attn(query=z, key=mem, value=mem, static_kv=True, need_weights=False)[0]

        y = _sublayer(dec_layer, "self_attn", y, dec_self, pre)
        y = _sublayer(dec_layer, "encoder_attn", y, cross, pre)
        y = _sublayer(dec_layer, "ffn", y, lambda z: _ffn(dec_layer, z), pre)
        torch.testing.assert_close(dec_seen["out"][0], y, rtol=1e-5, atol=1e-5)
        final = model.decoder.layer_norm
        assert (final is not None) == (pre and norm_type != "none")
        want = final(y) if final is not None else y
        torch.testing.assert_close(feats, want.transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert args.encoder_normalize_before == args.decoder_normalize_before == pre
