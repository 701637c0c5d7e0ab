"""Self-tests of the independent ports in ``tests/ports`` (the references the newer methods are tested
against): hand-computed values, closed forms, and torch's own ``nn.MultiheadAttention`` /
``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` as independent implementations of the
shared building blocks. All in float64: tolerances are a few ulps of float64 times the depth of the
computation (1e-12), except where a test says otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from ports import common, depth_mup, diagnostics, dyt, layernorm_scaling, mix_ln, norm_placement, qk_norm, resi_dual
from ports.common import AttnWeights, FFNWeights, NormSpec

F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rms(v: list[float]) -> float:
    return math.sqrt(sum(t * t for t in v) / len(v))


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows[0] if len(rows) == 1 else rows, dtype=F64)


def ln_plain(eps: float = 0.0) -> NormSpec:
    return NormSpec("layer", None, None, eps)


def rms_plain(eps: float = 0.0) -> NormSpec:
    return NormSpec("rms", None, None, eps)


def zero_attention(d: int) -> AttnWeights:
    """Projections with a zero output projection: the block's attention output is exactly 0."""
    eye = torch.eye(d, dtype=F64)
    z = torch.zeros(d, d, dtype=F64)
    return AttnWeights(eye, eye, eye, z, None, None, None, torch.zeros(d, dtype=F64))


def constant_ffn(c: torch.Tensor, d_ff: int = 3) -> FFNWeights:
    """``fc2 = 0`` with bias ``c``: the FFN outputs ``c`` for every input."""
    d = c.numel()
    return FFNWeights(torch.ones(d_ff, d, dtype=F64), torch.zeros(d, d_ff, dtype=F64), None, c.clone())


# ------------------------------------------------------------------------------------------ common


def torch_mha(d: int, heads: int, w: AttnWeights) -> nn.MultiheadAttention:
    m = nn.MultiheadAttention(d, heads, batch_first=True, dtype=F64)
    with torch.no_grad():
        m.in_proj_weight.copy_(torch.cat([w.wq, w.wk, w.wv]))
        m.in_proj_bias.copy_(torch.cat([w.bq, w.bk, w.bv]))
        m.out_proj.weight.copy_(w.wo)
        m.out_proj.bias.copy_(w.bo)
    return m.eval()


def test_attention_matches_torch_multihead_attention_self_cross_causal_padding():
    g = gen(1)
    d, h = 8, 2
    w = AttnWeights.random(d, g)
    x = torch.randn(2, 5, d, generator=g, dtype=F64)
    mem = torch.randn(2, 4, d, generator=g, dtype=F64)
    pad = torch.tensor([[False, False, False, True], [False, False, False, False]])
    m = torch_mha(d, h, w)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    ref_self = m(x, x, x, attn_mask=causal, need_weights=False)[0]
    ref_cross = m(x, mem, mem, key_padding_mask=pad, need_weights=False)[0]
    torch.testing.assert_close(common.attention(x, x, w, h, causal=True), ref_self, **TOL)
    torch.testing.assert_close(common.attention(x, mem, w, h, key_padding_mask=pad), ref_cross, **TOL)


def test_norms_match_closed_forms_and_torch():
    x = t([3.0, 4.0])
    r = math.sqrt(12.5)
    torch.testing.assert_close(common.rms_norm(x, eps=0.0), t([3 / r, 4 / r]), **TOL)
    # LayerNorm of [3, 4]: mean 3.5, biased var 0.25 -> [-1, 1]
    torch.testing.assert_close(common.layer_norm(x, eps=0.0), t([-1.0, 1.0]), **TOL)
    g = gen(2)
    y = torch.randn(3, 7, generator=g, dtype=F64)
    w, b = torch.randn(7, generator=g, dtype=F64), torch.randn(7, generator=g, dtype=F64)
    torch.testing.assert_close(common.layer_norm(y, w, b, 1e-5), nn.functional.layer_norm(y, (7,), w, b, 1e-5), **TOL)
    # the three RMSNorm roundings agree in float64; Gemma's gain is stored as an offset from 1
    for rounding in ("olmo", "olmo2_hf"):
        torch.testing.assert_close(common.rms_norm(y, w, 1e-6, rounding), common.rms_norm(y, w, 1e-6), **TOL)
    torch.testing.assert_close(common.rms_norm(y, w - 1, 1e-6, "gemma3"), common.rms_norm(y, w, 1e-6), **TOL)


