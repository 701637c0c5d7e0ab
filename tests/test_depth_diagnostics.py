"""Diagnostics over depth: residual-stream size, angular distance between layers, maximum attention
logit, loss with one layer removed, spike and loss-scale-drop counters.

Each statistic is checked on a hand-computed case and against the independent port
``tests/ports/diagnostics.py`` (released code: OLMo-core's GAP monitor and StabilityMonitor, LayerNorm
Scaling's / Mix-LN's ``block_influence`` and ``short_hf.py``, Megatron's ``log_max_attention_logit``),
on a model against fairseq's own hidden states (``encoder_states``, ``inner_states``) and fairseq's own
pre-softmax scores (``before_softmax``); the loss with a layer removed against a forward pass written out
by hand; the metrics reach the training log and TensorBoard of one shared tiny ``fairseq-train`` run, and
``deepinit-diagnose`` plots them over depth and over updates.

Tolerances: the statistics are float64 reductions of the model's float32 tensors, compared with float64
reductions of the same tensors (1e-12 relative: float64 round-off of sums of a few hundred terms); the
attention logit is a float32 dot product over ``head_dim`` terms in both implementations, which may sum
in another order: ``|difference| <= 2 * head_dim * 2**-24 * sum_i |q_i k_i|`` (the standard bound on a
float32 sum, twice, one per implementation), computed per test from the projections.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from fairseq.logging import metrics
from fairseq.optim.dynamic_loss_scaler import DynamicLossScaler
from ports import diagnostics as port

from conftest import TINY_DIMS, USER_DIR, build_model, make_dictionary, run_cli
from fairseq_deepinit.diagnostics import (
    depth_diagnose,
    depth_hooks,
    depth_stats,
    diagnose,
    layer_removal,
    training_counters,
)
from fairseq_deepinit.diagnostics.criterion import DiagnosticsCriterion
from fairseq_deepinit.errors import DeepInitConfigError

NO_DROPOUT = ("--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0")
REL = 1e-12
F64 = torch.float64
PAD = make_dictionary().pad()


def _close(a: float, b: float, rel: float = REL) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=rel)


# ---- the statistics on hand-computed cases --------------------------------------------------


def _by_hand_stream():
    """``(T=2, B=2, C=2)``: sentence 0 has tokens [3, 4] and [1, 0]; sentence 1 is left-padded (a pad of
    [100, -100] that must not count) with one token [0, 2]."""
    h = torch.tensor([[[3.0, 4.0], [100.0, -100.0]], [[1.0, 0.0], [0.0, 2.0]]])
    real = torch.tensor([[True, False], [True, True]])
    return h, real


def test_stream_statistics_by_hand():
    h, real = _by_hand_stream()
    s = depth_stats.stream_statistics(depth_stats.stream_moments(h, real))
    # per-token norms 5, 1, 2; sentence 0's values 3, 4, 1, 0 (mean 2, unbiased variance 10/3),
    # sentence 1's values 0, 2 (mean 1, variance 2)
    assert s["norm"] == pytest.approx(8 / 3, rel=REL)
    assert s["var"] == pytest.approx((10 / 3 + 2) / 2, rel=REL)
    assert depth_stats.stream_max_abs(h, real).item() == 4.0  # the pad's 100 is left out
    # moments add up: two batches pooled give the statistics of their union
    both = depth_stats.stream_moments(h, real) + depth_stats.stream_moments(h[:, :1], real[:, :1])
    pooled = depth_stats.stream_statistics(both)
    assert pooled["norm"] == pytest.approx((8 + 6) / 5, rel=REL)
    assert pooled["var"] == pytest.approx((10 / 3 + 2 + 10 / 3) / 3, rel=REL)


def test_stream_statistics_equal_the_port_without_padding():
    """Unpadded, the per-sentence variance and max are OLMo-core's GAP statistics exactly, and the norm the port's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g, dtype=F64) * 2 + 0.5  # batch-first (B, T, C)
    real = torch.ones(5, 3, dtype=torch.bool)
    s = depth_stats.stream_statistics(depth_stats.stream_moments(x.transpose(0, 1), real))
    gap = port.gap_activation_stats(x)
    assert _close(s["var"], gap["var"]) and _close(s["norm"], port.residual_norms([x])[0])
    assert depth_stats.stream_max_abs(x.transpose(0, 1), real).item() == gap["max"]


def test_angular_distance_by_hand():
    a = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [3.0, 4.0]], dtype=F64)
    b = torch.tensor([[2.0, 0.0], [0.0, 3.0], [-1.0, 0.0], [0.5, math.sqrt(3) / 2], [1.0, 1.0], [3.0, 4.0]], dtype=F64)
    d = depth_stats.angular_distance(a, b)
    # same direction, orthogonal, opposite, 60 degrees, a zero vector (NaN -> 0.5 as metrics.py: 1/3), itself
    expected = [0.0, 0.5, 1.0, 1 / 3, 1 / 3, 0.0]
    assert d.tolist() == pytest.approx(expected, abs=1e-15)
    assert port.angular_distance(a, b).tolist() == pytest.approx(expected, abs=1e-15)
    # the clamp (our extension): this vector has cos(x, x) = 1 + 1 ulp in float64, where the released
    # formula returns NaN (arccos of a number above 1); a layer that returns its input is 0 here
    x = torch.tensor([[0.9700530018065531, 0.707819864399788, 0.45938294312745087]], dtype=F64)
    assert math.isnan(port.angular_distance(x, x).item())
    assert depth_stats.angular_distance(x, x).item() == 0.0


