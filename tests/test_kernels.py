"""The kernel-level fast paths against their reference paths, and what they would launch on a GPU.

- Decoder self-attention with right-padded targets passes ``is_causal`` and no ``(B, 1, T, T)`` mask;
  left-padded (or unknown) targets keep the mask; real positions, losses and gradients equal the
  masked path's; Admin's profile (which reads padding rows) is unchanged; the future mask is known
  without a device read, also under ``--checkpoint-activations`` and on the ``meta`` device.
- Every layer type reaches SDPA under ``--attention-impl sdpa`` (Sub-LN included), per attention kind.
- ScaleNorm / RMSNorm as one fused ``F.rms_norm`` call: op counts against LayerNorm's, ScaleNorm's eps
  mapping against the released formula (tolerances derived in ScaleNorm's docstring and below).
- DeepNorm's residual as one ``torch.add(..., alpha=)``: its rounding bound and op count.
- aten ops per training step against stock fairseq at equal dimensions.

Counters: ``deepinit_tools/harness/op_counters.py`` (aten ops after autograd as CUDA would launch them, a fused
``F.rms_norm`` or ``F.scaled_dot_product_attention`` counted once each way) and
``deepinit_tools/harness/attention_calls.py`` (the path and mask of every attention call).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.modules.multihead_attention import MultiheadAttention

from conftest import build_model, make_dictionary
from deepinit_tools.harness.attention_calls import AttentionCalls  # noqa: E402
from deepinit_tools.harness.op_counters import OpCounter  # noqa: E402
from fairseq_deepinit.modules import padding
from fairseq_deepinit.modules.attention import SDPAMultiheadAttention
from fairseq_deepinit.modules.masks import future_mask, is_future_mask
from fairseq_deepinit.modules.norms import RMSNorm, ScaleNorm, _ScaleNormFunction, build_norm, scalenorm_as_rms_norm
from fairseq_deepinit.modules.residual import ConstantResidual

PAD = 1
# fairseq's MultiheadAttention vs the fused kernel: same function, different reduction order, each
# attention output off by about sqrt(n) u (u = 2^-24, n <= 32 terms) ~ 1e-6; through 2+2 layers and the
# backward below ~5e-6 (tests/test_sdpa.py, same tolerance and measurement); a wrong mask is O(1e-1).
TOL = dict(rtol=1e-5, atol=1e-5)
DIMS = [
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
    "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--encoder-layers", "2", "--decoder-layers", "2",
]  # fmt: skip
U32 = 2.0**-24


def padded_batch(bsz: int = 4, seed: int = 0, left_pad_target: bool = False) -> dict:
    """Sources padded on the left and targets on the right, as fairseq's translation task pads them."""
    g = torch.Generator().manual_seed(seed)
    src_len, tgt_len = [9, 6, 3, 8][:bsz], [7, 7, 2, 5][:bsz]
    src = torch.full((bsz, max(src_len)), PAD)
    prev = torch.full((bsz, max(tgt_len)), PAD)
    for i, (s, t) in enumerate(zip(src_len, tgt_len, strict=True)):
        src[i, max(src_len) - s :] = torch.randint(4, 54, (s,), generator=g)
        words = torch.randint(4, 54, (t,), generator=g)
        if left_pad_target:
            prev[i, max(tgt_len) - t :] = words
        else:
            prev[i, :t] = words
    return {"src_tokens": src, "src_lengths": torch.tensor(src_len), "prev_output_tokens": prev}


def train_step(model, batch: dict, targets: str = "prev_output_tokens"):
    """Forward, a cross-entropy on the real target positions, backward; returns (logits, loss)."""
    model.train()
    logits, _ = model(**batch)
    tokens = batch[targets]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens.reshape(-1), ignore_index=PAD)
    loss.backward()
    return logits.detach(), loss.detach()


def plugin_pair(arch: str, *flags: str):
    """The same model with ``--attention-impl fairseq`` (reference) and ``sdpa``, same weights."""
    common = ("--dropout", "0", "--attention-dropout", "0", *flags)
    ref, _ = build_model(arch, *common)
    fast, _ = build_model(arch, *common, "--attention-impl", "sdpa")
    fast.load_state_dict(ref.state_dict(), strict=True)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # non-trivial biases, so that a dropped bias or a wrong mask shows
        for (name, p), q in zip(ref.named_parameters(), fast.parameters(), strict=True):
            if name.endswith("bias"):
                delta = 0.1 * torch.randn(p.shape, generator=g)
                p.add_(delta)
                q.add_(delta)
    return ref, fast


