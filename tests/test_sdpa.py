"""``--attention-impl sdpa``: fairseq's MultiheadAttention computed by ``F.scaled_dot_product_attention``.

Every case is compared with fairseq's own forward on the same weights and inputs (fp32, outputs and
gradients to 1e-5): encoder self-attention with padding, decoder self-attention with the future mask
(``is_causal``) with and without target padding, encoder-decoder attention, incremental decoding with
beam reordering (fairseq's beamable encoder cache included), the fallbacks, whole models of every
layer type, beam search, a few training updates, and fairseq-train + fairseq-generate from one
checkpoint with both implementations.
"""

from __future__ import annotations

import copy
import re
import types

import pytest
import torch
import torch.nn.functional as F
from cli_fork import run_forked
from fairseq import utils
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.sequence_generator import SequenceGenerator

from conftest import TINY_DIMS, USER_DIR, build_model, make_dictionary
from fairseq_deepinit.modules import attention as sdpa_attention
from fairseq_deepinit.modules.attention import SDPAMultiheadAttention
from fairseq_deepinit.modules.masks import is_future_mask
from fairseq_deepinit.options import DeepInitConfigError, resolve_and_validate

TOL = dict(rtol=1e-5, atol=1e-5)
E, H = 32, 4
PAD = 1


@pytest.fixture
def kernel_calls(monkeypatch):
    """Every call the SDPA module makes to the fused kernel: (mask, is_causal, dropout_p)."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        calls.append(types.SimpleNamespace(mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p, q=q.shape))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)

    monkeypatch.setattr(sdpa_attention, "F", types.SimpleNamespace(scaled_dot_product_attention=spy))
    return calls


def pair(kdim=None, seed=0, **kwargs):
    """A fairseq MultiheadAttention and an SDPA copy of it (same weights, random biases)."""
    torch.manual_seed(seed)
    ref = MultiheadAttention(E, H, kdim=kdim, vdim=kdim, **kwargs)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    fast = SDPAMultiheadAttention.like(ref)
    assert type(fast) is SDPAMultiheadAttention and type(ref) is MultiheadAttention
    return ref, fast


def future_mask(t: int) -> torch.Tensor:
    """fairseq's decoder future mask (TransformerDecoderBase.buffered_future_mask), a slice of a buffer."""
    return torch.triu(utils.fill_with_neg_inf(torch.zeros([t + 3, t + 3])), 1)[:t, :t]


def run_both(ref, fast, inputs: dict, kwargs: dict):
    """Outputs and every gradient (inputs and parameters) of both modules under one random cotangent."""
    results = []
    for module in (ref, fast):
        module.zero_grad(set_to_none=True)
        # one leaf per distinct input tensor: self-attention gets the same tensor as query, key and value
        copies = {id(v): v.detach().clone().requires_grad_(True) for v in inputs.values()}
        leaves = {k: copies[id(v)] for k, v in inputs.items()}
        out, weights = module(**leaves, **kwargs)
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
        out.backward(cot)
        grads = {f"input.{k}": v.grad for k, v in leaves.items() if v.grad is not None}
        grads.update({n: p.grad for n, p in module.named_parameters() if p.grad is not None})
        results.append((out.detach(), weights, grads))
    (o1, w1, g1), (o2, w2, g2) = results
    torch.testing.assert_close(o2, o1, **TOL)
    assert set(g1) == set(g2) and len(g1) >= 8
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], **TOL, msg=name)
    return w1, w2


def padding(lengths, width, left: bool) -> torch.Tensor:
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        if left:
            mask[i, : width - n] = True
        else:
            mask[i, n:] = True
    return mask


