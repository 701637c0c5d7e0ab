"""Self-tests of the ports of the 2025-26 methods in ``tests/ports`` (hyper-connections, mHC, gated attention,
attention sinks, value residual, z-loss, QK-Clip): hand-computed values, closed forms, and second,
independent formulations of the same rule (the paper's matrix form of hyper-connections, log-domain
Sinkhorn, the release's fused query/gate projection, sinks through ``F.scaled_dot_product_attention``,
token-by-token decoding with a cache). Float64; tolerances are a few float64 ulps times the depth of the
computation (1e-12), except where a test says otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from ports import attention_sinks, common, gated_attention, hyper_connections, mhc, qk_clip, value_residual, z_loss
from ports.common import AttnWeights, FFNWeights, NormSpec

F64 = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=F64)


def pre_ln_ffn(d: int, g: torch.Generator):
    w = FFNWeights.random(d, 2 * d, g)
    ln = NormSpec("layer", None, None, 1e-5)
    return lambda x: common.ffn(ln(x), w)


# ------------------------------------------------------------------------------- hyper-connections


def test_hc_expansion_1_identity_init_is_the_plain_residual():
    g = gen(1)
    x = randn(2, 3, 4, g=g)
    branch = pre_ln_ffn(4, g)
    for dynamic in (False, True):
        p = hyper_connections.init_params(1, 4, layer_index=5, dynamic=dynamic)
        h = hyper_connections.expand(x, 1)
        out = hyper_connections.reduce(hyper_connections.sublayer(h, branch, p))
        torch.testing.assert_close(out, x + branch(x), **TOL)


def test_hc_init_reads_stream_k_mod_n_and_adds_the_branch_to_every_stream():
    g = gen(2)
    n, d = 3, 4
    h = randn(2, 5, n, d, g=g)  # distinct streams
    branch = pre_ln_ffn(d, g)
    p = hyper_connections.init_params(n, d, layer_index=4)  # 4 % 3 = stream 1
    out = hyper_connections.sublayer(h, branch, p)
    torch.testing.assert_close(out, h + branch(h[..., 1, :]).unsqueeze(-2), **TOL)


def test_hc_hand_computed_two_streams():
    # alpha = [[a_m0, r00, r01], [a_m1, r10, r11]], beta = [b0, b1]; F(x) = 2x (a linear branch)
    p = hyper_connections.HCParams(torch.tensor([[0.5, 1.0, 2.0], [0.25, 0.0, 1.0]], dtype=F64),
                                   torch.tensor([1.0, 3.0], dtype=F64))  # fmt: skip
    h = torch.tensor([[[[1.0, 2.0], [4.0, 8.0]]]], dtype=F64)  # streams h0 = (1, 2), h1 = (4, 8)
    out = hyper_connections.sublayer(h, lambda x: 2 * x, p)
    x = 0.5 * torch.tensor([1.0, 2.0]) + 0.25 * torch.tensor([4.0, 8.0])  # (1.5, 3)
    r0 = 1.0 * torch.tensor([1.0, 2.0]) + 0.0 * torch.tensor([4.0, 8.0])
    r1 = 2.0 * torch.tensor([1.0, 2.0]) + 1.0 * torch.tensor([4.0, 8.0])
    want = torch.stack([r0 + 1.0 * 2 * x, r1 + 3.0 * 2 * x]).to(F64).view(1, 1, 2, 2)
    torch.testing.assert_close(out, want, **TOL)


def test_hc_dynamic_equals_the_papers_matrix_form():
    g = gen(3)
    n, d = 4, 6
    h = randn(2, 3, n, d, g=g)
    branch = pre_ln_ffn(d, g)
    p = hyper_connections.init_params(n, d, layer_index=2)
    p.w_alpha, p.w_beta = randn(d, 1 + n, g=g), randn(d, g=g)
    p.s_alpha, p.s_beta, p.gamma = 0.3, 0.2, randn(d, g=g) * 0.1
    alpha, beta = hyper_connections.mixing(h, p)
    # the dynamic terms by hand: tanh(RMSNorm(h) W) * s, per stream
    hbar = h / h.pow(2).mean(-1, keepdim=True).sqrt() * (p.gamma + 1)
    torch.testing.assert_close(alpha, p.static_alpha + 0.3 * torch.tanh(hbar @ p.w_alpha), **TOL)
    torch.testing.assert_close(beta, p.static_beta + 0.2 * torch.tanh(hbar @ p.w_beta), **TOL)
    want = hyper_connections.paper_matrix_form(h, branch, alpha[..., 0], alpha[..., 1:], beta)
    torch.testing.assert_close(hyper_connections.sublayer(h, branch, p), want, **TOL)


def test_hc_reduce_sums_and_expand_adds_the_stream_embedding():
    x = torch.arange(6, dtype=F64).view(1, 2, 3)
    emb = torch.tensor([[1.0, 0, 0], [0, 0, 2.0]], dtype=F64)
    h = hyper_connections.expand(x, 2, emb)
    torch.testing.assert_close(h[0, 1], torch.tensor([[4.0, 4, 5], [3, 4, 7]], dtype=F64), **TOL)
    torch.testing.assert_close(hyper_connections.reduce(h), 2 * x + emb.sum(0), **TOL)


# --------------------------------------------------------------------------------------------- mHC


def test_sinkhorn_rows_and_columns_sum_to_one():
    g = gen(4)
    logits = randn(3, 5, 4, 4, g=g) * 2
    for fn, last in ((mhc.sinkhorn_megatron, -2), (mhc.sinkhorn_deepseek_v4, -2), (mhc.sinkhorn_lucidrains, -1)):
        m = fn(logits, iters=20) if fn is not mhc.sinkhorn_deepseek_v4 else fn(logits, 20, eps=0.0)
        assert bool((m > 0).all())
        # the axis normalised last is exact; the other only converges: after the released 20 steps it is
        # still off by up to 2e-3 for these logits (std 2, 4x4), the drift the diagnostics log
        torch.testing.assert_close(m.sum(last), torch.ones_like(m.sum(last)), **TOL)
        other = -1 if last == -2 else -2
        drift = float((m.sum(other) - 1).abs().max())
        assert 1e-6 < drift < 5e-3
        converged = fn(logits, 300) if fn is not mhc.sinkhorn_deepseek_v4 else fn(logits, 300, eps=0.0)
        torch.testing.assert_close(converged.sum(other), torch.ones_like(m.sum(other)), rtol=0, atol=1e-12)


def test_sinkhorn_variants_reach_the_same_doubly_stochastic_matrix():
    g = gen(5)
    logits = randn(2, 4, 4, g=g)
    ref = mhc.sinkhorn_log_domain(logits, 400)  # log-domain, an independent formulation
    for got in (mhc.sinkhorn_megatron(logits, 400, eps=0.0), mhc.sinkhorn_deepseek_v4(logits, 400, eps=0.0),
                mhc.sinkhorn_lucidrains(logits, 400)):  # fmt: skip
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_sinkhorn_fixed_point_and_row_shift_invariance():
    # a doubly stochastic P with positive entries is its own projection from log P
    P = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.3, 0.2, 0.5]], dtype=F64)
    torch.testing.assert_close(mhc.sinkhorn_megatron(P.log(), 1), P, **TOL)
    torch.testing.assert_close(mhc.sinkhorn_deepseek_v4(P.log(), 1, eps=0.0), P, **TOL)
    # Megatron subtracts the row max: any row constant leaves the result unchanged (hyper_connection.py:101-108)
    logits = randn(3, 3, g=gen(6))
    shifted = logits + torch.tensor([[100.0], [-50.0], [3.0]], dtype=F64)
    torch.testing.assert_close(mhc.sinkhorn_megatron(shifted), mhc.sinkhorn_megatron(logits), **TOL)


def test_mhc_one_stream_with_open_pre_gate_is_the_plain_residual():
    g = gen(7)
    x = randn(2, 3, 4, g=g)
    branch = pre_ln_ffn(4, g)
    p = mhc.MHCParams(randn(3, 4, g=g), 0.0, 0.0, 0.0, torch.tensor([math.inf, 0.0, 0.0], dtype=F64))
    h_pre, h_post, h_res = mhc.mappings_megatron(mhc.expand(x, 1), p)
    torch.testing.assert_close(h_res, torch.ones_like(h_res), **TOL)  # Sinkhorn of a 1x1 matrix
    torch.testing.assert_close(h_post, torch.ones_like(h_post), **TOL)  # 2 sigmoid(0)
    out = mhc.contract_mean(mhc.sublayer(mhc.expand(x, 1), branch, h_pre, h_post, h_res))
    torch.testing.assert_close(out, x + branch(x), **TOL)


def test_mhc_megatron_init_closed_form():
    # bias 0, alpha -> 0: H_pre = 1/2, H_post = 1, H_res = J / n (Sinkhorn of the all-ones matrix)
    g = gen(8)
    n, c = 4, 3
    p = mhc.init_megatron(n, c, g)
    p.alpha_pre = p.alpha_post = p.alpha_res = 0.0
    x = randn(2, 5, n, c, g=g)
    h_pre, h_post, h_res = mhc.mappings_megatron(x, p)
    torch.testing.assert_close(h_pre, torch.full_like(h_pre, 0.5), **TOL)
    torch.testing.assert_close(h_post, torch.ones_like(h_post), **TOL)
    torch.testing.assert_close(h_res, torch.full_like(h_res, 1 / n), **TOL)
    branch = pre_ln_ffn(c, g)
    out = mhc.sublayer(x, branch, h_pre, h_post, h_res)
    want = x.mean(-2, keepdim=True) + branch(0.5 * x.sum(-2)).unsqueeze(-2)
    torch.testing.assert_close(out, want.expand_as(out), **TOL)


def test_hc_and_mhc_at_init_are_the_pre_ln_stack():
    # n copies in; HC at init adds F(x) to every stream (beta 1, A_r = I), mHC at Megatron's init (alpha -> 0,
    # b = 0) averages the identical streams and feeds F(n/2 x) = F(x) (a LayerNorm with eps 0 is scale
    # invariant); the final norm removes HC's factor n from the sum. Both are then the Pre-LN stack.
    g = gen(28)
    n, d = 4, 6
    ln0 = NormSpec("layer", None, None, 0.0)
    branches = [(lambda w: lambda x: common.ffn(ln0(x), w))(FFNWeights.random(d, 2 * d, g)) for _ in range(3)]
    x = randn(2, 3, d, g=g)
    plain = x
    for f in branches:
        plain = plain + f(plain)
    h = hyper_connections.expand(x, n)
    m = mhc.expand(x, n)
    for i, f in enumerate(branches):
        h = hyper_connections.sublayer(h, f, hyper_connections.init_params(n, d, layer_index=i))
        p = mhc.init_megatron(n, d, g)
        p.alpha_pre = p.alpha_post = p.alpha_res = 0.0
        m = mhc.sublayer(m, f, *mhc.mappings_megatron(m, p))
    torch.testing.assert_close(ln0(hyper_connections.reduce(h)), ln0(plain), **TOL)
    torch.testing.assert_close(mhc.contract_mean(m), plain, **TOL)


def test_mhc_megatron_mappings_equal_the_papers_order():
    g = gen(9)
    n, c = 3, 5
    p = mhc.init_megatron(n, c, g)
    p.alpha_pre, p.alpha_post, p.alpha_res = 0.7, 0.4, 1.3
    p.bias = randn(n * n + 2 * n, g=g)
    x = randn(2, 4, n, c, g=g)
    got = mhc.mappings_megatron(x, p, iters=400, eps=0.0)
    for a, b in zip(got, mhc.mappings_paper(x, p, iters=400), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_deepseek_v4_mappings_hand_computed_and_equal_to_megatrons_without_eps():
    n, c = 3, 2
    x = randn(2, 2, n, c, g=gen(26))
    zero_fn, base = torch.zeros((2 + n) * n, n * c, dtype=F64), torch.zeros((2 + n) * n, dtype=F64)
    base[0], base[n] = math.log(3.0), -math.log(3.0)
    pre, post, comb = mhc.mappings_deepseek_v4(x, zero_fn, base, torch.ones(3, dtype=F64))
    torch.testing.assert_close(pre[..., 0], torch.full((2, 2), 0.75 + 1e-6, dtype=F64), **TOL)  # sigmoid(log 3) + eps
    torch.testing.assert_close(pre[..., 1], torch.full((2, 2), 0.5 + 1e-6, dtype=F64), **TOL)
    torch.testing.assert_close(post[..., 0], torch.full((2, 2), 0.5, dtype=F64), **TOL)  # 2 sigmoid(-log 3), no eps
    torch.testing.assert_close(post[..., 1], torch.ones(2, 2, dtype=F64), **TOL)
    torch.testing.assert_close(comb, torch.full_like(comb, 1 / n), rtol=0, atol=1e-5)
    # with every eps 0, V4's mappings are Megatron's (fn = phi, base = b, scale = the three alphas) at the same
    # iteration count: V4's row softmax is Megatron's exp followed by its first row normalisation
    g = gen(27)
    fn, base, scale = randn((2 + n) * n, n * c, g=g), randn((2 + n) * n, g=g), torch.tensor([0.7, 0.4, 1.3], dtype=F64)
    v4 = mhc.mappings_deepseek_v4(x, fn, base, scale, iters=20, eps=0.0, rms_eps=0.0)
    mg = mhc.mappings_megatron(x, mhc.MHCParams(fn, 0.7, 0.4, 1.3, base), iters=20, eps=0.0)
    for a, b in zip(v4, mg, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_deepseek_v4_comb_is_used_transposed():
    g = gen(10)
    n, c = 4, 3
    x = randn(1, 2, n, c, g=g)
    fn, base = randn((2 + n) * n, n * c, g=g) * 0.1, randn((2 + n) * n, g=g)
    scale = torch.tensor([1.0, 0.5, 2.0], dtype=F64)
    pre, post, comb = mhc.mappings_deepseek_v4(x, fn, base, scale)
    branch = pre_ln_ffn(c, g)
    out = mhc.sublayer(x, branch, pre, post, comb.transpose(-1, -2))
    # DeepseekV4DecoderLayer, written with the sum over the first comb axis: out_k = sum_j comb[j, k] x_j + ...
    y = branch((pre.unsqueeze(-1) * x).sum(-2))
    want = torch.einsum("btjk,btjc->btkc", comb, x) + post.unsqueeze(-1) * y.unsqueeze(-2)
    torch.testing.assert_close(out, want, **TOL)
    # V4 ends on a column step: comb^T's rows are convex weights (each output stream a weighted mean of the
    # inputs) up to the eps in the denominators, 1 - O(1e-6)
    torch.testing.assert_close(comb.transpose(-1, -2).sum(-1), torch.ones(1, 2, n, dtype=F64), rtol=0, atol=1e-5)


def test_hyper_head_v4_hand_computed_and_mean_contract():
    x = torch.tensor([[[[1.0, 2.0], [3.0, 6.0]]]], dtype=F64)  # two streams
    fn = torch.zeros(2, 4, dtype=F64)
    base = torch.tensor([0.0, math.inf], dtype=F64)
    got = mhc.hyper_head_v4(x, fn, base, torch.tensor(1.0, dtype=F64), eps=0.0)
    torch.testing.assert_close(got, torch.tensor([[[0.5 * 1 + 3.0, 0.5 * 2 + 6.0]]], dtype=F64), **TOL)
    torch.testing.assert_close(mhc.contract_mean(x), torch.tensor([[[2.0, 4.0]]], dtype=F64), **TOL)


def test_h_res_diagnostics():
    P = torch.tensor([[0.5, 0.5, 0.0], [0.25, 0.25, 0.5], [0.25, 0.25, 0.5]], dtype=F64)  # doubly stochastic
    d = mhc.h_res_diagnostics(P.expand(2, 3, 3))
    assert abs(float(d["spectral_norm_max"]) - 1.0) < 1e-12
    assert float(d["row_sum_drift"]) < 1e-15 and float(d["col_sum_drift"]) < 1e-15
    Q = P.clone()
    Q[0, 0] += 0.1
    d = mhc.h_res_diagnostics(Q)
    assert abs(float(d["row_sum_drift"]) - 0.1) < 1e-12 and float(d["spectral_norm_max"]) > 1.0


# --------------------------------------------------------------------------------- gated attention


def gate_case(seed: int, kind: str, heads: int = 2, d: int = 8):
    """Attention weights, a decoder-side ``x`` (5 positions), an encoder output ``mem`` (3) and a gate ``(wg, bg)``."""
    g = gen(seed)
    w = AttnWeights.random(d, g)
    x, mem = randn(2, 5, d, g=g), randn(2, 3, d, g=g)
    width = gated_attention.gate_width(kind, heads, d // heads)
    return w, x, mem, randn(width, d, g=g), randn(width, g=g)


@pytest.mark.parametrize("kind", gated_attention.KINDS)
def test_gate_bias_plus_inf_is_plain_attention_and_minus_inf_leaves_the_output_bias(kind):
    heads = 2
    w, x, mem, wg, _ = gate_case(11, kind, heads)
    width = wg.shape[0]
    for x_kv, causal in ((x, True), (mem, False)):
        plain = common.attention(x, x_kv, w, heads, causal=causal)
        open_ = gated_attention.gated_attention(x, x_kv, w, heads, wg, torch.full((width,), math.inf, dtype=F64),
                                                causal=causal)  # fmt: skip
        shut = gated_attention.gated_attention(x, x_kv, w, heads, wg, torch.full((width,), -math.inf, dtype=F64),
                                               causal=causal)  # fmt: skip
        torch.testing.assert_close(open_, plain, **TOL)
        torch.testing.assert_close(shut, w.bo.expand_as(shut), **TOL)


def test_gate_placement_hand_computed_one_head():
    # one head, identity projections: ctx = softmax(q k^T / sqrt 2) v, then * sigmoid(g), then W_o
    eye = torch.eye(2, dtype=F64)
    w = AttnWeights(eye, eye, eye, 2 * eye)
    x = torch.tensor([[[1.0, 0.0]]], dtype=F64)
    kv = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], dtype=F64)
    wg = torch.tensor([[0.0, 0.0]], dtype=F64)
    got = gated_attention.gated_attention(x, kv, w, 1, wg, torch.tensor([math.log(3.0)], dtype=F64))
    a = math.exp(1 / math.sqrt(2))
    ctx = torch.tensor([a, 1.0], dtype=F64) / (a + 1)
    torch.testing.assert_close(got, (2 * 0.75 * ctx).view(1, 1, 2), **TOL)  # sigmoid(log 3) = 3/4


def test_gate_elementwise_constant_over_head_dim_equals_headwise():
    g = gen(12)
    d, heads = 6, 3
    w = AttnWeights.random(d, g)
    x = randn(2, 4, d, g=g)
    wg_h, bg_h = randn(heads, d, g=g), randn(heads, g=g)
    dh = d // heads
    wg_e, bg_e = wg_h.repeat_interleave(dh, 0), bg_h.repeat_interleave(dh, 0)
    elementwise = gated_attention.gated_attention(x, x, w, heads, wg_e, bg_e, causal=True)
    torch.testing.assert_close(
        elementwise, gated_attention.gated_attention(x, x, w, heads, wg_h, bg_h, causal=True), **TOL
    )


@pytest.mark.parametrize("kind", gated_attention.KINDS)
def test_released_fused_q_proj_equals_a_separate_gate_projection(kind):
    heads = 2
    w, x, mem, wg, bg = gate_case(13, kind, heads)
    wf, bf = gated_attention.fused_q_proj(w.wq, w.bq, wg, bg, heads, kind)
    assert wf.shape[0] == w.wq.shape[0] + wg.shape[0]
    for x_kv, causal in ((x, True), (mem, False)):
        released = gated_attention.released_gated_attention(x, x_kv, wf, bf, w, heads, kind, causal=causal)
        ours = gated_attention.gated_attention(x, x_kv, w, heads, wg, bg, causal=causal)
        torch.testing.assert_close(released, ours, **TOL)


def test_gate_after_torch_sdpa():
    # an independent attention (torch's fused kernel, math path on CPU) with the gate applied to its output
    g = gen(14)
    d, heads = 8, 4
    dh = d // heads
    w = AttnWeights.random(d, g)
    x = randn(2, 5, d, g=g)
    wg, bg = randn(heads, d, g=g), randn(heads, g=g)
    q, k, v = (common.linear(x, a, b).view(2, 5, heads, dh).transpose(1, 2) for a, b in ((w.wq, w.bq), (w.wk, w.bk),
                                                                                      (w.wv, w.bv)))  # fmt: skip
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o = o * torch.sigmoid(common.linear(x, wg, bg)).transpose(1, 2).unsqueeze(-1)
    want = common.linear(o.transpose(1, 2).reshape(2, 5, d), w.wo, w.bo)
    torch.testing.assert_close(gated_attention.gated_attention(x, x, w, heads, wg, bg, causal=True), want, **TOL)


# ---------------------------------------------------------------------------------- attention sinks


def test_sink_minus_inf_is_plain_attention():
    g = gen(15)
    d, heads = 8, 2
    w = AttnWeights.random(d, g)
    x, mem = randn(2, 4, d, g=g), randn(2, 3, d, g=g)
    pad = torch.tensor([[False, False, True], [False, False, False]])
    minus_inf = torch.full((heads,), -math.inf, dtype=F64)
    torch.testing.assert_close(common.attention(x, x, w, heads, causal=True, sink=minus_inf),
                               common.attention(x, x, w, heads, causal=True), **TOL)  # fmt: skip
    torch.testing.assert_close(common.attention(x, mem, w, heads, key_padding_mask=pad, sink=minus_inf),
                               common.attention(x, mem, w, heads, key_padding_mask=pad), **TOL)  # fmt: skip
    logits = randn(2, heads, 4, 4, g=g)
    for fn in (attention_sinks.softmax_concat, attention_sinks.softmax_first):
        torch.testing.assert_close(fn(logits, minus_inf), torch.softmax(logits, -1), **TOL)


def test_sink_hand_computed_and_a_fully_masked_row():
    logits = torch.zeros(1, 1, 1, 2, dtype=F64)
    for fn in (attention_sinks.softmax_concat, attention_sinks.softmax_explicit, attention_sinks.softmax_first):
        torch.testing.assert_close(fn(logits, torch.zeros(1, dtype=F64)), torch.full((1, 1, 1, 2), 1 / 3, dtype=F64),
                                   **TOL)  # fmt: skip
        p = fn(logits, torch.tensor([math.log(2.0)], dtype=F64))
        torch.testing.assert_close(p, torch.full((1, 1, 1, 2), 0.25, dtype=F64), **TOL)  # 1 / (1 + 1 + 2)
    # a row whose keys are all masked attends to nothing: 0, where the plain softmax gives NaN
    masked = torch.full((1, 1, 1, 2), -math.inf, dtype=F64)
    assert bool(torch.softmax(masked, -1).isnan().all())
    for fn in (attention_sinks.softmax_concat, attention_sinks.softmax_first):
        torch.testing.assert_close(fn(masked, torch.zeros(1, dtype=F64)), torch.zeros_like(masked), **TOL)


def test_sink_released_softmaxes_agree():
    g = gen(16)
    logits = randn(2, 3, 4, 5, g=g) * 3
    logits[..., 3:] = -math.inf  # masked keys
    sinks = randn(3, g=g) * 2
    ref = attention_sinks.softmax_explicit(logits, sinks)
    torch.testing.assert_close(attention_sinks.softmax_concat(logits, sinks), ref, **TOL)
    torch.testing.assert_close(attention_sinks.softmax_first(logits, sinks), ref, **TOL)
    torch.testing.assert_close(ref.sum(-1), 1 / (1 + torch.exp(sinks.view(1, 3, 1) - logits.logsumexp(-1))), **TOL)


@pytest.mark.parametrize("form", ["sdpa_extra_key_mask", "sdpa_augmented", "sdpa_lse_rescale"])
@pytest.mark.parametrize("case", ["causal", "padding", "none"])
def test_sink_through_torch_sdpa_equals_the_explicit_denominator(form, case):
    g = gen(17)
    B, H, T, S, dh = 2, 3, 4, 4 if case == "causal" else 5, 4
    q, k, v = randn(B, H, T, dh, g=g), randn(B, H, S, dh, g=g), randn(B, H, S, dh, g=g)
    sinks = randn(H, g=g)
    scale = dh**-0.5
    pad = torch.tensor([[False] * (S - 2) + [True, True], [False] * S]) if case == "padding" else None
    causal = case == "causal"
    logits = scale * q @ k.transpose(-1, -2)
    if causal:
        logits = logits.masked_fill(torch.ones(T, S, dtype=torch.bool).triu(1), -math.inf)
    if pad is not None:
        logits = logits.masked_fill(pad[:, None, None, :], -math.inf)
    want = attention_sinks.softmax_explicit(logits, sinks) @ v
    got = getattr(attention_sinks, form)(q, k, v, sinks, scale, causal=causal, key_padding_mask=pad)
    torch.testing.assert_close(got, want, **TOL)


def test_sink_gradient_reaches_the_sink_through_sdpa():
    g = gen(18)
    q, k, v = randn(1, 2, 3, 4, g=g), randn(1, 2, 3, 4, g=g), randn(1, 2, 3, 4, g=g)
    grads = []
    for form in (attention_sinks.sdpa_extra_key_mask, attention_sinks.sdpa_augmented):
        s = torch.tensor([0.3, -0.7], dtype=F64, requires_grad=True)
        form(q, k, v, s, 0.5, causal=True).pow(2).sum().backward()
        grads.append(s.grad)
    s = torch.tensor([0.3, -0.7], dtype=F64, requires_grad=True)
    logits = (0.5 * q @ k.transpose(-1, -2)).masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), -math.inf)
    (attention_sinks.softmax_explicit(logits, s) @ v).pow(2).sum().backward()
    for got in grads:
        torch.testing.assert_close(got, s.grad, **TOL)


# ---------------------------------------------------------------------------------- value residual


def test_value_residual_mixes():
    v, v1 = torch.tensor([2.0, 4.0], dtype=F64), torch.tensor([6.0, 0.0], dtype=F64)
    torch.testing.assert_close(value_residual.resformer_mix(v, v1), torch.tensor([4.0, 2.0], dtype=F64), **TOL)
    g = gen(19)
    v, v1 = randn(2, 3, 4, g=g), randn(2, 3, 4, g=g)
    torch.testing.assert_close(value_residual.xtransformers_mix(v, v1, 0.5, 2), value_residual.resformer_mix(v, v1),
                               **TOL)  # fmt: skip
    mix = torch.tensor([[[1.0, 0.0]] * 3] * 2, dtype=F64)  # head 0 keeps its values, head 1 takes v1
    got = value_residual.xtransformers_mix(v, v1, mix, 2)
    torch.testing.assert_close(got[..., :2], v[..., :2], **TOL)
    torch.testing.assert_close(got[..., 2:], v1[..., 2:], **TOL)


def lm_case(seed: int, length: int, d: int = 8):
    """Three random Pre-LN decoder-only layers (LayerNorm eps 1e-5) and an input of ``length`` positions."""
    g = gen(seed)
    layers = value_residual.random_lm_layers(3, d, 2 * d, g, NormSpec("layer", None, None, 1e-5))
    return layers, randn(2, length, d, g=g)


def test_value_residual_stack_first_layer_untouched_and_lambda_0_is_plain():
    heads = 2
    layers, x = lm_case(20, 5)

    def plain(x, layers):
        for lay in layers:
            h = lay["norm_attn"](x)
            x = x + common.attention(h, h, lay["attn_w"], heads, causal=True)
            x = x + common.ffn(lay["norm_ffn"](x), lay["ffn_w"])
        return x

    torch.testing.assert_close(value_residual.lm_stack(x, layers[:1], heads), plain(x, layers[:1]), **TOL)
    torch.testing.assert_close(value_residual.lm_stack(x, layers, heads, lam=0.0), plain(x, layers), **TOL)
    assert float((value_residual.lm_stack(x, layers, heads) - plain(x, layers)).abs().max()) > 1e-3


def test_value_residual_incremental_decoding_with_mixed_cache_equals_the_full_forward():
    heads = 2
    layers, x = lm_case(21, 6)
    full = value_residual.lm_stack(x, layers, heads)
    torch.testing.assert_close(value_residual.lm_stack_incremental(x, layers, heads), full, **TOL)


# ------------------------------------------------------------------------------------------ z-loss


def test_z_loss_hand_computed_and_masked_mean():
    V = 7
    logits = torch.zeros(3, V, dtype=F64)
    logits[1] = math.log(2.0)  # logsumexp = log 2 + log V
    labels = torch.tensor([0, 1, -100])
    _, z = z_loss.cross_entropy_with_z_loss(logits, labels)
    want = 1e-4 * (math.log(V) ** 2 + (math.log(2.0) + math.log(V)) ** 2) / 2
    assert abs(float(z) - want) < 1e-16
    assert z_loss.DEFAULT_MULTIPLIER == 1e-4 and z_loss.OLMO2_MULTIPLIER == 1e-5
    logs = z_loss.logged(z)
    assert abs(logs["Z loss unscaled"] - want / 1e-4) < 1e-12


def test_z_loss_equals_coef_times_mean_logsumexp_squared_and_fairseq_sum_form():
    g = gen(22)
    logits = randn(10, 11, g=g) * 3
    target = torch.randint(0, 11, (10,), generator=g)
    target[[2, 7]] = 1  # padding index 1
    _, z = z_loss.cross_entropy_with_z_loss(logits, target, ignore_index=1)
    keep = target != 1
    want = 1e-4 * logits[keep].logsumexp(-1).pow(2).mean()
    torch.testing.assert_close(z, want, **TOL)
    torch.testing.assert_close(z_loss.fairseq_sum(logits, target, 1) / keep.sum(), want, **TOL)


def test_z_loss_gradient_closed_form():
    g = gen(23)
    logits = randn(4, 5, g=g).requires_grad_(True)
    labels = torch.tensor([0, 1, 2, 3])
    _, z = z_loss.cross_entropy_with_z_loss(logits, labels, multiplier=0.3)
    z.backward()
    lse = logits.detach().logsumexp(-1, keepdim=True)
    want = 0.3 * 2 * lse * torch.softmax(logits.detach(), -1) / 4  # d(c mean lse^2)/dl = 2 c lse softmax / N
    torch.testing.assert_close(logits.grad, want, **TOL)


# ---------------------------------------------------------------------------------------- QK-Clip


def _qk(x: torch.Tensor, wq, bq, wk, bk, heads: int):
    B, T, C = x.shape
    dh = C // heads
    q = common.linear(x, wq, bq).view(B, T, heads, dh).transpose(1, 2)
    k = common.linear(x, wk, bk).view(B, T, heads, dh).transpose(1, 2)
    return q, k, dh**-0.5


def test_qk_clip_brings_clipped_heads_to_tau_and_leaves_the_others():
    g = gen(24)
    d, heads = 8, 4
    x = randn(2, 6, d, g=g)
    wq, wk = randn(d, d, g=g) * 3, randn(d, d, g=g) * 3
    bq, bk = randn(d, g=g), randn(d, g=g)
    q, k, scale = _qk(x, wq, bq, wk, bk, heads)
    before = qk_clip.per_head_max_logit(q, k, scale, causal=True)
    tau = float(before.sort().values[1]) + 1e-3  # two heads above tau, two below
    wq2, bq2, wk2, bk2 = qk_clip.clip_with_bias(wq, bq, wk, bk, before, heads, tau=tau)
    q2, k2, _ = _qk(x, wq2, bq2, wk2, bk2, heads)
    after = qk_clip.per_head_max_logit(q2, k2, scale, causal=True)
    over = before > tau
    assert int(over.sum()) == 2
    torch.testing.assert_close(after[over], torch.full((2,), tau, dtype=F64), **TOL)
    dh = d // heads
    rows = over.repeat_interleave(dh)
    assert torch.equal(wq2[~rows], wq[~rows]) and torch.equal(bk2[~rows], bk[~rows])  # untouched, bit for bit
    # every logit of a clipped head scales by eta = tau / max (the closed form)
    eta = torch.where(over, tau / before, torch.ones_like(before)).view(1, heads, 1, 1)
    torch.testing.assert_close(scale * q2 @ k2.transpose(-1, -2), eta * (scale * q @ k.transpose(-1, -2)), **TOL)
    # the query takes eta ** alpha, the key eta ** (1 - alpha)
    torch.testing.assert_close(q2, eta.sqrt() * q, **TOL)


def test_qk_clip_nothing_over_tau_changes_nothing_and_megatron_is_weights_only():
    g = gen(25)
    d, heads = 8, 2
    x = randn(1, 5, d, g=g)
    wq, wk, bq, bk = randn(d, d, g=g), randn(d, d, g=g), randn(d, g=g), randn(d, g=g)
    q, k, scale = _qk(x, wq, bq, wk, bk, heads)
    m = qk_clip.per_head_max_logit(q, k, scale)
    assert qk_clip.eta(m, heads, tau=float(m.max()) + 1) is None
    wq2, wk2 = qk_clip.clip_megatron(wq, wk, m, heads, tau=float(m.max()) + 1)
    assert torch.equal(wq2, wq) and torch.equal(wk2, wk)
    # bias-free projections: Megatron's weights-only rule is exact, with alpha = 0.3 too
    tau = float(m.min()) / 2
    wq2, wk2 = qk_clip.clip_megatron(wq, wk, m, heads, tau=tau, alpha=0.3)
    q0, k0, _ = _qk(x, wq, None, wk, None, heads)
    q2, k2, _ = _qk(x, wq2, None, wk2, None, heads)
    e = (tau / m).view(1, heads, 1, 1)
    torch.testing.assert_close(q2, e.pow(0.3) * q0, **TOL)
    torch.testing.assert_close(k2, e.pow(0.7) * k0, **TOL)
    # with biases it is not: the bias keeps its size, so the max logit misses tau
    q2b, k2b, _ = _qk(x, wq2, bq, wk2, bk, heads)
    assert float((qk_clip.per_head_max_logit(q2b, k2b, scale) - tau).abs().max()) > 1e-3


def test_qk_clip_groups_take_the_max_of_their_heads():
    m = torch.tensor([150.0, 50.0, 20.0, 30.0], dtype=F64)
    torch.testing.assert_close(qk_clip.eta(m, 2), torch.tensor([100 / 150, 1.0], dtype=F64), **TOL)
    f = qk_clip.kimi_mla_factors(torch.tensor([0.25], dtype=F64))
    assert float(f["q_c"] * f["k_c"]) == 0.25 and float(f["q_r"] * f["k_r"]) == 0.25


def test_qk_clip_megatrons_factor_for_a_negative_max_head_and_the_guard():
    m = torch.tensor([150.0, -2.0], dtype=F64)  # one head over tau, one whose every logit is negative
    e = qk_clip.eta(m, 2)
    assert float(e[1]) == -50.0 and bool(e.pow(0.5).isnan()[1])  # Megatron's clamp(tau / max, max=1)
    torch.testing.assert_close(qk_clip.eta(m, 2, guarded=True), torch.tensor([100 / 150, 1.0], dtype=F64), **TOL)
    under = torch.tensor([50.0, -2.0], dtype=F64)
    assert qk_clip.eta(under, 2) is None
    assert torch.equal(qk_clip.eta(under, 2, guarded=True), torch.ones(2, dtype=F64))