def assert_same_training_step(ref, fast, batch: dict, targets: str = "prev_output_tokens") -> None:
    """Logits at real positions, loss and every gradient of the two models agree to ``TOL``."""
    l_ref, loss_ref = train_step(ref, batch, targets)
    l_fast, loss_fast = train_step(fast, batch, targets)
    real = batch[targets].ne(PAD)
    torch.testing.assert_close(l_fast[real], l_ref[real], **TOL)
    torch.testing.assert_close(loss_fast, loss_ref, **TOL)
    grads = dict(ref.named_parameters())
    for name, p in fast.named_parameters():
        if grads[name].grad is not None:
            torch.testing.assert_close(p.grad, grads[name].grad, **TOL, msg=name)


# --- the counters themselves ---------------------------------------------------------------------


def fwd_bwd_ops(module, x: torch.Tensor) -> OpCounter:
    """The operators of ``module``'s forward and backward alone (the cotangent, in the output's dtype, is
    made between them; a fused call's backward is counted by the counter open during the backward)."""
    x = x.detach().requires_grad_()
    with OpCounter() as ops:
        y = module(x)
    dy = torch.randn_like(y)
    with OpCounter() as backward:
        torch.autograd.backward(y, dy)
    ops.counts.update(backward.counts)
    return ops


def test_op_counter_rules():
    x = torch.randn(4, 3, 16)
    ln = fwd_bwd_ops(nn.LayerNorm(16), x)
    # LayerNorm: one kernel each way
    assert dict(ln.counts) == {"aten.native_layer_norm.default": 1, "aten.native_layer_norm_backward.default": 1}
    # views launch nothing: a chain of them adds nothing to a multiply; a copy does count
    with OpCounter() as ops:
        (x.view(12, 16).t().unsqueeze(0).expand(2, -1, -1) * 2.0).sum()
    assert dict(ops.counts) == {"aten.mul.Tensor": 1, "aten.sum.default": 1}
    with OpCounter() as ops:
        x.transpose(0, 1).reshape(3, -1)
    assert dict(ops.counts) == {"aten.clone.default": 1}
    # a fused call counts once each way, its CPU decomposition (about 20 operators) not at all
    w = torch.ones(16, requires_grad=True)
    rms = fwd_bwd_ops(lambda t: F.rms_norm(t, (16,), w, 1e-5), x)
    assert dict(rms.counts) == {"rms_norm (fused)": 1, "rms_norm_backward (fused)": 1}
    # mixed dtypes: torch does not fuse them on CUDA either, so they are counted operator by operator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "Mismatch dtype ... Cannot dispatch to fused"
        mixed = fwd_bwd_ops(lambda t: F.rms_norm(t.bfloat16(), (16,), w, 1e-5), x)
    assert "rms_norm (fused)" not in mixed.counts and mixed.total > ln.total + 10
    # on the meta device (no data at all) the counts are the same
    assert dict(fwd_bwd_ops(nn.LayerNorm(16).to("meta"), x.to("meta")).counts) == dict(ln.counts)


def test_attention_calls_record_path_and_mask():
    attn = SDPAMultiheadAttention(16, 2, self_attention=True)
    ref = MultiheadAttention(16, 2, self_attention=True)
    model = nn.ModuleDict({"decoder": nn.ModuleDict({"self_attn": attn, "other": ref})})
    x = torch.randn(5, 2, 16)
    with AttentionCalls(model) as calls:
        attn(x, x, x, attn_mask=future_mask(5, x), need_weights=False)
        ref(x, x, x, attn_mask=future_mask(5, x), need_weights=False)
        attn(x, x, x, need_weights=True)  # weights: the SDPA module falls back to fairseq's forward
        ref(x, x, x, static_kv=True, need_weights=False)  # fairseq's explicit bmm/softmax path
    fast, mha, fallback, explicit = calls.calls
    assert (fast.kind, fast.path, fast.is_causal, fast.mask_shape) == ("decoder.self_attn", "sdpa", True, None)
    assert (mha.kind, mha.path, mha.square_mask) == ("decoder.other", "mha", True)
    assert fallback.path == "mha" and explicit.path == "explicit"