def test_angle_moments_take_the_last_real_token_on_either_padding_side():
    # T=3, B=2, C=2: sentence 0 right-padded (last real token t=1), sentence 1 left-padded (t=2)
    before = torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]], [[5.0, 5.0], [1.0, 0.0]]])
    after = torch.tensor([[[1.0, 0.0], [9.0, 9.0]], [[0.0, 1.0], [1.0, 1.0]], [[5.0, 5.0], [-1.0, 0.0]]])
    real = torch.tensor([[True, False], [True, True], [False, True]])
    assert depth_stats.last_real_index(real).tolist() == [1, 2]
    s = depth_stats.angle_statistics(depth_stats.angle_moments(before, after, real))
    # real tokens: (0,0) 0, (1,0) 1/2, (1,1) 1/4, (2,1) 1; last real tokens: (1,0) 1/2, (2,1) 1; the pad at
    # (2,0) turns by 0, so taking the last position instead of the last real token gives a different mean
    assert s["mean"] == pytest.approx((0 + 0.5 + 0.25 + 1) / 4, rel=REL)
    assert s["last"] == pytest.approx((0.5 + 1) / 2, rel=REL)


def test_angle_statistics_equal_the_ports_layer_distances():
    """Unpadded: the last-token value is LayerNorm Scaling's ``short_hf.py`` (last token, batch mean), the
    token mean the port's ``last_token=False``."""
    g = torch.Generator().manual_seed(1)
    hiddens = [torch.randn(4, 6, 8, generator=g, dtype=F64) for _ in range(4)]  # (B, T, C)
    real = torch.ones(6, 4, dtype=torch.bool)
    last = port.layer_distances(hiddens, last_token=True, reduce="mean")
    mean = port.layer_distances(hiddens, last_token=False, reduce="mean")
    mixln = port.layer_distances(hiddens, last_token=True, reduce="sum")
    for i in range(3):
        s = depth_stats.angle_statistics(
            depth_stats.angle_moments(hiddens[i].transpose(0, 1), hiddens[i + 1].transpose(0, 1), real)
        )
        assert _close(s["last"], last[i]) and _close(s["mean"], mean[i])
        assert _close(s["last"] * 4, mixln[i])  # MixLN's sum over the batch is the mean times B


def test_max_attention_logit_by_hand():
    # one sentence, 2 queries, 3 keys, 2 heads of dim 1: head h scores q[t, h] * k[s, h]
    q = torch.tensor([[[1.0, -2.0]], [[3.0, 0.5]]])  # (T, B, H * dh)
    k = torch.tensor([[[2.0, 1.0]], [[-1.0, 4.0]], [[10.0, -10.0]]])  # (S, B, H * dh)
    per_head = depth_stats.max_attention_logit(q, k, 2)
    assert per_head.tolist() == [30.0, 20.0]  # head 0: 3 * 10; head 1: -2 * -10
    kpm = torch.tensor([[False, False, True]])  # the third key is padding
    assert depth_stats.max_attention_logit(q, k, 2, key_padding_mask=kpm).tolist() == [6.0, 2.0]
    real = torch.tensor([[True], [False]])  # the second query is padding
    assert depth_stats.max_attention_logit(q, k, 2, real).tolist() == [10.0, 20.0]  # query 1 only: 1 * 10, -2 * -10
    assert depth_stats.max_attention_logit(q, k, 2, real, kpm).tolist() == [2.0, -2.0]
    causal = torch.tensor([[0.0, float("-inf"), float("-inf")], [0.0, 0.0, float("-inf")]])
    assert depth_stats.max_attention_logit(q, k, 2, attn_mask=causal).tolist() == [6.0, 2.0]
    boolean = torch.tensor([[False, True, True], [False, False, True]])
    assert depth_stats.max_attention_logit(q, k, 2, attn_mask=boolean).tolist() == [6.0, 2.0]
    # against the port: per-head maximum of the masked (B, H, T, S) scores
    scores = torch.einsum("thd,shd->hts", q.view(2, 2, 1), k.view(3, 2, 1)).unsqueeze(0)
    scores = scores.masked_fill(kpm.view(1, 1, 1, 3), float("-inf"))
    assert port.max_attention_logit(scores).tolist() == [6.0, 2.0]
    assert depth_stats.megatron_log_max([-3.0, -1.0]) == port.megatron_log_max([torch.tensor([-3.0, -1.0])]) == 0.0
    assert depth_hooks.metrics("logit_all", "", torch.tensor([-2.5], dtype=F64)) == [("diag_max_logit/all", 0.0)]
    assert depth_hooks.metrics("logit", "decoder.layers.0.self_attn", torch.tensor([-2.5], dtype=F64)) == [
        ("diag_max_logit/decoder.layers.0.self_attn", -2.5)
    ]


# ---- on a model: against fairseq's own hidden states and scores -------------------------------