# ----------------------------------------------------------------------------------------- QK-Norm


def test_qk_norm_scopes_on_a_hand_vector():
    q = t([[3.0, 4.0, 0.0, 2.0]])[None]
    n = rms_plain()
    qh, _ = qk_norm.normalize_qk(q, q, 2, "head", n, n)
    r0, r1 = math.sqrt(12.5), math.sqrt(2.0)
    torch.testing.assert_close(qh, t([[3 / r0, 4 / r0, 0.0, 2 / r1]])[None], **TOL)
    qp, _ = qk_norm.normalize_qk(q, q, 2, "proj", n, n)
    rp = math.sqrt(29 / 4)
    torch.testing.assert_close(qp, t([[3 / rp, 4 / rp, 0.0, 2 / rp]])[None], **TOL)
    assert qk_norm.norm_size("head", 8, 64) == 64
    assert qk_norm.norm_size("proj", 8, 64) == 512
    assert qk_norm.norm_size("proj", 8, 64, n_kv_heads=2, which="k") == 128


@pytest.mark.parametrize("scope", qk_norm.SCOPES)
def test_qk_norm_logit_bound_is_reached_when_one_head_carries_everything(scope):
    heads, dh = 2, 2
    d = heads * dh
    eye = torch.eye(d, dtype=F64)
    w = AttnWeights(eye, eye, eye, eye)
    x = t([[5.0, 1.0, 0.0, 0.0]])[None]  # one token, all energy in head 0
    n = rms_plain()
    _, logits = qk_norm.qk_norm_attention(x, x, w, heads, scope, n, n, return_logits=True)
    bound = qk_norm.max_logit_bound(scope, heads, dh)
    assert logits[0, 0, 0, 0].item() == pytest.approx(bound, rel=1e-12)
    assert bound == pytest.approx(math.sqrt(dh) if scope == "head" else heads * math.sqrt(dh))
    g = gen(3)
    xr = torch.randn(3, 6, d, generator=g, dtype=F64) * 50
    wr = AttnWeights.random(d, g)
    _, lr = qk_norm.qk_norm_attention(xr, xr, wr, heads, scope, n, n, return_logits=True)
    assert lr.abs().max().item() <= bound * (1 + 1e-12)


def test_rms_qk_norm_after_the_softmax_scale_would_cancel_it():
    # why the plugin must normalise q_proj(x) before fairseq's ``q *= scaling``
    q = torch.randn(4, 16, generator=gen(4), dtype=F64)
    torch.testing.assert_close(common.rms_norm(q * 0.125, eps=0.0), common.rms_norm(q, eps=0.0), **TOL)


def test_released_qk_norm_defaults():
    assert qk_norm.released_norm("qwen3", 64).eps == 1e-6
    assert qk_norm.released_norm("olmo_v1", 512).bias is not None
    init = qk_norm.init_norm("proj", 8, 64)
    assert init.weight.shape == (512,) and bool((init.weight == 1).all()) and init.bias is None


# ---------------------------------------------------------------------------------- norm placement


def test_sublayer_placements_closed_forms():
    x = t([3.0, 4.0])
    c = t([1.0, -1.0])

    def f(v):
        return 2 * v + c

    n = rms_plain()

    def nv(v):
        r = rms(v)
        return [a / r for a in v]

    nx = nv([3.0, 4.0])
    pre = [3 + 2 * nx[0] + 1, 4 + 2 * nx[1] - 1]
    post = nv([3 * 3 + 1, 3 * 4 - 1])
    p = nv([2 * nx[0] + 1, 2 * nx[1] - 1])
    peri = [3 + p[0], 4 + p[1]]
    r = nv([2 * 3 + 1, 2 * 4 - 1])
    reordered = [3 + r[0], 4 + r[1]]
    for placement, want in (("pre", pre), ("post", post), ("peri", peri), ("reordered", reordered)):
        got = norm_placement.sublayer(x, f, placement, n, n)
        torch.testing.assert_close(got, t(want), **TOL)
    assert [norm_placement.has_final_norm(p) for p in norm_placement.PLACEMENTS] == [False, True, True, True]