# --- decoder self-attention: is_causal with right-padded targets ---------------------------------


def test_target_padding_comes_from_the_task():
    from fairseq.tasks.language_modeling import LanguageModelingTask
    from fairseq.tasks.translation import TranslationTask

    d = make_dictionary()
    assert padding.target_padding(TranslationTask(SimpleNamespace(left_pad_target=False), d, d)) == "right"
    assert padding.target_padding(TranslationTask(SimpleNamespace(left_pad_target=True), d, d)) == "left"
    lm = LanguageModelingTask.__new__(LanguageModelingTask)
    assert padding.target_padding(lm) == "right"
    assert padding.target_padding(None) == "unknown" and padding.target_padding(object()) == "unknown"
    # what the model builder declares: right unless --left-pad-target
    for flags, want in (((), True), (("--left-pad-target",), False)):
        model, _ = build_model("deepinit_tiny", "--attention-impl", "sdpa", *flags)  # noqa: B023
        dec = [m for m in model.decoder.modules() if isinstance(m, SDPAMultiheadAttention) and m.self_attention]
        enc = [m for m in model.encoder.modules() if isinstance(m, SDPAMultiheadAttention)]
        assert len(dec) == 2 and all(m.causal_right_padded is want and m.causal_self_attention for m in dec)
        assert not any(m.causal_right_padded or m.causal_self_attention for m in enc)


@pytest.mark.parametrize("side", ["right", "left"])
def test_causal_module_call_with_padding(side):
    """One self-attention: right padding takes is_causal and equals fairseq's masked forward on every
    real query (outputs, and every gradient under a cotangent that is zero on padding rows, as a loss
    that ignores padding gives); the flag off (left/unknown padding) keeps the (B, 1, T, T) mask."""
    torch.manual_seed(0)
    ref = MultiheadAttention(16, 2, self_attention=True)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    fast = SDPAMultiheadAttention(16, 2, self_attention=True)
    fast.load_state_dict(ref.state_dict())
    fast.causal_self_attention, fast.causal_right_padded = True, side == "right"  # as the decoder declares
    t, lengths = 6, [6, 4, 1]
    kpm = torch.zeros(3, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        kpm[i, n:] = True  # right padding (the module trusts the flag: that is the builder's contract)
    real = ~kpm.t().unsqueeze(-1)  # (T, B, 1)
    x = torch.randn(t, 3, 16)
    cot = torch.randn(t, 3, 16) * real
    outs = []
    with AttentionCalls(nn.ModuleDict({"decoder": nn.ModuleDict({"self_attn": fast})})) as calls:
        for module in (ref, fast):
            module.zero_grad()
            xi = x.clone().requires_grad_()
            out, _ = module(xi, xi, xi, key_padding_mask=kpm, attn_mask=future_mask(t, x), need_weights=False)
            out.backward(cot)
            outs.append((out.detach() * real, xi.grad, {n: p.grad for n, p in module.named_parameters()}))
    (call,) = calls.calls
    if side == "right":
        assert call.is_causal and call.mask_shape is None
    else:
        assert not call.is_causal and call.mask_shape == (3, 1, t, t)
    (o1, gx1, g1), (o2, gx2, g2) = outs
    torch.testing.assert_close(o2, o1, **TOL)
    torch.testing.assert_close(gx2, gx1, **TOL)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], **TOL, msg=name)


TRANSLATION_LAYER_TYPES = {
    "postln": ("deepinit_tiny",),
    "preln": ("preln_iwslt_de_en",),
    "twt": ("twt_iwslt_de_en",),
    "deepnorm": ("deepnorm_iwslt_de_en",),
    "admin": ("admin_iwslt_de_en",),
    "rezero": ("rezero_iwslt_de_en",),
    "tfixup": ("tfixup_iwslt_de_en",),
    "b2t": ("b2t_iwslt_de_en",),
    "normformer": ("normformer_iwslt_de_en",),
    "subln": ("subln_iwslt_de_en",),
    "matt-self-attn": ("matt_iwslt_de_en", "--matt-self-branch", "self-attn"),
    "matt-aan": ("matt_iwslt_de_en",),
}