def _padded_batch(n_symbols: int = 50, seed: int = 0) -> dict:
    """Sources left-padded, targets right-padded, as fairseq's translation collater pads them."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 4 + n_symbols, (3, 7), generator=g)
    prev = torch.randint(4, 4 + n_symbols, (3, 6), generator=g)
    src[1, :2] = PAD
    src[2, :4] = PAD
    prev[0, 4:] = PAD
    prev[2, 3:] = PAD
    return {"src_tokens": src, "src_lengths": src.ne(PAD).sum(1), "prev_output_tokens": prev}


def _capture_attention(model) -> tuple[dict, list]:
    store: dict = {}
    handles = []
    for stack in ("encoder", "decoder"):
        for i, layer in enumerate(getattr(model, stack).layers):
            for name, attn in depth_hooks.attention_modules(layer):

                def hook(module, args, kwargs, key=f"{stack}.layers.{i}.{name}"):
                    store[key] = (module, dict(kwargs))

                handles.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
    return store, handles


def _fairseq_scores(module, kwargs: dict) -> torch.Tensor:
    """fairseq's own pre-softmax scores ``(B, H, T, S)`` (masks applied), from its explicit path."""
    kwargs = {**kwargs, "before_softmax": True, "need_weights": False}
    fused = module.skip_embed_dim_check
    # fairseq's own switch off F.multi_head_attention_forward, which ignores before_softmax
    module.skip_embed_dim_check = True
    try:
        scores, _ = module(**kwargs)
    finally:
        module.skip_embed_dim_check = fused
    tgt_len, bsz = kwargs["query"].shape[:2]
    return scores.view(bsz, module.num_heads, tgt_len, -1)


def _logit_tolerance(module, kwargs: dict) -> float:
    q = module.q_proj(kwargs["query"]) * module.scaling
    kv = kwargs["query"] if module.self_attention else kwargs["key"]
    k = module.k_proj(kv)
    t, b = q.shape[:2]
    s = k.shape[0]
    h, dh = module.num_heads, module.head_dim
    bound = torch.einsum("tbhd,sbhd->bhts", q.abs().double().view(t, b, h, dh), k.abs().double().view(s, b, h, dh))
    return 2 * dh * 2.0**-24 * bound.max().item()


@pytest.mark.parametrize("impl", ["fairseq", "sdpa"])
@pytest.mark.parametrize("arch", ["preln_iwslt_de_en", "postln_iwslt_de_en"])
def test_depth_statistics_equal_fairseqs_hidden_states_and_scores(arch, impl):
    model, _ = build_model(arch, *TINY_DIMS, *NO_DROPOUT, "--attention-impl", impl)
    model.eval()
    net = _padded_batch()
    store, handles = _capture_attention(model)
    with torch.no_grad(), depth_hooks.DepthStatistics(model, net) as depth:
        model(**net)
    for h in handles:
        h.remove()
    values = depth.values()
    with torch.no_grad():
        enc = model.encoder(net["src_tokens"], net["src_lengths"], return_all_hiddens=True)
        _, extra = model.decoder(net["prev_output_tokens"], encoder_out=enc, features_only=True)
    states = {"encoder": enc["encoder_states"], "decoder": extra["inner_states"]}
    pads = {"encoder": net["src_tokens"].eq(PAD), "decoder": net["prev_output_tokens"].eq(PAD)}
    assert len(states["encoder"]) == len(states["decoder"]) == 3  # embedding output, then 2 layers
    for stack, hs in states.items():
        pad = pads[stack]
        bf = [h.detach().double().transpose(0, 1) for h in hs]  # batch-first, as the port takes them
        for depth_i, h in enumerate(bf):
            name = f"{stack}.input" if depth_i == 0 else f"{stack}.layers.{depth_i - 1}"
            assert _close(values[f"diag_stream_norm/{name}"], port.residual_norms([h], pad)[0]), name
            per_sentence = [port.gap_activation_stats(h[b][~pad[b]].unsqueeze(0))["var"] for b in range(h.size(0))]
            assert _close(values[f"diag_stream_var/{name}"], sum(per_sentence) / len(per_sentence)), name
            assert values[f"diag_stream_max/{name}"] == port.gap_activation_stats(h[~pad].unsqueeze(0))["max"], name
        for i in range(1, len(bf)):
            a, b = bf[i - 1], bf[i]
            name = f"{stack}.layers.{i - 1}"
            assert _close(values[f"diag_angle/{name}"], port.angular_distance(a[~pad], b[~pad]).mean().item()), name
            last = (~pad).long().cumsum(1).argmax(1)  # the last real position of each sentence
            rows = torch.arange(a.size(0))
            expected = port.angular_distance(a[rows, last], b[rows, last]).mean().item()  # short_hf.py's mean
            assert _close(values[f"diag_angle_last/{name}"], expected), name
    # the maximum logit of every attention: fairseq's own masked scores over the real queries
    logged = [k.split("/", 1)[1] for k in values if k.startswith("diag_max_logit/") and not k.endswith("/all")]
    assert sorted(store) == sorted(logged)
    overall = 0.0
    for name, (module, kwargs) in store.items():
        with torch.no_grad():
            scores = _fairseq_scores(module, kwargs)
            tol = _logit_tolerance(module, kwargs)
        stack_pad = pads[name.split(".")[0]]
        scores = scores.masked_fill(stack_pad.view(scores.size(0), 1, -1, 1), float("-inf"))
        expected = port.max_attention_logit(scores).max().item()
        measured = values[f"diag_max_logit/{name}"]
        assert abs(measured - expected) <= tol, (name, measured, expected)
        overall = max(overall, expected)
    assert values["diag_max_logit/all"] == pytest.approx(overall, abs=1e-5)