def test_embedding_norm_sources():
    tok, pos, n = t([1.0, 3.0]), t([1.0, 1.0]), ln_plain()
    torch.testing.assert_close(norm_placement.embed(tok, pos, 2.0, n, "olmo_core"), t([0.0, 2.0]), **TOL)
    torch.testing.assert_close(norm_placement.embed(tok, pos, None, n, "olmo_v1"), t([0.0, 2.0]), **TOL)
    torch.testing.assert_close(norm_placement.embed(tok, pos, 2.0, n, "fairseq"), t([-1.0, 1.0]), **TOL)


def _torch_layer_from(layer: nn.Module, self_w, ffn_w, norms, cross_w=None):
    attns = [(layer.self_attn, self_w)] + ([(layer.multihead_attn, cross_w)] if cross_w is not None else [])
    with torch.no_grad():
        for m, w in attns:
            m.in_proj_weight.copy_(torch.cat([w.wq, w.wk, w.wv]))
            m.in_proj_bias.copy_(torch.cat([w.bq, w.bk, w.bv]))
            m.out_proj.weight.copy_(w.wo)
            m.out_proj.bias.copy_(w.bo)
        layer.linear1.weight.copy_(ffn_w.w1)
        layer.linear1.bias.copy_(ffn_w.b1)
        layer.linear2.weight.copy_(ffn_w.w2)
        layer.linear2.bias.copy_(ffn_w.b2)
        for name, spec in norms.items():
            getattr(layer, name).weight.copy_(spec.weight)
            getattr(layer, name).bias.copy_(spec.bias)
    return layer.eval()