@pytest.mark.parametrize("name", list(TRANSLATION_LAYER_TYPES))
def test_every_layer_type_reaches_sdpa(name):
    """Per attention kind under --attention-impl sdpa, in a training step on a padded batch: every
    self-attention on the fused kernel (the encoder's with a (B, 1, 1, S) key mask, the decoder's
    causal one with is_causal and no mask tensor), the cross-attention too except the last layer's,
    whose weights fairseq's decoder returns as the alignment."""
    arch, *flags = TRANSLATION_LAYER_TYPES[name]
    model, _ = build_model(arch, *DIMS, *flags, "--attention-impl", "sdpa")
    batch = padded_batch()
    with AttentionCalls(model) as calls:
        train_step(model, batch)
    bsz, src = batch["src_tokens"].shape
    enc = calls.of_kind("encoder.self_attn")
    dec = calls.of_kind("decoder.self_attn") + calls.of_kind("decoder.self_branch")
    cross = calls.of_kind("decoder.encoder_attn")
    assert len(enc) == 2 and all(c.path == "sdpa" and c.mask_shape == (bsz, 1, 1, src) for c in enc), enc
    assert len(dec) == (0 if name == "matt-aan" else 2)
    assert all(c.path == "sdpa" and c.is_causal and c.mask_shape is None for c in dec), dec
    assert len(cross) == 2 and cross[0].path == "sdpa" and not cross[0].square_mask
    assert cross[1].path == "explicit"  # need_weights: fairseq's alignment


def test_left_padded_targets_keep_the_mask():
    model, _ = build_model("deepinit_tiny", *DIMS, "--attention-impl", "sdpa", "--left-pad-target")
    batch = padded_batch(left_pad_target=True)
    with AttentionCalls(model) as calls:
        model(**batch)
    dec = calls.of_kind("decoder.self_attn")
    bsz, tgt = batch["prev_output_tokens"].shape
    assert len(dec) == 2 and all(not c.is_causal and c.mask_shape == (bsz, 1, tgt, tgt) for c in dec)


@pytest.mark.parametrize(
    "arch",
    ["deepinit_tiny", "subln_iwslt_de_en", "normformer_iwslt_de_en", "twt_iwslt_de_en", "qknorm_iwslt_de_en",
     "completep_iwslt_de_en"],
)  # fmt: skip
def test_fast_paths_equal_the_reference(arch):
    """The whole training step with the fast paths (is_causal, Sub-LN on SDPA, fused norms off the CPU
    are covered below) against --attention-impl fairseq: real logits, loss and every gradient."""
    ref, fast = plugin_pair(arch, *DIMS)
    assert_same_training_step(ref, fast, padded_batch())


def test_language_model_is_causal_and_equal():
    from fairseq import options, tasks

    import fairseq_deepinit  # noqa: F401

    def build(*flags):
        parser = options.get_training_parser()
        args = options.parse_args_and_arch(
            parser, ["/nonexistent", "--task", "language_modeling", "--arch", "preln_lm_tiny", "--dropout", "0", *flags]
        )
        d = make_dictionary()
        torch.manual_seed(1)
        return tasks.TASK_REGISTRY["language_modeling"](args, d, d).build_model(args)

    ref, fast = build(), build("--attention-impl", "sdpa")
    fast.load_state_dict(ref.state_dict())
    tokens = padded_batch()["prev_output_tokens"]  # right-padded rows, as MonolingualDataset pads them
    batch = {"src_tokens": tokens, "src_lengths": tokens.ne(PAD).sum(1)}
    with AttentionCalls(fast) as calls:
        assert_same_training_step(ref, fast, batch, targets="src_tokens")
    dec = calls.of_kind("decoder.self_attn")
    assert dec and all(c.path == "sdpa" and c.is_causal and c.mask_shape is None for c in dec)


def test_admin_profile_reads_fairseqs_padding_rows(monkeypatch):
    """Admin's profiling statistics count padding positions (as the released code): under sdpa the
    profile equals fairseq's attention's, because profiling runs the masked path (exact_padding_rows);
    with the causal path there the decoder's variances change (the check has power)."""
    from fairseq_deepinit.admin import profiling

    batch = padded_batch()

    def profile(model):
        model.train()
        torch.manual_seed(0)
        rows = profiling.profile_model(model, batch)["sublayers"]
        return {r["name"]: (r["var_branch"], r["omega"]) for r in rows}

    ref, fast = plugin_pair("admin_iwslt_de_en", *DIMS)
    want, got = profile(ref), profile(fast)
    assert list(got) == list(want)
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-5), name
    ref, fast = plugin_pair("admin_iwslt_de_en", *DIMS)
    monkeypatch.setattr(profiling, "exact_padding_rows", lambda model: contextlib.nullcontext())
    changed = profile(fast)
    assert any(abs(changed[n][0] - want[n][0]) > 1e-3 * abs(want[n][0]) for n in want if n.startswith("decoder"))