def test_depth_statistics_of_a_language_model():
    """One stack, read from ``src_tokens``; against fairseq's ``inner_states``."""
    from fairseq import options, tasks

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, ["/nonexistent", "--task", "language_modeling", "--arch", "preln_lm_tiny", *NO_DROPOUT]
    )
    d = make_dictionary()
    task = tasks.TASK_REGISTRY["language_modeling"](args, d, d)
    torch.manual_seed(1)
    model = task.build_model(args).eval()
    src = torch.randint(4, 54, (2, 8), generator=torch.Generator().manual_seed(2))
    src[1, 5:] = PAD
    net = {"src_tokens": src, "src_lengths": src.ne(PAD).sum(1)}
    with torch.no_grad(), depth_hooks.DepthStatistics(model, net) as depth:
        model(**net)
        _, extra = model(**net)
    values = depth.values()  # two identical forward passes: the pooled statistics are one pass's
    assert not any(".encoder" in k or "encoder." in k for k in values)
    pad = src.eq(PAD)
    hs = [h.double().transpose(0, 1) for h in extra["inner_states"]]
    for i, h in enumerate(hs):
        name = "decoder.input" if i == 0 else f"decoder.layers.{i - 1}"
        assert _close(values[f"diag_stream_norm/{name}"], port.residual_norms([h], pad)[0])
    n_layers = len(model.decoder.layers)
    assert len(depth_hooks.by_depth(values)["angle"]["decoder"]) == n_layers
    assert list(depth_hooks.by_depth(values)["max_logit"]) == ["decoder.self_attn"]


def test_a_layer_that_did_not_run_keeps_its_entries_and_logs_nothing():
    """LayerDrop: every rank must hold the same keys in the same order (fairseq all-reduces logging outputs
    as one flat buffer), so a layer that was dropped gives empty moments and a ``-inf`` maximum, and no metric."""
    model, _ = build_model("preln_iwslt_de_en", *TINY_DIMS, *NO_DROPOUT, "--encoder-layerdrop", "0.999")
    model.train()  # LayerDrop drops in training only
    net = _padded_batch()
    with torch.no_grad(), depth_hooks.DepthStatistics(model, net) as dropped:
        model(**net)
    model.eval()
    with torch.no_grad(), depth_hooks.DepthStatistics(model, net) as full:
        model(**net)
    assert list(dropped.sums()) == list(full.sums()) and list(dropped.maxima()) == list(full.maxima())
    values = dropped.values()
    assert not any(k.split("/", 1)[1].startswith("encoder.") for k in values if "/" in k)
    assert set(values) < set(full.values()) and "diag_stream_norm/decoder.layers.1" in values
    assert dropped.sums()["stream|encoder.layers.0"].tolist() == [0.0] * 4
    assert dropped.maxima()["logit|encoder.layers.1.self_attn"].item() == -math.inf


# ---- the criterion: micro-batches pooled, maxima kept out of the summed logging outputs -------


def _sample(net: dict) -> dict:
    target = torch.roll(net["prev_output_tokens"], -1, dims=1)
    return {"net_input": net, "target": target, "ntokens": int(target.ne(PAD).sum()), "id": torch.arange(3)}


def test_criterion_pools_micro_batches_and_logs_maxima_on_diagnostic_updates_only():
    from fairseq.tasks.translation import TranslationTask

    model, args = build_model("preln_iwslt_de_en", *TINY_DIMS, *NO_DROPOUT)
    d = make_dictionary()
    task = TranslationTask(args, d, d)
    crit = DiagnosticsCriterion(task, False, 0.1, diagnostics_interval=2)
    batches = [_padded_batch(seed=0), _padded_batch(seed=1)]
    separately = []
    model.train()  # no dropout: the same values as in eval mode
    for net in batches:
        with torch.no_grad(), depth_hooks.DepthStatistics(model, net) as depth:
            model(**net)
        separately.append(depth)

    crit.begin_update(1, model, None, _sample(batches[0]))  # update 2 of --diagnostics-interval 2
    logs = [crit(model, _sample(net))[2] for net in batches]
    assert not any(k.startswith("_diag|stream_max") or k.startswith("_diag|logit") for log in logs for k in log)
    with metrics.aggregate() as agg:
        task.reduce_metrics(logs, crit)
    values = agg.get_smoothed_values()
    first, second = separately
    pooled_sums = {k: first.sums()[k] + second.sums()[k] for k in first.sums()}
    pooled_max = {k: torch.maximum(first.maxima()[k], second.maxima()[k]) for k in first.maxima()}
    expected = depth_hooks.read_values(pooled_sums, pooled_max)
    for key, v in expected.items():
        assert values[key] == pytest.approx(v, rel=1e-12), key
    one = separately[0].values()
    assert any(one[k] != expected[k] for k in one if k.startswith("diag_max_logit/"))  # the max is over both batches

    crit.begin_update(2, model, None, _sample(batches[0]))  # update 3: not a diagnostic one
    log = crit(model, _sample(batches[0]))[2]
    assert not any(k.startswith("_diag") for k in log)
    with metrics.aggregate() as agg:
        task.reduce_metrics([log], crit)
    assert not any(k.startswith("diag_") for k in agg.get_smoothed_values())