def _random_ln(d, g):
    return NormSpec(
        "layer", 1 + 0.1 * torch.randn(d, generator=g, dtype=F64), 0.1 * torch.randn(d, generator=g, dtype=F64)
    )


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_post_and_pre_layers_match_torch_transformer_layers(placement):
    g = gen(5)
    d, h, dff = 8, 2, 16
    aw, cw, fw = AttnWeights.random(d, g), AttnWeights.random(d, g), FFNWeights.random(d, dff, g)
    n1, n2, n3 = _random_ln(d, g), _random_ln(d, g), _random_ln(d, g)
    role = "out" if placement == "post" else "in"
    x = torch.randn(2, 5, d, generator=g, dtype=F64)
    mem = torch.randn(2, 4, d, generator=g, dtype=F64)
    kw = dict(dropout=0.0, batch_first=True, norm_first=placement == "pre", dtype=F64)
    enc = _torch_layer_from(nn.TransformerEncoderLayer(d, h, dff, **kw), aw, fw, {"norm1": n1, "norm2": n2})
    got = norm_placement.encoder_layer(x, aw, fw, {f"attn.{role}": n1, f"ffn.{role}": n2}, placement, h)
    torch.testing.assert_close(got, enc(x), **TOL)
    dec = _torch_layer_from(
        nn.TransformerDecoderLayer(d, h, dff, **kw), aw, fw, {"norm1": n1, "norm2": n2, "norm3": n3}, cw
    )
    norms = {f"attn.{role}": n1, f"cross.{role}": n2, f"ffn.{role}": n3}
    got = norm_placement.decoder_layer(x, mem, aw, cw, fw, norms, placement, h)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    torch.testing.assert_close(got, dec(x, mem, tgt_mask=causal), **TOL)


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_readers_and_layout_match_fairseq_layers(placement):
    """The readers (``from_module``) and the batch-first port equal fairseq's own layers (time-first)."""
    from fairseq.models.transformer import TransformerConfig
    from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

    cfg = TransformerConfig()
    for side in (cfg.encoder, cfg.decoder):
        side.embed_dim, side.ffn_embed_dim, side.attention_heads = 8, 16, 2
        side.normalize_before = placement == "pre"
    cfg.dropout = 0.0
    torch.manual_seed(0)
    enc = TransformerEncoderLayerBase(cfg).double().eval()
    dec = TransformerDecoderLayerBase(cfg).double().eval()
    g = gen(9)
    with torch.no_grad():  # non-trivial norms so a misplaced one shows
        for m in (enc, dec):
            for name, p in m.named_parameters():
                if "norm" in name:
                    p.copy_(
                        torch.randn(p.shape, generator=g, dtype=F64) * 0.1 + (1.0 if name.endswith("weight") else 0.0)
                    )
    x = torch.randn(2, 5, 8, generator=g, dtype=F64)
    mem = torch.randn(2, 4, 8, generator=g, dtype=F64)
    role = "out" if placement == "post" else "in"
    n = NormSpec.from_module
    enc_norms = {f"attn.{role}": n(enc.self_attn_layer_norm), f"ffn.{role}": n(enc.final_layer_norm)}
    got = norm_placement.encoder_layer(
        x, AttnWeights.from_module(enc.self_attn), FFNWeights.from_module(enc), enc_norms, placement, 2
    )
    with torch.no_grad():
        want = enc(x.transpose(0, 1), None).transpose(0, 1)
    torch.testing.assert_close(got, want, **TOL)
    norms = {f"attn.{role}": n(dec.self_attn_layer_norm), f"cross.{role}": n(dec.encoder_attn_layer_norm),
             f"ffn.{role}": n(dec.final_layer_norm)}  # fmt: skip
    got = norm_placement.decoder_layer(
        x, mem, AttnWeights.from_module(dec.self_attn), AttnWeights.from_module(dec.encoder_attn),
        FFNWeights.from_module(dec), norms, placement, 2)  # fmt: skip
    future = torch.full((5, 5), float("-inf"), dtype=F64).triu(1)
    with torch.no_grad():
        want = dec(x.transpose(0, 1), mem.transpose(0, 1), None, self_attn_mask=future)[0].transpose(0, 1)
    # fairseq's explicit attention path (cross-attention: static_kv) computes the softmax in float32 even for
    # float64 inputs (fairseq/utils.py:518): probabilities carry a relative error up to 2**-24 = 6e-8, which
    # the following projections, norms and sub-layers (weights and activations of O(1-10)) amplify to < 1e-6
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_hybridnorm_block_on_a_single_token():
    # one token: attention returns v_norm(v) per head through identity projections
    eye = torch.eye(4, dtype=F64)
    w = AttnWeights(eye, eye, eye, eye)
    x = t([[3.0, 4.0, 0.0, 2.0]])[None]
    n = rms_plain()
    zero_ffn = constant_ffn(t([0.0, 0.0, 0.0, 0.0]))
    r0, r1 = math.sqrt(12.5), math.sqrt(2.0)
    y = [3 + 3 / r0, 4 + 4 / r0, 0.0, 2 + 2 / r1]
    want = [v / rms(y) for v in y]
    cfg = norm_placement.hybridnorm_layer_config(1)
    got = norm_placement.olmo_sequential_block(x, w, zero_ffn, cfg, 2, None, n, n, n, n)
    torch.testing.assert_close(got, t([want])[None], **TOL)
    # HybridNorm*: layer 0 is pre-norm with a pre-norm FFN whose residual is the un-normalised stream
    assert norm_placement.hybridnorm_layer_config(0, star=True) == {
        "attn_norm": True, "attn_residual": False, "ffn_norm": True, "ffn_residual": False,
    }  # fmt: skip
    c = t([1.0, 0.0, -1.0, 0.5])
    got = norm_placement.olmo_sequential_block(x, zero_attention(4), constant_ffn(c), {**cfg, **{"attn_norm": True,
        "ffn_residual": False}}, 2, n, n)  # fmt: skip
    torch.testing.assert_close(got, x + c, **TOL)
    assert norm_placement.hybridnorm_init_std("qkv", 2048, 16) == pytest.approx(0.013975424859373685, rel=1e-15)
    assert norm_placement.hybridnorm_init_std("ff_out", 2048, 16) == pytest.approx(0.013975424859373685 / math.sqrt(32))


# ------------------------------------------------------------------------------- LayerNorm Scaling


def test_lns_factors_and_init():
    assert [layernorm_scaling.lns_factor(i) for i in range(3)] == pytest.approx([1.0, 2**-0.5, 3**-0.5], rel=1e-15)
    half = layernorm_scaling.lns_factor_as_olmo_core(4, torch.float16).item()
    assert half == pytest.approx(1 / math.sqrt(5), rel=2**-11)
    assert layernorm_scaling.init_std("o", 12) == 0.02
    assert layernorm_scaling.init_std("o", 12, scaled_init=True) == pytest.approx(0.02 / math.sqrt(24))
    assert layernorm_scaling.init_std("q", 12, scaled_init=True) == 0.02