def test_future_mask_is_known_without_a_read():
    """The decoder's future mask, its slices, detached aliases (--checkpoint-activations hands those
    to the recomputed layer) and a meta-device mask are recognised with no aten.equal (a device sync);
    an edited mask is re-checked and refused; a mask from elsewhere is read once per version."""
    model, _ = build_model("deepinit_tiny", *DIMS, "--attention-impl", "sdpa", "--checkpoint-activations")
    batch = padded_batch()
    with AttentionCalls(model) as calls, OpCounter() as ops:
        train_step(model, batch)
    assert ops.counts["aten.equal.default"] == 0, ops.counts
    # the forward and the backward's recomputation of each checkpointed decoder layer
    assert [c.is_causal for c in calls.of_kind("decoder.self_attn")] == [True] * 4

    x = torch.zeros(8, 2, 4, device="meta")
    mask = model.decoder.buffered_future_mask(x)
    assert mask.device.type == "meta" and is_future_mask(mask) and is_future_mask(mask[:5, :5].detach())
    fast = SDPAMultiheadAttention(16, 2, self_attention=True).to("meta")
    fast.causal_right_padded = True
    q = torch.zeros(8, 2, 16, device="meta")
    kpm = torch.zeros(2, 8, dtype=torch.bool, device="meta")
    out, _ = fast(q, q, q, key_padding_mask=kpm, attn_mask=mask, need_weights=False)
    assert out.shape == (8, 2, 16)

    m = future_mask(6, torch.zeros(1))
    assert is_future_mask(m[:4, :4].detach())
    m[0, 1] = 0.0  # an in-place edit bumps the version: checked again, and no longer causal
    assert not is_future_mask(m[:4, :4])
    other = torch.triu(torch.full((5, 5), float("-inf")), 1)
    with OpCounter() as ops:
        assert is_future_mask(other[:3, :3]) and is_future_mask(other[:4, :4]) and is_future_mask(other)
    assert ops.counts["aten.equal.default"] == 1


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "right-padding"])
def test_declared_causal_attention_compiles_without_a_graph_break(padded):
    """Under torch.compile the declaration stands for the mask check (is_causal_mask): no graph break
    in the decoder's self-attention, and the compiled call computes what the eager one does."""
    torch.manual_seed(0)
    fast = SDPAMultiheadAttention(16, 2, self_attention=True)
    fast.causal_self_attention = fast.causal_right_padded = True
    x = torch.randn(6, 2, 16)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    mask = future_mask(8, x)[:6, :6]
    pad = kpm if padded else None

    def call(x, mask):
        return fast(x, x, x, key_padding_mask=pad, attn_mask=mask, need_weights=False)[0]

    torch._dynamo.reset()
    explained = torch._dynamo.explain(call)(x, mask)
    assert explained.graph_break_count == 0, [str(r.reason).splitlines()[0] for r in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(call, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, mask), call(x, mask), rtol=0, atol=0)
    torch._dynamo.reset()


# --- ScaleNorm / RMSNorm --------------------------------------------------------------------------