def test_no_host_read_on_plain_updates_and_one_copy_with_every_new_statistic():
    """The no-host-read rule with only the new statistics selected: a plain update reads nothing from the device,
    a diagnostic one reads everything in one copy (meta device, as tests/test_gpu_readiness.py)."""
    from deepinit_tools.bench import gpu_readiness as gr
    from deepinit_tools.harness.fairseq_train import Shape

    extra = ("--criterion", "label_smoothed_cross_entropy_diagnostics", "--diagnostics-interval", "2",
             "--diagnostics-stats", "stream,angle,logit,counters")  # fmt: skip
    shape = Shape(2, 16, 32, 2)
    b = gr.build("mt", "preln_iwslt_de_en", shape, *extra)
    sample = gr.batch("mt")
    assert gr.reads(lambda: gr.update(b, sample, 0), meta=False).count() == 0
    mb = gr.build("mt", "preln_iwslt_de_en", shape, *extra, meta=True)
    ms = gr.batch("mt", "meta")
    gr.update(mb, ms, 0)
    diag = gr.reads(lambda: gr.update(mb, ms, 1), meta=True)
    assert [e.op for e in diag.events] == ["_to_copy"], diag.lines()  # the logged keys: the CLI test below


# ---- the loss with one layer removed ---------------------------------------------------------


def _manual_logits(model, net: dict, stack: str | None, skip: int | None) -> torch.Tensor:
    """The model's forward pass written out with its own modules, ``skip`` of ``stack`` left out
    (the port's ``forward_without_layer``: the removed layer is the identity)."""
    enc, dec = model.encoder, model.decoder
    src, prev = net["src_tokens"], net["prev_output_tokens"]
    src_pad = src.eq(enc.padding_idx)
    x, _ = enc.forward_embedding(src)
    x = (x * (1 - src_pad.unsqueeze(-1).type_as(x))).transpose(0, 1)
    enc_layers = [lambda h, layer=layer: layer(h, encoder_padding_mask=src_pad) for layer in enc.layers]
    enc_out = port.forward_without_layer(
        x, enc_layers, skip if stack == "encoder" else None, enc.layer_norm or (lambda h: h)
    )
    y = dec.embed_scale * dec.embed_tokens(prev) + dec.embed_positions(prev)
    y = y.transpose(0, 1)
    future = torch.full((y.size(0), y.size(0)), float("-inf")).triu(1)
    self_pad = dec.self_attn_padding_mask(prev, causal=True, mask_padding=False)
    dec_layers = [
        lambda h, layer=layer: layer(h, enc_out, src_pad, None, self_attn_mask=future, self_attn_padding_mask=self_pad)
        for layer in dec.layers
    ]
    dec_layers = [lambda h, f=f: f(h)[0] for f in dec_layers]
    final = lambda h: dec.output_layer((dec.layer_norm(h) if dec.layer_norm is not None else h).transpose(0, 1))
    return port.forward_without_layer(y, dec_layers, skip if stack == "decoder" else None, final)


def _manual_losses(logits: torch.Tensor, target: torch.Tensor, eps: float) -> dict:
    """fairseq's label-smoothed loss by hand (label_smoothed_cross_entropy.py ``label_smoothed_nll_loss``:
    ``(1 - eps - eps / (V - 1)) * nll + eps / (V - 1) * smooth``), summed in float64, in base 2 per token."""
    lprobs = torch.log_softmax(logits.float(), dim=-1).double()
    keep = target.ne(PAD)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)[keep].sum()
    smooth = -lprobs.sum(-1)[keep].sum()
    eps_i = eps / (lprobs.size(-1) - 1)
    loss = (1 - eps - eps_i) * nll + eps_i * smooth
    n = keep.sum().item()
    base2 = n * math.log(2)
    return {"loss": loss.item() / base2, "nll_loss": nll.item() / base2, "terms": n * lprobs.size(-1)}


@pytest.mark.parametrize("arch", ["preln_iwslt_de_en", "postln_iwslt_de_en"])
def test_removal_loss_equals_a_forward_written_out_by_hand(arch):
    from fairseq.tasks.translation import TranslationTask

    model, args = build_model(arch, *TINY_DIMS)  # dropout 0.3: the measurement runs in eval mode
    d = make_dictionary()
    crit = DiagnosticsCriterion(TranslationTask(args, d, d), False, 0.1)
    batches = [_sample(_padded_batch(seed=0)), _sample(_padded_batch(seed=3))]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers_before = [list(model.encoder.layers), list(model.decoder.layers)]
    model.train()
    result = layer_removal.removal_losses(model, crit, batches)
    assert model.training  # the mode it was in
    assert [list(model.encoder.layers), list(model.decoder.layers)] == layers_before  # put back, in order
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    model.eval()

    def by_hand(stack, skip):
        with torch.no_grad():
            logits = [_manual_logits(model, b["net_input"], stack, skip) for b in batches]
            parts = [_manual_losses(x, b["target"], 0.1) for x, b in zip(logits, batches, strict=True)]
        n = [b["target"].ne(PAD).sum().item() for b in batches]
        mean = {k: sum(p[k] * m for p, m in zip(parts, n, strict=True)) / sum(n) for k in ("loss", "nll_loss")}
        # two float32 sums in another order: n_terms * 2**-24 relative (criterion) plus float64 (by hand)
        return mean, 2 * sum(p["terms"] for p in parts) * 2.0**-24

    full, tol = by_hand(None, None)
    assert result["full"]["loss"] == pytest.approx(full["loss"], rel=tol)
    assert result["full"]["nll_loss"] == pytest.approx(full["nll_loss"], rel=tol)
    for stack in ("encoder", "decoder"):
        assert len(result[stack]) == 2
        for i, measured in enumerate(result[stack]):
            expected, tol = by_hand(stack, i)
            assert measured["loss"] == pytest.approx(expected["loss"], rel=tol), (stack, i)
            assert measured["nll_loss"] == pytest.approx(expected["nll_loss"], rel=tol), (stack, i)
            assert abs(measured["loss"] - result["full"]["loss"]) > 1e-4  # removing a layer changes the loss
        assert result[stack][0]["loss"] != result[stack][1]["loss"]