def test_lns_layer_is_pre_ln_with_gains_times_the_factor():
    # RMS/Layer norm outputs are linear in (weight, bias): s * N_w,b(x) = N_{s w, s b}(x)
    g = gen(6)
    d, h = 8, 2
    aw, fw = AttnWeights.random(d, g), FFNWeights.random(d, 16, g)
    n1, n2 = _random_ln(d, g), _random_ln(d, g)
    x = torch.randn(2, 5, d, generator=g, dtype=F64)
    for i in (0, 3):
        s = layernorm_scaling.lns_factor(i)
        got = layernorm_scaling.encoder_layer(x, aw, fw, n1, n2, h, i)
        scaled = {
            "attn.in": NormSpec("layer", n1.weight * s, n1.bias * s),
            "ffn.in": NormSpec("layer", n2.weight * s, n2.bias * s),
        }
        torch.testing.assert_close(got, norm_placement.encoder_layer(x, aw, fw, scaled, "pre", h), **TOL)


def test_lns_final_norm_is_unscaled():
    d = 4
    layers = [{"attn_w": zero_attention(d), "ffn_w": constant_ffn(torch.zeros(d, dtype=F64)), "norm_attn": ln_plain(),
               "norm_ffn": ln_plain()} for _ in range(3)]  # fmt: skip
    x = t([[1.0, 2.0, 3.0, 6.0]])[None]
    torch.testing.assert_close(layernorm_scaling.lm_stack(x, layers, 2, ln_plain()), ln_plain()(x), **TOL)


# ------------------------------------------------------------------------------------------ Mix-LN


def test_mixln_post_layer_count():
    assert [mix_ln.num_post_layers(n) for n in (12, 24, 6, 18, 48)] == [3, 6, 1, 4, 12]
    assert [mix_ln.num_post_layers(n, rounding="round") for n in (6, 18)] == [2, 4]
    assert mix_ln.layer_kinds(4, 1) == ["post", "pre", "pre", "pre"]
    assert mix_ln.EMBEDDING_INIT_STD_MIXLN == pytest.approx(0.6324555320336759)


def test_mixln_stack_is_post_then_pre_with_a_final_norm():
    g = gen(7)
    d, h = 8, 2
    layers = [{"attn_w": AttnWeights.random(d, g), "ffn_w": FFNWeights.random(d, 16, g), "norm_attn": _random_ln(d, g),
               "norm_ffn": _random_ln(d, g)} for _ in range(4)]  # fmt: skip
    fin = _random_ln(d, g)
    x = torch.randn(2, 5, d, generator=g, dtype=F64)
    for k in (0, 1, 4):
        want = x
        for i, p in enumerate(layers):
            placement = "post" if i < k else "pre"
            role = "out" if i < k else "in"
            norms = {f"attn.{role}": p["norm_attn"], f"ffn.{role}": p["norm_ffn"]}
            want = norm_placement.decoder_layer(want, None, p["attn_w"], None, p["ffn_w"], norms, placement, h)
        torch.testing.assert_close(mix_ln.lm_stack(x, layers, k, h, fin), fin(want), **TOL)
    # the translation layer's two kinds are the post/pre placements with cross-attention
    mem = torch.randn(2, 3, d, generator=g, dtype=F64)
    cw = AttnWeights.random(d, g)
    p = layers[0]
    norms = {"attn": p["norm_attn"], "cross": fin, "ffn": p["norm_ffn"]}
    for kind, role in (("post", "out"), ("pre", "in")):
        got = mix_ln.translation_layer(x, kind, mem, p["attn_w"], cw, p["ffn_w"], norms, h, causal=True)
        want = norm_placement.decoder_layer(x, mem, p["attn_w"], cw, p["ffn_w"], {f"attn.{role}": p["norm_attn"],
            f"cross.{role}": fin, f"ffn.{role}": p["norm_ffn"]}, kind, h)  # fmt: skip
        torch.testing.assert_close(got, want, **TOL)


# ---------------------------------------------------------------------------------------- ResiDual


@pytest.mark.parametrize("scale", [1.0, resi_dual.OPUS_RES_SCALE])
def test_residual_hand_case(scale):
    # attention outputs 0, FFN outputs c: x1 = LN(x0), x2 = LN(x1 + c), res = s (x0 + c)
    # x0 = [1, 3] -> LN [-1, 1]; x1 + c = [1, -1] -> LN [1, -1]; res ~ [3, 1] -> LN [1, -1]; out [2, -2]
    x0, c = t([[1.0, 3.0]])[None], t([2.0, -2.0])
    lay = {"attn_w": zero_attention(2), "ffn_w": constant_ffn(c), "ln_attn": ln_plain(), "ln_ffn": ln_plain()}
    out = resi_dual.encoder(x0, [lay], ln_plain(), 2, scale)
    torch.testing.assert_close(out, t([[2.0, -2.0]])[None], **TOL)
    dlay = {"self_w": zero_attention(2), "cross_w": zero_attention(2), "ffn_w": constant_ffn(c), "ln_self": ln_plain(),
            "ln_cross": ln_plain(), "ln_ffn": ln_plain()}  # fmt: skip
    out = resi_dual.decoder(x0, torch.zeros(1, 3, 2, dtype=F64), [dlay], ln_plain(), 2, scale)
    # the cross-attention adds 0 and re-normalises an already normalised stream: same result
    torch.testing.assert_close(out, t([[2.0, -2.0]])[None], **TOL)