# --- one attention module: every case the plugin's layers use ----------------------------------


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "left-padding"])
def test_encoder_self_attention(kernel_calls, padded):
    ref, fast = pair(self_attention=True)
    x = torch.randn(9, 3, E)
    kpm = padding([9, 5, 2], 9, left=True) if padded else None
    run_both(ref, fast, {"query": x, "key": x, "value": x}, dict(key_padding_mask=kpm, need_weights=False))
    (call,) = kernel_calls
    assert not call.is_causal
    if padded:  # one boolean mask per sentence, broadcast over heads and queries
        assert call.mask.dtype == torch.bool and call.mask.shape == (3, 1, 1, 9)
        assert torch.equal(call.mask[:, 0, 0], ~kpm)
    else:
        assert call.mask is None


def test_encoder_attn_mask_float_and_bool(kernel_calls):
    """fairseq's encoder passes an additive -1e8 attn_mask; bool masks (True = masked) work too."""
    ref, fast = pair(self_attention=True)
    x = torch.randn(6, 2, E)
    blocked = torch.rand(6, 6, generator=torch.Generator().manual_seed(1)) < 0.3
    blocked.fill_diagonal_(False)
    kpm = padding([6, 4], 6, left=True)
    blocked[:, :2] = False  # every query keeps an unpadded key
    additive = torch.zeros(6, 6).masked_fill(blocked, -1e8)
    run_both(
        ref,
        fast,
        {"query": x, "key": x, "value": x},
        dict(attn_mask=additive, key_padding_mask=kpm, need_weights=False),
    )
    # a bool attn_mask means True = masked (as in F.multi_head_attention_forward)
    ref_out, _ = ref(x, x, x, attn_mask=additive, need_weights=False)
    fast_out, _ = fast(x, x, x, attn_mask=blocked, need_weights=False)
    torch.testing.assert_close(fast_out, ref_out, **TOL)
    assert [c.is_causal for c in kernel_calls] == [False] * 2


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "causal+padding"])
def test_decoder_self_attention_future_mask(kernel_calls, padded):
    ref, fast = pair(self_attention=True)
    x = torch.randn(7, 3, E)
    kpm = padding([7, 4, 6], 7, left=False) if padded else None
    run_both(
        ref,
        fast,
        {"query": x, "key": x, "value": x},
        dict(attn_mask=future_mask(7), key_padding_mask=kpm, need_weights=False),
    )
    (call,) = kernel_calls
    # without padding the future mask is exactly is_causal (no mask tensor at all)
    assert call.is_causal is (not padded)
    assert (call.mask is None) is (not padded)
    if padded:
        assert call.mask.shape == (3, 1, 7, 7)


def test_is_future_mask_is_exact():
    assert is_future_mask(future_mask(5))
    assert is_future_mask(torch.triu(torch.full((4, 4), float("-inf")), 1))
    assert not is_future_mask(torch.triu(torch.full((4, 4), -1e8), 1))  # not fairseq's mask: no is_causal
    assert not is_future_mask(torch.triu(torch.full((4, 4), float("-inf")), 2))
    assert not is_future_mask(torch.zeros(4, 4))
    assert not is_future_mask(torch.triu(torch.full((4, 5), float("-inf")), 1))
    assert not is_future_mask(torch.ones(4, 4, dtype=torch.bool).triu(1))
    # the verdict is cached per buffer and version: an in-place change is seen
    buf = torch.triu(utils.fill_with_neg_inf(torch.zeros([6, 6])), 1)
    assert is_future_mask(buf[:4, :4]) and is_future_mask(buf[:6, :6])
    buf[0, 3] = 0.0
    assert not is_future_mask(buf[:4, :4])
    # a slice that is not top-left is checked on its own
    buf2 = torch.triu(utils.fill_with_neg_inf(torch.zeros([6, 6])), 1)
    assert is_future_mask(buf2[1:5, 1:5]) and not is_future_mask(buf2[:4, 1:5].contiguous()[:, :4])