def test_removed_layer_refuses_an_index_outside_the_stack():
    model, _ = build_model("preln_iwslt_de_en", *TINY_DIMS)
    with pytest.raises(IndexError):
        with layer_removal.removed_layer(model.encoder.layers, 2):
            pass
    assert len(model.encoder.layers) == 2


# ---- the counters ------------------------------------------------------------------------------


def test_spike_detector_follows_olmo_cores_rule():
    g = torch.Generator().manual_seed(4)
    values = (3.0 - 0.01 * torch.arange(60, dtype=F64) + 0.05 * torch.randn(60, generator=g, dtype=F64)).tolist()
    for i in (12, 30, 31, 50):
        values[i] += 1.5  # spikes (30 and 31 back to back: the second is judged with the first in its window)
    values[40] += 0.2  # a bump below the threshold
    for window, threshold in ((8, 3.0), (16, 6.0), (4, 2.0)):
        flags = port.olmo_spike_flags(values, window, threshold)
        det = training_counters.SpikeDetector(window, threshold)
        counts = []
        for v in values:
            det.observe(torch.tensor(v, dtype=F64))
            counts.append(det.take().item())
        assert counts == [float(f) for f in flags], (window, threshold)
    assert sum(port.olmo_spike_flags(values, 8, 3.0)) >= 3  # the case exercises the rule
    # edge cases of the rule: the window fills before anything is judged (a jump at the 4th value is not
    # judged), and a window without spread judges nothing (std < 1e-10), not even a jump
    for edge in ([1.0, 1.1, 0.9, 100.0, 1.0], [2.0] * 6 + [3.0]):
        det = training_counters.SpikeDetector(4, 1.0)
        for v in edge:
            det.observe(torch.tensor(v, dtype=F64))
        assert det.take().item() == sum(port.olmo_spike_flags(edge, 4, 1.0)) == 0.0, edge


def test_spikes_reach_the_criterion_through_the_updates_logging_outputs():
    from fairseq.tasks.translation import TranslationTask

    model, args = build_model("preln_iwslt_de_en", *TINY_DIMS)
    d = make_dictionary()
    task = TranslationTask(args, d, d)
    crit = DiagnosticsCriterion(
        task, False, 0.1, diagnostics_interval=10, diagnostics_spike_window=4, diagnostics_spike_threshold=2.0
    )
    losses = [5.0, 4.9, 4.8, 4.85, 4.7, 9.0, 4.6, 4.5, 4.55, 4.4]
    gnorms = [1.0, 1.1, 0.9, 1.0, 1.05, 1.0, 30.0, 1.0, 0.95, 1.0]
    crit._run.model = model.train()
    for u, (loss, gn) in enumerate(zip(losses, gnorms, strict=True)):
        crit._run.collect = u == 9
        crit._run.update_num = u
        crit._run.grad_norm = torch.tensor(gn)
        out = crit.take_depth_statistics([{"loss": torch.tensor(loss * 100), "sample_size": 100}])
    assert out["_diag|scalar|diag_loss_spikes"].item() == sum(port.olmo_spike_flags(losses, 4, 2.0)) == 1
    assert out["_diag|scalar|diag_gnorm_spikes"].item() == sum(port.olmo_spike_flags(gnorms, 4, 2.0)) == 1
    model.eval()  # validation reduces its logging outputs through the same task: not an update
    crit._run.collect = False
    assert crit.take_depth_statistics([{"loss": torch.tensor(1e6), "sample_size": 1}]) is None
    assert crit._depth.counters.loss.seen == 10


class _FakeFP16:
    """An optimizer whose ``clip_grad_norm`` runs fairseq's DynamicLossScaler check, as FP16Optimizer does."""

    def __init__(self, scaler) -> None:
        self.scaler = scaler
        self.norms: list = []

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        norm = self.norms.pop(0)
        self.scaler.check_overflow(norm)
        self.scaler.update()  # what the optimizer step after a finite norm does (fp16_optimizer.py:225-226)
        return torch.tensor(norm)

    def zero_grad(self):
        pass


class _FakeAMP:
    """torch's GradScaler keeps its scale on the device: a non-finite norm is a drop (amp_optimizer.py:52-69)."""

    scaler = object()

    def __init__(self):
        self.norms = [torch.tensor(1.0), torch.tensor(float("inf")), torch.tensor(float("nan"))]

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        return self.norms.pop(0)

    def zero_grad(self):
        pass