def test_residual_scale_only_rescales_the_final_norm_eps():
    # LN_eps(s * d) = LN_{eps / s^2}(d) exactly, so s = 0.05 equals s = 1 with eps 1e-7 / 0.05^2
    g = gen(8)
    d, h = 8, 2
    layers = [{"attn_w": AttnWeights.random(d, g), "ffn_w": FFNWeights.random(d, 16, g), "ln_attn": _random_ln(d, g),
               "ln_ffn": _random_ln(d, g)} for _ in range(3)]  # fmt: skip
    x0 = torch.randn(2, 5, d, generator=g, dtype=F64)
    w, b = 1 + 0.1 * torch.randn(d, generator=g, dtype=F64), 0.1 * torch.randn(d, generator=g, dtype=F64)
    s = resi_dual.OPUS_RES_SCALE
    got = resi_dual.encoder(x0, layers, resi_dual.final_layer_norm(w, b), h, scale=s)
    want = resi_dual.encoder(x0, layers, NormSpec("layer", w, b, resi_dual.FINAL_LN_EPS / s**2), h, scale=1.0)
    torch.testing.assert_close(got, want, **TOL)


# ------------------------------------------------------------------------------------------- DyT


def test_dyt_and_derf_hand_values():
    x = t([2.0])
    assert dyt.dyt(x, 0.5).item() == pytest.approx(math.tanh(1.0), rel=1e-15)
    assert dyt.dyt(x, 0.5, t([2.0]), t([1.0])).item() == pytest.approx(2 * math.tanh(1.0) + 1, rel=1e-15)
    assert dyt.dyt_llama(x, 0.2, t([3.0])).item() == pytest.approx(3 * math.tanh(0.4), rel=1e-15)
    assert dyt.derf(t([1.0]), 0.5, 0.5).item() == pytest.approx(math.erf(1.0), rel=1e-15)
    assert dyt.derf(t([1.0]), 0.5, 0.5, t([2.0]), t([-1.0])).item() == pytest.approx(2 * math.erf(1.0) - 1, rel=1e-15)
    p = dyt.init_params("derf", 3)
    assert p["alpha"].item() == 0.5 and p["shift"].item() == 0.0 and p["bias"].abs().sum() == 0
    assert "bias" not in dyt.init_params("dyt_llama", 3) and dyt.init_params("dyt_llama", 3)["alpha"].item() == 1.0
    assert [dyt.alpha_init_for(pos, "llama2_7b") for pos in ("attn", "ffn", "dec")] == [0.8, 0.2, 0.2]
    assert dyt.embedding_scale_init(64) == 8.0
    torch.testing.assert_close(dyt.embed_gpt2(t([1.0]), t([2.0]), 8.0), t([24.0]), **TOL)


# ------------------------------------------------------------------------------------- depth-muP