@pytest.mark.parametrize("kdim", [None, 24], ids=["same-dim", "encoder-dim-24"])
def test_encoder_decoder_attention(kernel_calls, kdim):
    ref, fast = pair(kdim=kdim, encoder_decoder_attention=True)
    x = torch.randn(5, 3, E)
    enc = torch.randn(8, 3, kdim or E)
    kpm = padding([8, 3, 6], 8, left=True)
    kwargs = dict(key_padding_mask=kpm, static_kv=True, need_weights=False)
    run_both(ref, fast, {"query": x, "key": enc, "value": enc}, kwargs)
    assert len(kernel_calls) == 1 and kernel_calls[0].mask.shape == (3, 1, 1, 8)


def test_need_weights_falls_back_to_fairseq(kernel_calls):
    """fairseq's decoder asks the last layer's cross-attention for its (per-head) weights: fairseq's path."""
    ref, fast = pair(encoder_decoder_attention=True)
    x, enc = torch.randn(5, 2, E), torch.randn(6, 2, E)
    kpm = padding([6, 4], 6, left=True)
    for head in (False, True):
        w_ref, w_fast = run_both(
            ref,
            fast,
            {"query": x, "key": enc, "value": enc},
            dict(key_padding_mask=kpm, static_kv=True, need_head_weights=head),
        )
        assert w_fast is not None and w_fast.shape == ((H, 2, 5, 6) if head else (2, 5, 6))
        torch.testing.assert_close(w_fast, w_ref, **TOL)
    assert kernel_calls == []


@pytest.mark.parametrize(
    "kwargs,call",
    [
        (dict(self_attention=True, add_bias_kv=True), {}),
        (dict(self_attention=True, add_zero_attn=True), {}),
        (dict(self_attention=True), dict(before_softmax=True)),
        (dict(), {}),  # neither self- nor encoder-decoder attention (--cross-self-attention)
        (dict(encoder_decoder_attention=True), dict(static_kv=False)),
    ],
    ids=["add-bias-kv", "add-zero-attn", "before-softmax", "cross-self-attention", "enc-dec-not-static"],
)
def test_other_calls_use_fairseqs_forward(kernel_calls, kwargs, call):
    ref, fast = pair(**kwargs)
    x, y = torch.randn(4, 2, E), torch.randn(5, 2, E)
    key = x if kwargs.get("self_attention") else y
    out_ref = ref(x, key, key, need_weights=False, **call)
    out_fast = fast(x, key, key, need_weights=False, **call)
    torch.testing.assert_close(out_fast[0], out_ref[0], **TOL)
    assert kernel_calls == []


def test_attention_dropout(kernel_calls):
    """Training: the kernel's dropout_p is fairseq's attention dropout; eval: none. Unbiased, as fairseq's."""
    ref, fast = pair(self_attention=True, dropout=0.5)
    x = torch.randn(6, 2, E)
    fast.eval()
    with torch.no_grad():
        clean = fast(x, x, x, need_weights=False)[0]
        fast.train()
        torch.manual_seed(0)
        draws = torch.stack([fast(x, x, x, need_weights=False)[0] for _ in range(400)])
    assert [c.dropout_p for c in kernel_calls] == [0.0] + [0.5] * 400
    assert (draws[0] - clean).abs().max() > 1e-2  # dropout is applied
    # the mean over draws approaches the dropout-free output (std error ~ 1/sqrt(400))
    assert (draws.mean(0) - clean).abs().mean() < 0.1 * clean.abs().mean()
    fast.dropout_module.apply_during_inference = True  # --retain-dropout
    fast.eval()
    fast(x, x, x, need_weights=False)
    assert kernel_calls[-1].dropout_p == 0.5


# --- incremental decoding: fairseq's cache layout, beam reordering ------------------------------