def test_loss_scale_drops_are_counted_for_fp16_and_amp():
    """Through the criterion's ``clip_grad_norm`` tap (:func:`taps.wrap_optimizer`), as fairseq's trainer calls it."""
    from fairseq.tasks.translation import TranslationTask

    model, args = build_model("deepinit_tiny")
    d = make_dictionary()
    crit = DiagnosticsCriterion(
        TranslationTask(args, d, d), False, 0.1, diagnostics_stats="counters", no_divergence_guard=True
    )
    opt = _FakeFP16(DynamicLossScaler(init_scale=8.0, scale_window=2, min_loss_scale=1.0))
    crit.begin_update(0, model, opt, {})
    crit.begin_update(0, model, opt, {})  # wrapped once per optimizer
    opt.norms = [1.0, float("inf"), 2.0, float("nan"), float("inf")]
    outcomes = []
    for _ in range(5):
        try:
            opt.clip_grad_norm(0.0)
            outcomes.append("ok")
        except OverflowError:
            outcomes.append("overflow")
        except FloatingPointError:  # the minimum scale: fairseq restores the previous scale and gives up
            outcomes.append("min")
    assert outcomes == ["ok", "overflow", "ok", "overflow", "min"]
    assert opt.scaler.loss_scale == 2.0  # 8 -> 4 -> 2; the last overflow would reach the minimum 1: restored
    counters = crit._depth.counters
    counters.loss.observe(torch.tensor(1.0))
    assert counters.take()[training_counters.SCALE_DROPS].item() == 2.0
    assert counters.take()[training_counters.SCALE_DROPS].item() == 0.0  # reset

    amp = _FakeAMP()
    crit.begin_update(1, model, amp, {})
    for _ in range(3):
        amp.clip_grad_norm(0.0)
    assert counters.take()[training_counters.SCALE_DROPS].item() == 2.0


def test_counters_off_leave_clip_grad_norm_alone():
    """Without ``counters`` (or with ``--diagnostics-interval 0``) the tap reads no loss scale and counts nothing."""
    from fairseq.tasks.translation import TranslationTask

    model, args = build_model("deepinit_tiny")
    d = make_dictionary()
    for kwargs in (dict(diagnostics_stats="var,stream"), dict(diagnostics_interval=0)):
        crit = DiagnosticsCriterion(TranslationTask(args, d, d), False, 0.1, no_divergence_guard=True, **kwargs)
        assert crit._depth.counters is None
        opt = _FakeFP16(DynamicLossScaler(init_scale=8.0, scale_window=2, min_loss_scale=1.0))
        crit.begin_update(0, model, opt, {})
        opt.norms = [float("inf")]
        with pytest.raises(OverflowError):
            opt.clip_grad_norm(0.0)
        assert crit._depth.loss_scale(opt) is None
        assert crit._depth.take(model.train(), 0, True, [{"loss": torch.tensor(1.0)}], None) is None


def test_bad_counter_options_are_refused():
    from fairseq.tasks.translation import TranslationTask

    _, args = build_model("deepinit_tiny")
    d = make_dictionary()
    task = TranslationTask(args, d, d)
    with pytest.raises(DeepInitConfigError, match="--diagnostics-spike-window must be an integer >= 2"):
        DiagnosticsCriterion(task, False, 0.1, diagnostics_spike_window=1)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(DeepInitConfigError, match="--diagnostics-spike-threshold must be a finite number"):
            DiagnosticsCriterion(task, False, 0.1, diagnostics_spike_threshold=bad)


# ---- one shared fairseq-train run: training log, TensorBoard, deepinit-diagnose ----------------

INTERVAL_UPDATES = [2, 4]


def _new_keys(prefix_layers: dict) -> list:
    keys = ["diag_max_logit/all", "diag_loss_spikes", "diag_gnorm_spikes", "diag_loss_scale_drops"]
    for stack, attns in prefix_layers.items():
        for stat in ("stream_norm", "stream_var", "stream_max"):
            keys.append(f"diag_{stat}/{stack}.input")
        for i in range(2):
            for stat in ("stream_norm", "stream_var", "stream_max", "angle", "angle_last"):
                keys.append(f"diag_{stat}/{stack}.layers.{i}")
            keys += [f"diag_max_logit/{stack}.layers.{i}.{a}" for a in attns]
    return keys


NEW_KEYS = _new_keys({"encoder": ["self_attn"], "decoder": ["self_attn", "encoder_attn"]})


@pytest.fixture(scope="module")
def trained(synthetic_bin, tmp_path_factory):
    """4 updates of a tiny Pre-LN model, statistics on updates 2 and 4, json log and TensorBoard."""
    root = tmp_path_factory.mktemp("depth_run")
    proc = run_cli(
        "train", synthetic_bin, "--user-dir", USER_DIR, "--arch", "preln_iwslt_de_en", *TINY_DIMS,
        "--criterion", "label_smoothed_cross_entropy_diagnostics", "--label-smoothing", "0.1",
        "--diagnostics-interval", "2", "--diagnostics-spike-window", "2", "--optimizer", "adam", "--lr", "1e-3",
        "--max-tokens", "500", "--max-update", "4", "--log-interval", "1", "--log-format", "json",
        "--disable-validation", "--save-dir", root / "ckpt", "--no-epoch-checkpoints", "--seed", "3",
        "--tensorboard-logdir", root / "tb",
    )  # fmt: skip
    (root / "train.log").write_text(proc.stdout)
    return root, proc.stdout