def test_depth_mup_constants_at_48_over_6_layers():
    assert depth_mup.branch_multiplier(48, 6, 1.0) == pytest.approx(1 / 8)
    assert depth_mup.branch_multiplier(48, 6, 0.5) == pytest.approx(8**-0.5)
    p1 = depth_mup.group_scales(48, 6, 1.0, "paper")
    assert p1["hidden_weight"]["lr"] == 1.0 and p1["hidden_weight"]["eps"] == pytest.approx(1 / 8)
    assert p1["embedding"] == {"lr": 1.0, "eps": 1.0, "weight_decay": 1.0}
    ph = depth_mup.group_scales(48, 6, 0.5, "paper")
    for grp in ("hidden_weight", "hidden_bias", "hidden_norm"):
        assert ph[grp]["lr"] == pytest.approx(8**-0.5) and ph[grp]["eps"] == pytest.approx(8**-0.5)
    assert ph["final_norm"]["lr"] == 1.0 and ph["output"]["eps"] == 1.0
    nano = depth_mup.group_scales(48, 6, 1.0, "nanogpt")
    assert nano["embedding"]["eps"] == pytest.approx(1 / 8) and nano["hidden_norm"]["weight_decay"] == 0.0
    meg = depth_mup.group_scales(48, 6, 1.0, "megatron")
    assert meg["hidden_weight"] == {"lr": 1.0, "eps": pytest.approx(1 / 8), "weight_decay": 1.0}
    assert meg["hidden_bias"]["eps"] == 1.0 and meg["hidden_norm"]["lr"] == 1.0
    with pytest.raises(ValueError):
        depth_mup.group_scales(48, 6, 0.5, "megatron")
    # Table 1 defines alpha in {0.5, 1} (nanoGPT-mup: [0.5, 1]); at the base depth every factor is 1
    with pytest.raises(ValueError):
        depth_mup.group_scales(48, 6, 0.0)
    assert all(v == {"lr": 1.0, "eps": 1.0, "weight_decay": 1.0} for v in depth_mup.group_scales(6, 6, 0.5).values())
    assert depth_mup.block_out_init_std(0.02, 48, 6, "megatron") == pytest.approx(0.02 / math.sqrt(12))
    assert depth_mup.block_out_init_std(0.02, 48, 6, "paper") == 0.02
    assert depth_mup.stack_multipliers(18, 12, 6, 6, 1.0) == pytest.approx((1 / 3, 1 / 2))


# ----------------------------------------------------------------------------------- diagnostics


def test_angular_distance_hand_values():
    a = t([1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 0.0])
    b = t([0.0, 1.0], [2.0, 0.0], [-1.0, 0.0], [1.0, 0.0])
    got = diagnostics.angular_distance(a, b)
    torch.testing.assert_close(got, t(0.5, 0.0, 1.0, 1 / 3), rtol=0, atol=1e-15)
    torch.testing.assert_close(diagnostics.block_influence(a, b), t(1.0, 0.0, 2.0, 0.5), **TOL)
    # last token only, mean (LayerNorm-Scaling) or sum (MixLN) over the batch
    h0 = t([[9.0, 9.0], [1.0, 0.0]], [[9.0, 9.0], [0.0, 1.0]])
    h1 = t([[0.0, 0.0], [0.0, 1.0]], [[0.0, 0.0], [0.0, 1.0]])
    assert diagnostics.layer_distances([h0, h1]) == pytest.approx([0.25])
    assert diagnostics.layer_distances([h0, h1], reduce="sum") == pytest.approx([0.5])


def test_max_attention_logit_hand_case():
    eye = torch.eye(2, dtype=F64)
    w = AttnWeights(eye, eye, eye, eye)
    q = t([[1.0, 0.0]])[None]
    kv = t([[2.0, 0.0], [0.0, 3.0]])[None]
    _, logits = common.attention(q, kv, w, 1, return_logits=True)
    assert diagnostics.max_attention_logit(logits).tolist() == pytest.approx([math.sqrt(2)])
    _, masked = common.attention(q, kv, w, 1, key_padding_mask=torch.tensor([[True, False]]), return_logits=True)
    assert diagnostics.max_attention_logit(masked).tolist() == [0.0]
    _, neg = common.attention(-q, kv, w, 1, key_padding_mask=torch.tensor([[False, True]]), return_logits=True)
    assert diagnostics.megatron_log_max([diagnostics.max_attention_logit(neg)]) == 0.0
    assert diagnostics.megatron_log_max([t(0.5, 2.0), t(1.5)]) == 2.0


def test_residual_stream_statistics_and_layer_removal():
    h = t([[3.0, 4.0], [0.0, 1.0]])[None]
    assert diagnostics.residual_norms([h]) == pytest.approx([3.0])
    assert diagnostics.residual_norms([h], torch.tensor([[False, True]])) == pytest.approx([5.0])
    s = diagnostics.gap_activation_stats(t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]))
    assert s == pytest.approx({"max": 6.0, "mean": 3.5, "var": 1.0})
    layers = [lambda v, k=k: v + k for k in (1.0, 10.0, 100.0)]
    x = t([0.5])
    assert diagnostics.forward_without_layer(x, layers, None, lambda v: v).item() == 111.5
    assert diagnostics.forward_without_layer(x, layers, 1, lambda v: 2 * v).item() == 203.0