def test_incremental_self_attention_with_reordering(kernel_calls):
    ref, fast = pair(self_attention=True)
    ref.eval(), fast.eval()
    bsz, steps = 4, 6
    xs = torch.randn(steps, 1, bsz, E)
    st_ref, st_fast = {}, {}
    orders = {2: torch.tensor([1, 0, 0, 3]), 4: torch.tensor([3, 3, 2, 1])}
    full = []
    for t in range(steps):
        if t in orders:
            ref.reorder_incremental_state(st_ref, orders[t])
            fast.reorder_incremental_state(st_fast, orders[t])
        o_ref, _ = ref(xs[t], xs[t], xs[t], incremental_state=st_ref, need_weights=False)
        # alternate with fairseq's own path on the same cache (what a need_weights call does)
        o_fast, _ = fast(xs[t], xs[t], xs[t], incremental_state=st_fast, need_weights=(t == 3))
        torch.testing.assert_close(o_fast, o_ref, **TOL)
        full.append(o_fast)
    buf_ref, buf_fast = ref._get_input_buffer(st_ref), fast._get_input_buffer(st_fast)
    assert buf_fast["prev_key"].shape == (bsz, H, steps, E // H) and buf_fast["prev_key"].is_contiguous()
    for key in ("prev_key", "prev_value"):
        torch.testing.assert_close(buf_fast[key], buf_ref[key], **TOL)
    assert len(kernel_calls) == steps - 1 and not any(c.is_causal for c in kernel_calls)


def test_incremental_equals_full_causal_pass():
    _, fast = pair(self_attention=True)
    fast.eval()
    x = torch.randn(5, 2, E)
    full, _ = fast(x, x, x, attn_mask=future_mask(5), need_weights=False)
    state = {}
    steps = [
        fast(x[t : t + 1], x[t : t + 1], x[t : t + 1], incremental_state=state, need_weights=False)[0] for t in range(5)
    ]
    torch.testing.assert_close(torch.cat(steps), full, **TOL)


@pytest.mark.parametrize("beam", [1, 3])
def test_incremental_cross_attention_beamable_cache(kernel_calls, beam):
    """fairseq's beamable encoder-decoder cache: one copy of the encoder keys per sentence, shrinking batches."""
    ref, fast = pair(kdim=24, encoder_decoder_attention=True)
    ref.eval(), fast.eval()
    for m in (ref, fast):
        m.set_beam_size(beam)
    n_sent, src = 3, 7
    enc = torch.randn(src, n_sent, 24).repeat_interleave(beam, dim=1)  # (S, n_sent * beam, C), as fairseq's
    kpm = padding([7, 4, 5], src, left=True).repeat_interleave(beam, dim=0)
    st_ref, st_fast = {}, {}
    bsz = n_sent * beam
    for t in range(4):
        if t == 2:  # reorder within beams (hypothesis i continues hypothesis new_order[i])
            order = torch.arange(bsz).view(n_sent, beam).flip(1).reshape(-1)
            ref.reorder_incremental_state(st_ref, order)
            fast.reorder_incremental_state(st_fast, order)
        if t == 3:  # sentence 1 finished: fairseq drops its beams (the cache keeps one row per sentence)
            keep = torch.tensor([0, 2])
            order = (keep.view(-1, 1) * beam + torch.arange(beam)).reshape(-1)
            ref.reorder_incremental_state(st_ref, order)
            fast.reorder_incremental_state(st_fast, order)
            enc, kpm, bsz = enc[:, order], kpm[order], order.numel()
        q = torch.randn(1, bsz, E)
        kwargs = dict(key_padding_mask=kpm, static_kv=True, need_weights=False)
        o_ref, _ = ref(q, enc, enc, incremental_state=st_ref, **kwargs)
        o_fast, _ = fast(q, enc, enc, incremental_state=st_fast, **kwargs)
        torch.testing.assert_close(o_fast, o_ref, **TOL)
    cached = fast._get_input_buffer(st_fast)["prev_key"]
    assert cached.shape[0] == (2 if beam > 1 else bsz)  # one row per remaining sentence when beamable
    assert len(kernel_calls) == 4


# --- whole models --------------------------------------------------------------------------------

MODEL_CONFIGS = {
    "postln": (),
    "preln-rmsnorm": ("--encoder-normalize-before", "--decoder-normalize-before", "--norm-type", "rmsnorm"),
    "lipschitz-bias-free": ("--init-scheme", "lipschitz", "--lipschitz-bias-free"),
    "matt-aan": ("--decoder-layer-type", "matt"),
    "matt-self-attn": ("--decoder-layer-type", "matt", "--matt-self-branch", "self-attn"),
    "tfixup": ("--init-scheme", "t-fixup"),
}


def model_pair(*flags, seed=1):
    ref, _ = build_model("deepinit_tiny", "--dropout", "0", *flags, seed=seed)
    fast, args = build_model("deepinit_tiny", "--dropout", "0", "--attention-impl", "sdpa", *flags, seed=seed + 1)
    assert args.attention_impl == "sdpa"
    assert list(fast.state_dict()) == list(ref.state_dict())  # identical keys: checkpoints interchange
    fast.load_state_dict(ref.state_dict(), strict=True)
    _randomise_biases(ref)
    fast.load_state_dict(ref.state_dict())
    return ref, fast


def _randomise_biases(model):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def padded_batch(bsz=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    src_len, tgt_len = [9, 6, 3, 8][:bsz], [7, 7, 2, 5][:bsz]
    src = torch.full((bsz, max(src_len)), PAD)
    prev = torch.full((bsz, max(tgt_len)), PAD)
    for i, (s, t) in enumerate(zip(src_len, tgt_len, strict=True)):
        src[i, max(src_len) - s :] = torch.randint(4, 54, (s,), generator=g)  # fairseq pads sources on the left
        prev[i, :t] = torch.randint(4, 54, (t,), generator=g)  # and targets on the right
    return {"src_tokens": src, "src_lengths": torch.tensor(src_len), "prev_output_tokens": prev}


@pytest.mark.parametrize("config", list(MODEL_CONFIGS))
def test_model_outputs_and_gradients(kernel_calls, config):
    ref, fast = model_pair(*MODEL_CONFIGS[config])
    batch = padded_batch()
    nonpad = batch["prev_output_tokens"].ne(PAD)
    grads = []
    for model in (ref, fast):
        model.train()
        logits, extra = model(**batch)
        loss = F.cross_entropy(logits[nonpad], torch.arange(nonpad.sum()) % 50 + 4)
        loss.backward()
        grads.append((logits.detach(), extra["attn"][0], {n: p.grad for n, p in model.named_parameters()}))
    (l1, a1, g1), (l2, a2, g2) = grads
    # right-padded targets: the decoder's causal self-attention runs is_causal, exact on every real
    # position; padding rows (which the loss ignores) differ, so outputs are compared where real
    torch.testing.assert_close(l2[nonpad], l1[nonpad], **TOL)
    # the alignment (last layer's cross-attention weights, (B, T, S)) of the real target positions
    torch.testing.assert_close(a2[nonpad], a1[nonpad], **TOL)
    for name, grad in g1.items():
        if grad is not None:
            torch.testing.assert_close(g2[name], grad, **TOL, msg=name)
    # the fused kernel ran: encoder self-attention (2 layers), decoder self-attention (2, except under
    # MAtt's average branch), and the first decoder layer's cross-attention (the last one returns weights)
    n_self = 0 if config == "matt-aan" else 2
    assert len(kernel_calls) == 2 + n_self + 1
    causal = [c for c in kernel_calls if c.is_causal]
    assert len(causal) == n_self and all(c.mask is None for c in causal)


def test_beam_search_same_hypotheses(kernel_calls):
    ref, fast = model_pair()
    d = make_dictionary(50)
    batch = padded_batch()
    sample = {"net_input": {"src_tokens": batch["src_tokens"], "src_lengths": batch["src_lengths"]}}
    results = []
    for model in (ref, fast):
        model.eval()
        model.make_generation_fast_()
        gen = SequenceGenerator([model], d, beam_size=4, max_len_b=12)
        with torch.no_grad():
            results.append(gen.forward(sample))
    for hyps_ref, hyps_fast in zip(*results, strict=True):
        assert len(hyps_ref) == len(hyps_fast) == 4
        for h1, h2 in zip(hyps_ref, hyps_fast, strict=True):
            assert torch.equal(h1["tokens"], h2["tokens"])
            torch.testing.assert_close(h2["score"], h1["score"], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(h2["positional_scores"], h1["positional_scores"], **TOL)
    # incremental steps went through the kernel (self-attention of both layers, cross-attention of the first)
    assert len(kernel_calls) > 20


# Tolerance of the training comparison. The two implementations compute the same function with
# different reduction orders (fused kernel vs. bmm + softmax), so each attention output differs by
# round-off, about sqrt(n) u relative (u = 2^-24, n <= 32 terms), i.e. ~1e-6; through 2+2 layers,
# backward and 4 updates it stays below ~5e-6 norm-wise on every CPU kernel path (measured with
# ATEN_CPU_CAPABILITY=default/avx2/avx512 and MKL_ENABLE_INSTRUCTIONS=SSE4_2/AVX2). 1e-4 leaves 20x
# margin; a real difference (a scale, a mask, a dropped bias) is O(1e-2) or more.
TRAIN_RTOL = 1e-4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_training_updates_follow_the_same_trajectory():
    """Four SGD updates: every gradient and every parameter's total update agree norm-wise.

    Norm-wise per tensor, not element-wise: an element whose gradient is a sum of terms that cancel
    carries round-off far above its own size, on some kernel paths and not others. With Adam, which
    divides each element by its own running scale, such elements move by arbitrary O(lr) steps, so
    element-wise Adam trajectories differ between the two paths for reasons that have nothing to do
    with attention; plain SGD keeps every update proportional to its gradient.
    """
    ref, fast = model_pair("--attention-dropout", "0")
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, fast)]
    curves: list[list[float]] = [[], []]
    for step in range(4):
        batch = padded_batch(seed=step)
        nonpad = batch["prev_output_tokens"].ne(PAD)
        grads = []
        for i, (model, opt) in enumerate(zip((ref, fast), opts, strict=True)):
            model.train()
            logits, _ = model(**batch)
            loss = F.cross_entropy(logits[nonpad], torch.arange(nonpad.sum()) % 50 + 4)
            opt.zero_grad()
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            curves[i].append(loss.item())
        g_ref, g_fast = grads
        for name, g in g_ref.items():
            if name.endswith("k_proj.bias"):
                # k_proj.bias shifts every score of a query alike, so softmax makes its gradient zero: both
                # paths give round-off, tiny next to the key weights' gradient
                w = g_ref[name[: -len("bias")] + "weight"].norm()
                assert g.norm() < 1e-5 * w and g_fast[name].norm() < 1e-5 * w, name
            else:
                assert _rel(g_fast[name], g) < TRAIN_RTOL, (step, name, _rel(g_fast[name], g))
        for opt in opts:
            opt.step()
    assert curves[0][-1] < curves[0][0]
    for a, b in zip(*curves, strict=True):
        assert abs(a - b) <= TRAIN_RTOL * abs(a)
    for (name, p_ref), p_fast in zip(ref.named_parameters(), fast.parameters(), strict=True):
        if not name.endswith("k_proj.bias"):
            moved_ref, moved_fast = p_ref.detach() - start[name], p_fast.detach() - start[name]
            assert _rel(moved_fast, moved_ref) < TRAIN_RTOL, (name, _rel(moved_fast, moved_ref))


def test_adam_loss_curves_agree():
    """The optimiser users train with: the loss curves of four Adam updates agree (see above for why
    the parameters themselves are compared under SGD)."""
    ref, fast = model_pair("--attention-dropout", "0")
    curves = []
    for model in (ref, fast):
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        curve = []
        for step in range(4):
            batch = padded_batch(seed=step)
            nonpad = batch["prev_output_tokens"].ne(PAD)
            logits, _ = model(**batch)
            loss = F.cross_entropy(logits[nonpad], torch.arange(nonpad.sum()) % 50 + 4)
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        curves.append(curve)
    assert curves[0][-1] < curves[0][0]
    for a, b in zip(*curves, strict=True):
        assert abs(a - b) <= TRAIN_RTOL * abs(a)


# --- options -------------------------------------------------------------------------------------


def test_option_defaults_and_validation():
    _, args = build_model("deepinit_tiny")
    assert args.attention_impl == "fairseq"
    model, _ = build_model("deepinit_tiny", "--attention-impl", "fairseq")
    assert not any(isinstance(m, SDPAMultiheadAttention) for m in model.modules())
    model, _ = build_model("deepinit_tiny", "--decoder-layer-type", "matt", "--attention-impl", "sdpa")
    attns = [m for m in model.modules() if isinstance(m, MultiheadAttention)]
    assert len(attns) == 4 and all(type(m) is SDPAMultiheadAttention for m in attns)
    bad = copy.copy(args)
    bad.attention_impl = "flash"
    with pytest.raises(DeepInitConfigError, match="unknown --attention-impl 'flash'; choose from fairseq, sdpa"):
        resolve_and_validate(bad)
    xf = copy.copy(args)
    xf.attention_impl, xf.decoder_xformers_att_config = "sdpa", '{"name": "scaled_dot_product"}'
    with pytest.raises(DeepInitConfigError, match="--decoder-xformers-att-config selects xFormers"):
        resolve_and_validate(xf)


# --- fairseq-train + fairseq-generate -------------------------------------------------------------


def _hypotheses(log: str) -> dict:
    return {int(m[1]): (m[2], m[3]) for m in re.finditer(r"^H-(\d+)\t(\S+)\t(.*)$", log, re.M)}


def test_cli_train_and_generate_with_both_implementations(synthetic_bin, tmp_path):
    save = tmp_path / "ckpt"
    train = run_forked(
        "train", synthetic_bin, "--user-dir", USER_DIR, "--arch", "deepinit_tiny", *TINY_DIMS,
        "--attention-impl", "sdpa", "--task", "translation", "-s", "src", "-t", "tgt", "--optimizer", "adam",
        "--lr", "3e-3", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--dropout", "0.1", "--attention-dropout", "0.1", "--max-tokens", "1000", "--max-update", "40",
        "--save-dir", save, "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "10",
        "--seed", "1", "--cpu", "--num-workers", "0", log=tmp_path / "train.log",
    ).stdout  # fmt: skip
    assert "attention_impl='sdpa'" in train or "'attention_impl': 'sdpa'" in train
    logs = {}
    for impl in ("sdpa", "fairseq"):
        logs[impl] = run_forked(
            "generate", synthetic_bin, "--user-dir", USER_DIR, "--path", save / "checkpoint_last.pt",
            "--task", "translation", "-s", "src", "-t", "tgt", "--gen-subset", "test", "--beam", "4",
            "--batch-size", "64", "--cpu", "--num-workers", "0",
            "--model-overrides", f"{{'attention_impl': '{impl}'}}", log=tmp_path / f"gen-{impl}.log",
        ).stdout  # fmt: skip
    sdpa, ref = _hypotheses(logs["sdpa"]), _hypotheses(logs["fairseq"])
    translated = int(re.search(r"Translated (\d+) sentences", logs["fairseq"])[1])
    assert len(ref) == translated > 50 and set(sdpa) == set(ref)
    for i in ref:
        assert sdpa[i][1] == ref[i][1], f"sentence {i}: {sdpa[i]} vs {ref[i]}"
        assert abs(float(sdpa[i][0]) - float(ref[i][0])) < 1e-4