def test_new_statistics_reach_the_training_log_on_diagnostic_updates_only(trained):
    _, out = trained
    lines = [json.loads(line[line.index("{") :]) for line in out.splitlines() if "| train_inner |" in line]
    assert [int(line["num_updates"]) for line in lines] == [1, 2, 3, 4]
    for line in lines:
        new = [k for k in NEW_KEYS if k in line]
        assert new == (NEW_KEYS if int(line["num_updates"]) in INTERVAL_UPDATES else []), line["num_updates"]
    for line in lines[1::2]:
        v = {k: float(line[k]) for k in NEW_KEYS}
        assert all(math.isfinite(x) for x in v.values())
        assert all(v[k] > 0 for k in v if k.startswith(("diag_stream_norm", "diag_stream_max", "diag_stream_var")))
        assert all(0 <= v[k] <= 1 for k in v if k.startswith("diag_angle"))
        per_layer = [v[k] for k in v if k.startswith("diag_max_logit/") and not k.endswith("/all")]
        assert v["diag_max_logit/all"] == pytest.approx(max(0.0, *per_layer), rel=1e-3)  # the log rounds
        assert all(v[k] >= 0 and v[k] == int(v[k]) for k in ("diag_loss_spikes", "diag_gnorm_spikes"))
        assert v["diag_loss_scale_drops"] == 0  # fp32


def test_new_statistics_reach_tensorboard(trained):
    from test_tensorboard import scalars

    root, _ = trained
    inner = scalars(root / "tb")["train_inner"]
    for key in NEW_KEYS:
        assert [step for step, _ in inner.get(key, [])] == INTERVAL_UPDATES, key
        assert all(math.isfinite(v) for _, v in inner[key])


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000, path


def test_diagnose_measures_depth_and_removal_on_the_checkpoint_and_plots_the_log(trained, synthetic_bin, tmp_path):
    root, _ = trained
    out = tmp_path / "diag"
    argv = [str(synthetic_bin), "--checkpoint", str(root / "ckpt" / "checkpoint_last.pt"), "--output-dir", str(out),
            "--measure", "depth,removal", "--subset", "valid", "--max-tokens", "400", "--num-batches", "2"]  # fmt: skip
    assert diagnose.main(argv) == 0
    result = json.loads((out / "diagnostics.json").read_text())
    depth = result["depth"]
    for stat in ("stream_norm", "stream_var", "stream_max"):
        assert [len(depth[stat][s]) for s in ("encoder", "decoder")] == [3, 3]  # input and 2 layers
    for stat in ("angle", "angle_last"):
        assert [len(depth[stat][s]) for s in ("encoder", "decoder")] == [2, 2]
    assert sorted(depth["max_logit"]) == ["decoder.encoder_attn", "decoder.self_attn", "encoder.self_attn"]
    removal = result["layer_removal"]
    assert len(removal["encoder"]) == len(removal["decoder"]) == 2 and removal["full"]["loss"] > 0
    assert removal["decoder_increase"][0] == pytest.approx(removal["decoder"][0]["loss"] - removal["full"]["loss"])
    for png in ("residual_stream.png", "angular_distance.png", "max_attention_logit.png", "layer_removal.png"):
        _assert_png(out / png)
        assert str(out / png) in result["plots"]

    logs = tmp_path / "log"
    assert diagnose.main(["--training-log", str(root / "train.log"), "--output-dir", str(logs)]) == 0
    for stat in ("stream_norm", "stream_var", "stream_max", "angle", "angle_last", "max_logit", "counters"):
        _assert_png(logs / f"training_{stat}.png")


def test_training_log_reads_simple_and_json_lines_and_refuses_a_log_without_statistics(tmp_path, capsys):
    simple = tmp_path / "simple.log"
    simple.write_text(
        "2026-11-25 10:00:00 | INFO | train_inner | epoch 001:      2 / 8 loss=7.1, num_updates=2, "
        "diag_stream_norm/encoder.input=8.5, diag_stream_norm/encoder.layers.0=9.25, "
        "diag_angle/encoder.layers.0=0.125, "
        "diag_max_logit/encoder.layers.0.self_attn=3.5, diag_max_logit/all=3.5, diag_loss_spikes=1, wall=3\n"
        '2026-11-25 10:00:01 | INFO | train_inner | {"epoch": 1, "num_updates": "4", "diag_stream_norm/encoder.input": '
        '"8.75", "diag_loss_spikes": "0"}\n'
        "2026-11-25 10:00:02 | INFO | train_inner | epoch 001:      5 / 8 loss=7.0, num_updates=5, wall=4\n"
    )
    records = depth_diagnose.read_training_log(str(simple))
    assert [r["num_updates"] for r in records] == [2, 4]
    assert records[0]["diag_angle/encoder.layers.0"] == 0.125 and records[1]["diag_stream_norm/encoder.input"] == 8.75
    curves = depth_hooks.by_depth(records[0])
    assert curves["stream_norm"] == {"encoder": [8.5, 9.25]} and curves["max_logit"] == {"encoder.self_attn": [3.5]}
    assert curves["max_logit_all"] == 3.5

    empty = tmp_path / "empty.log"
    empty.write_text("2026-11-25 10:00:00 | INFO | train_inner | epoch 001: 1 / 8 loss=7.1, num_updates=1\n")
    assert diagnose.main(["--training-log", str(empty), "--output-dir", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no train_inner line with diagnostics" in err[0]
    assert diagnose.main(["--training-log", str(tmp_path / "missing.log"), "--output-dir", str(tmp_path / "o")]) == 1
    assert "not found" in capsys.readouterr().err