def norm_ops(module: nn.Module, dtype: torch.dtype, device: str = "meta", d: int = 64) -> OpCounter:
    """Forward + backward of one norm on a (T, B, d) input in ``dtype``, weights in ``dtype``."""
    module = module.to(device=device, dtype=dtype)
    return fwd_bwd_ops(module, torch.randn(5, 3, d, device=device, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_norm_op_counts(dtype):
    """As CUDA runs them (meta tensors take the non-CPU path; a fused rms_norm counts once each way):
    LayerNorm 2; RMSNorm 2 (<= LayerNorm + 2); ScaleNorm 5 (<= + 3): its gain g / sqrt(d) (a divide
    forward, and backward a divide and the expand's sum) around the one fused call."""
    ln = norm_ops(build_norm("layernorm", 64), dtype).total
    rms = norm_ops(RMSNorm(64), dtype)
    scale = norm_ops(ScaleNorm(64), dtype)
    assert ln == 2
    assert rms.total <= ln + 2 and rms.counts["rms_norm (fused)"] == 1, rms.counts
    assert scale.total <= ln + 3 and scale.counts["rms_norm (fused)"] == 1, scale.counts
    assert "aten._to_copy.default" not in rms.counts and "aten._to_copy.default" not in scale.counts


def test_norms_compute_in_fp32_with_16_bit_input():
    """fp16/bf16 input computes in fp32 and rounds once: on the CPU (torch's decomposition would round
    the normalised value before the gain) and with mixed dtypes (autocast: bf16 input, fp32 weights)
    the output is exactly the fp32 result rounded to the input's dtype."""
    torch.manual_seed(0)
    rms, scale = RMSNorm(64), ScaleNorm(64)
    with torch.no_grad():
        rms.weight.uniform_(0.5, 1.5)
        scale.g.fill_(3.3)
    x = torch.randn(5, 3, 64) * 4
    for dtype in (torch.float16, torch.bfloat16):
        xh = x.to(dtype)
        want_rms = F.rms_norm(xh.float(), (64,), rms.weight, rms.eps).to(dtype)
        want_scale = _ScaleNormFunction.apply(xh.float(), scale.g, scale.eps).to(dtype)
        assert torch.equal(rms(xh), want_rms) and torch.equal(scale(xh), want_scale)
        with torch.autocast("cpu", torch.bfloat16):  # fp32 weights, 16-bit input: the fp32 path
            assert rms(xh).dtype == scale(xh).dtype == dtype
            assert torch.equal(rms(xh), want_rms)
        # off the CPU, mixed dtypes take the same fp32 path and keep its fp32 result, as CUDA autocast
        # returns LayerNorm's (meta: the path, dtypes and kernels only)
        g_meta = torch.full((), 3.3, device="meta", requires_grad=True)
        assert scalenorm_as_rms_norm(xh.to("meta"), g_meta, scale.eps).dtype == torch.float32
        assert RMSNorm(64).to("meta")(xh.to("meta")).dtype == torch.float32


def test_norm_op_counts_under_autocast():
    """CUDA autocast's case (fp32 weights, 16-bit input; on meta): LayerNorm runs on an fp32 copy of the
    input (autocast's fp32 list), 4 kernels with the casts; RMSNorm as many (the same casts around one
    fused call), ScaleNorm 7 (<= + 3: and its gain's three)."""
    x = torch.randn(5, 3, 64, device="meta", dtype=torch.bfloat16)
    layernorm = build_norm("layernorm", 64).to("meta")
    ln = fwd_bwd_ops(lambda t: layernorm(t.float()), x)
    rms = fwd_bwd_ops(RMSNorm(64).to("meta"), x)
    scale = fwd_bwd_ops(ScaleNorm(64).to("meta"), x)
    assert ln.total == 4 and ln.counts["aten._to_copy.default"] == 2, ln.counts
    assert rms.total <= ln.total + 2 and rms.counts["rms_norm (fused)"] == 1, rms.counts
    assert scale.total <= ln.total + 3 and scale.counts["rms_norm (fused)"] == 1, scale.counts


def scalenorm_bound(d: int) -> float:
    """Relative round-off of one ScaleNorm output element in fp32 (either path), worst case:
    the sum of d squares (d - 1) u, halved by the square root, plus at most 8 roundings (square,
    divide by d, add eps, sqrt / hypot, reciprocal, g / sqrt(d), and the two multiplies)."""
    return (d / 2 + 8) * U32


def test_scalenorm_fused_call_maps_eps_exactly():
    """The fused call F.rms_norm(x, (d,), (g / sqrt(d)).expand(d), eps^2 / d) and the CPU path both
    compute g x / hypot(||x||, eps) (fp64 reference) to fp32 round-off; against the released
    g x / max(||x||, eps) each row differs by the factor max(n, eps) / hypot(n, eps) and no more."""
    d, eps, g = 64, 1e-5, 3.3
    torch.manual_seed(0)
    x = torch.randn(8, d, dtype=torch.float64)
    # row norms from 0 through eps up to ~8: 0, 1e-3 eps, eps/2, eps, 4 eps, 1e3 eps, typical
    for i, n in enumerate([0.0, 1e-8, 5e-6, 1e-5, 4e-5, 1e-2]):
        x[i] = x[i] / x[i].norm() * n
    n = x.norm(dim=-1, keepdim=True)
    want = g * x / torch.hypot(n, torch.tensor(eps, dtype=torch.float64))
    twt = g * x / n.clamp(min=eps)
    gain = torch.tensor(g)
    g = gain.item()  # the fp32 gain the paths use
    fused = scalenorm_as_rms_norm(x.float(), gain, eps).double()
    cpu = _ScaleNormFunction.apply(x.float(), gain, eps).double()
    bound = scalenorm_bound(d)
    # fp32 inputs of these small rows are themselves rounded: compare against the fp64 formula on them
    xf = x.float().double()
    nf = xf.norm(dim=-1, keepdim=True)
    want_f = g * xf / torch.hypot(nf, torch.tensor(eps, dtype=torch.float64))
    for got in (fused, cpu):
        torch.testing.assert_close(got, want_f, rtol=bound, atol=0)
    ratio = n.clamp(min=eps) / torch.hypot(n, torch.tensor(eps, dtype=torch.float64))
    torch.testing.assert_close(want, twt * ratio, rtol=1e-14, atol=0)
    dev = (ratio - 1).abs().squeeze(-1)
    assert dev[3] == pytest.approx(1 - 2**-0.5)  # ||x|| = eps: -29 %
    assert dev[5] < 1e-6 and dev[6:].max() < U32  # 1e3 eps: eps^2 / 2n^2; typical rows: nothing
    assert dev[0] == 0 and torch.all(fused[0] == 0) and torch.all(cpu[0] == 0)


def test_scalenorm_paths_have_the_same_gradients():
    """fp64: autograd through the fused call's decomposition, the CPU path's hand-written backward and
    autograd of the formula agree to fp64 round-off (rtol 1e-10 leaves ~1e5 u64 for d = 64)."""
    d, eps = 64, 1e-5
    torch.manual_seed(1)
    x = torch.randn(6, d, dtype=torch.float64)
    x[1] *= 1e-6  # ||x|| ~ eps: where the formula bends
    x[2] = 0.0
    dy = torch.randn(6, d, dtype=torch.float64)
    results = []
    for fn in (
        lambda x, g: scalenorm_as_rms_norm(x, g, eps),
        lambda x, g: _ScaleNormFunction.apply(x, g, eps),
        lambda x, g: g * x / torch.hypot(x.norm(dim=-1, keepdim=True), torch.tensor(eps, dtype=x.dtype)),
    ):
        xi = x.clone().requires_grad_()
        g = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
        results.append(torch.autograd.grad(fn(xi, g), (xi, g), dy))
    for got in results[:2]:
        torch.testing.assert_close(got[0], results[2][0], rtol=1e-10, atol=1e-10 * results[2][0].abs().max().item())
        torch.testing.assert_close(got[1], results[2][1], rtol=1e-10, atol=0)


def test_rmsnorm_fused_call_is_the_formula():
    d = 32
    norm = RMSNorm(d, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, d))
    x = torch.randn(4, d, dtype=torch.float64)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.linspace(0.5, 2.0, d).double()
    # fp32: (d / 2 + 6) u by the same count as ScaleNorm's
    torch.testing.assert_close(norm(x.float()).double(), want, rtol=(d / 2 + 6) * U32, atol=0)


# --- DeepNorm's fused residual add ---------------------------------------------------------------


UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: U32, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@pytest.mark.parametrize("dtype", list(UNIT_ROUNDOFF), ids=lambda t: str(t).split(".")[-1])
def test_deepnorm_fused_add_rounding(dtype):
    """torch.add(x, r, alpha=a) rounds x + a r once (FMA or fp32 opmath), x + r * a rounds a r first; a
    kernel may also round a to a 16-bit dtype first (torch's CPU one does). The two differ by at most
    2 u (|a r| + |x + a r|) per element to first order (ConstantResidual's docstring; the factor 1 + 4u
    covers the second-order terms and fp32 opmath's own roundings). Which elements differ depends on
    the CPU kernel path (the scalar fp32 one has no FMA and is bit-identical)."""
    u = UNIT_ROUNDOFF[dtype]
    alpha = 0.81 * (6**4 * 6) ** (1 / 16)  # DeepNorm's encoder alpha at 6+6 layers
    torch.manual_seed(0)
    x, r = torch.randn(4096).to(dtype), (3 * torch.randn(4096)).to(dtype)
    fused = ConstantResidual(alpha)(x, r)
    assert torch.equal(fused, torch.add(x, r, alpha=alpha))
    unfused = x + r * alpha
    exact = x.double() + alpha * r.double()
    bound = 2 * u * (alpha * r.double().abs() + exact.abs()) * (1 + 4 * u)
    assert torch.all((fused.double() - unfused.double()).abs() <= bound)


def test_deepnorm_residual_is_one_kernel_each_way():
    x = torch.randn(4, 8, requires_grad=True)
    r = torch.randn(4, 8, requires_grad=True)
    dy = torch.ones(4, 8)
    with OpCounter() as ops:
        torch.autograd.grad(ConstantResidual(1.7)(x, r), (x, r), dy)
    assert ops.total == 2, ops.counts  # add (fwd), alpha * grad (bwd)


# --- aten ops per training step against stock ---------------------------------------------------


@functools.cache
def step_ops(arch: str, *flags: str) -> int:
    """aten ops of one fairseq training step: forward, label-smoothed loss, backward, fairseq's Adam."""
    from fairseq.optim.adam import Adam

    model, _ = build_model(arch, *flags)
    opt = Adam(model.parameters(), lr=1e-3)
    batch = padded_batch()
    with OpCounter() as ops:
        train_step(model, batch)
        opt.step()
    return ops.total


RECIPE_DROPOUT = ("--dropout", "0.1", "--attention-dropout", "0.1", "--activation-dropout", "0.1")


@pytest.mark.parametrize(
    "arch,stock_flags",
    [
        ("postln_iwslt_de_en", ()),
        ("lipschitz_iwslt_de_en", ()),
        ("dsinit_iwslt_de_en", ()),
        ("preln_iwslt_de_en", ("--encoder-normalize-before", "--decoder-normalize-before")),
        ("deepnorm_iwslt_de_en", ()),
    ],
)
def test_step_ops_against_stock(arch, stock_flags):
    """Init-only schemes and DeepNorm at stock's dimensions: at most 1.02x stock's operators per step
    (DeepNorm: exactly one more kernel per sub-layer than the plugin's Post-LN, the backward's
    alpha * grad of the fused add)."""
    dims = [*DIMS, "--encoder-layers", "6", "--decoder-layers", "6", *RECIPE_DROPOUT]
    stock = step_ops("transformer", *dims, *stock_flags)
    plugin = step_ops(arch, *dims)
    assert plugin <= 1.02 * stock, (plugin, stock, plugin / stock)
    if arch.startswith("deepnorm"):
        assert plugin - step_ops("postln_iwslt_de_en", *dims) == 6 * 2 + 6 * 3  # one per sub-layer


# --- benchmarks/norm_speed.py --------------------------------------------------------------------


def test_norm_speed_benchmark_smoke(capsys):
    """The side-by-side benchmark runs, prints every norm's ratio to LayerNorm and its kernel count;
    bad input is one line and exit status 1; every option's help names its default."""
    from deepinit_tools.bench import norm_speed as script

    script.main(["--shape", "4x2x16", "--calls", "1", "--rounds", "2", "--warmup", "0"])
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"layernorm", "scalenorm", "rmsnorm", "scalenorm-rms-norm"}
    assert rows["layernorm"][3].strip().startswith("1.000")
    assert [rows[n][5].strip() for n in ("layernorm", "rmsnorm", "scalenorm")] == ["2", "2", "5"]
    assert "Command: `" in out and "norm_speed.py" in out
    with pytest.raises(SystemExit) as exc:
        script.main(["--shape", "4x2"])
    assert exc.value.code == 1 and capsys.readouterr().err.count("\n") == 1
    with pytest.raises(SystemExit):
        script.main(["--help"])
    text = capsys.readouterr().out.split("options:", 1)[1]
    for option in ("--device", "--dtype", "--shape", "--calls", "--rounds", "--warmup"):
        block = text.split(option, 1)[1].split("\n  --", 1)[0]
        assert "default" in block, option
