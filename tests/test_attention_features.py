"""Gated attention, learned attention sinks and value residual (``fairseq_deepinit/methods/{gated_attention,sinks,
value_residual}.py``, ``modules/attention_features.py``) against the independent ports of the released code
(``tests/ports/{gated_attention,attention_sinks,value_residual,common}.py``): each attention kind (encoder self,
decoder self with the future mask, decoder cross with source padding) on both ``--attention-impl`` paths with the
plugin's weights copied into the port, the value-residual stacks of a translation encoder and a language model,
fairseq's beam search and step-by-step decoding equal to the full forward, the refusals, the export's refusal,
and fairseq-train for every family.

Tolerances follow the float path (as ``tests/test_qk_norm.py`` derives them): the models run in float64; fairseq's
explicit path (and so the plugin's written-out copy of it) rounds the softmax to float32, bounded by
:func:`test_qk_norm.attention_tolerance`; the SDPA path stays in float64 (``1e3 u_64``-scale). A gate left out,
placed after ``out_proj``, a sink dropped or counted twice, a value mix with the other weight move the outputs by
1e-3 to 1: far beyond.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from ports import common
from ports import value_residual as vr_port
from test_lm import build_lm, tokens
from test_qk_norm import U32, _beam_hypotheses_scored_by_a_full_forward, attention_tolerance

from conftest import TINY_DIMS, USER_DIR, build_model, run_cli
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.modules.attention_features import FeatureAttention

F64 = torch.float64
HEADS = ("--encoder-attention-heads", "4", "--decoder-attention-heads", "4")
NO_DROPOUT = ("--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0")
FAMILIES = ("gatedattn", "sinks", "valueres")
IMPLS = ("fairseq", "sdpa")


def model(family: str, *cli: str, seed: int = 1):
    m, args = build_model(f"{family}_iwslt_de_en", *TINY_DIMS, *HEADS, *NO_DROPOUT, *cli, seed=seed)
    return m.double().eval(), args


def randomise(m: torch.nn.Module, seed: int) -> None:
    """Every parameter away from its init (a zero sink or a zero gate bias would hide a misplaced one)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.5 if p.dim() == 1 else p.size(-1) ** -0.5))


def port_kwargs(attn: FeatureAttention, x_q: torch.Tensor) -> dict:
    """The port's ``gate`` (logits from the plugin's gate projection, batch-first) and ``sink``."""
    kw: dict = {}
    if attn.gate is not None:
        kw["gate"] = common.linear(x_q, attn.gate.proj.weight.detach(), attn.gate.proj.bias.detach())
    if attn.sinks is not None:
        kw["sink"] = attn.sinks.detach()
    return kw


KINDS = ("encoder-self", "decoder-self", "cross")


def _attention_case(kind: str, m):
    """(attention module, query (T, B, C), key (S, B, C) or None, plugin kwargs, port kwargs)."""
    g = torch.Generator().manual_seed(7)
    B, T, S, C = 3, 5, 6, 64
    x = torch.randn(T, B, C, generator=g, dtype=F64)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[0, :2], pad[2, :1] = True, True  # left-padded sources, as fairseq collates them
    if kind == "encoder-self":
        attn, mem = m.encoder.layers[1].self_attn, torch.randn(T, B, C, generator=g, dtype=F64)
        kpm = pad[:, :T]
        plugin = dict(query=mem, key=mem, value=mem, key_padding_mask=kpm, need_weights=False)
        return attn, mem, mem, plugin, dict(key_padding_mask=kpm)
    if kind == "decoder-self":
        attn = m.decoder.layers[1].self_attn
        future = torch.triu(torch.full((T, T), float("-inf"), dtype=F64), 1)
        plugin = dict(query=x, key=x, value=x, attn_mask=future, need_weights=False)
        return attn, x, x, plugin, dict(causal=True)
    attn, mem = m.decoder.layers[1].encoder_attn, torch.randn(S, B, C, generator=g, dtype=F64)
    plugin = dict(query=x, key=mem, value=mem, key_padding_mask=pad, static_kv=True, need_weights=False)
    return attn, x, mem, plugin, dict(key_padding_mask=pad)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "family,cli",
    [("gatedattn", ()), ("gatedattn", ("--gated-attention-granularity", "elementwise")), ("sinks", ())],
    ids=["gate-headwise", "gate-elementwise", "sinks"],
)
def test_attention_equals_the_port(family, cli, kind, impl):
    """Each attention kind of a translation model, the plugin's module against ``ports.common.attention`` with
    the plugin's weights (gate projection, sinks) copied in."""
    m, _ = model(family, "--attention-impl", impl, *cli)
    attn, x_q, x_kv, plugin_kw, port_kw = _attention_case(kind, m)
    assert isinstance(attn, FeatureAttention) and attn.fused == (impl == "sdpa")
    randomise(attn, 3)
    with torch.no_grad():
        got = attn(**plugin_kw)[0].transpose(0, 1)
        q, kv = x_q.transpose(0, 1), x_kv.transpose(0, 1)
        w = common.AttnWeights.from_module(attn)
        want, logits = common.attention(q, kv, w, attn.num_heads, return_logits=True, **port_kw, **port_kwargs(attn, q))
    u = U32 if impl == "fairseq" else 2.0**-53
    tol = attention_tolerance(logits, common.linear(kv, w.wv, w.bv), w.wo, u)
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


def test_sinks_sdpa_form_equals_the_explicit_path_and_trains_the_sink():
    """The fused form (one more head dimension, a dropped leading query under ``is_causal``) and fairseq's
    explicit path give the same outputs and the same gradient to every sink, in float64."""
    m, _ = model("sinks", "--attention-impl", "sdpa")
    attn, *_rest, plugin_kw, _ = _attention_case("decoder-self", m)
    randomise(attn, 5)
    attn.causal_self_attention = True  # as the decoder declares it: the future mask is is_causal
    grads = []
    for fused in (True, False):
        attn.fused = fused
        attn.zero_grad()
        out = attn(**plugin_kw)[0]
        out.pow(2).sum().backward()
        grads.append((out.detach(), attn.sinks.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-6)
    assert grads[0][1].abs().min() > 0


def _port_stack(x, layers, heads, first_values_mix, causal, key_padding_mask=None):
    """A Pre-LN stack of the port's blocks where layer ``l > 1`` attends with ``first_values_mix(v, v1, h)``."""
    v1 = None
    for i, lay in enumerate(layers):
        h = lay["norm_attn"](x)
        kw = dict(causal=causal, key_padding_mask=key_padding_mask)
        if i == 0:
            v1 = vr_port.first_values(h, lay["attn_w"])
            x = x + common.attention(h, h, lay["attn_w"], heads, **kw)
        else:
            fn = lambda v, v1=v1, h=h, lay=lay: first_values_mix(v, v1, h, lay)  # noqa: E731
            x = x + common.attention(h, h, lay["attn_w"], heads, v_fn=fn, **kw)
        x = x + common.ffn(lay["norm_ffn"](x), lay["ffn_w"])
    return x


def _mix(learned: bool):
    def fixed(v, v1, h, lay):
        return vr_port.resformer_mix(v, v1)

    def learned_mix(v, v1, h, lay):
        mix = torch.sigmoid(common.linear(h, lay["wm"], lay["bm"]))
        return vr_port.xtransformers_mix(v, v1, mix, 4)

    return learned_mix if learned else fixed


def _layers(stack) -> list:
    layers = common.lm_layers(stack)
    for lay, layer in zip(layers, stack.layers, strict=True):
        mix = layer.self_attn.value_mix
        if mix is not None and mix.mix is not None:
            lay["wm"], lay["bm"] = mix.mix.weight.detach(), mix.mix.bias.detach()
    return layers


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("learned", [False, True], ids=["fixed", "learned"])
def test_value_residual_stacks_equal_the_port(learned, impl):
    """A translation encoder (padded sources) and a language model's decoder against the port's Pre-LN stack with
    ResFormer's mix (``resformer_mix``, 0.5/0.5) or x-transformers' learned one (``xtransformers_mix``)."""
    cli = ("--value-residual-learned",) if learned else ()
    m, _ = model("valueres", "--attention-impl", impl, "--encoder-layers", "3", *cli)
    randomise(m.encoder.layers, 9)
    src = torch.randint(4, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    src[0, :2] = 1  # padding
    with torch.no_grad():
        enc = m.encoder(src, torch.tensor([5, 7]))
        got = enc["encoder_out"][0].transpose(0, 1)
        x = m.encoder.embed_scale * m.encoder.embed_tokens(src) + m.encoder.embed_positions(src)
        pad = src.eq(1)
        want = _port_stack(x, _layers(m.encoder), 4, _mix(learned), False, pad)
        want = common.NormSpec.from_module(m.encoder.layer_norm)(want)
    real = ~pad
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5 if impl == "fairseq" else 1e-10)

    lm, _, _ = build_lm("valueres_lm_tiny", "--attention-impl", impl, "--dropout", "0", *cli)
    lm = lm.double().eval()
    randomise(lm.decoder.layers, 4)
    toks = tokens(2, 7)
    with torch.no_grad():
        got = lm.decoder.extract_features(toks, None)[0]
        x = common.decoder_input(lm.decoder, toks)
        want = _port_stack(x, _layers(lm.decoder), lm.decoder.layers[0].self_attn.num_heads, _mix(learned), True)
        want = common.NormSpec.from_module(lm.decoder.layer_norm)(want)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 if impl == "fairseq" else 1e-10)


def test_value_residual_mixes_self_attention_only_and_the_first_layer_not_at_all():
    m, _ = model("valueres")
    for stack in (m.encoder, m.decoder):
        mixes = [layer.self_attn.value_mix for layer in stack.layers]
        assert mixes[0] is None and all(x is not None for x in mixes[1:])
        assert stack.layers[0].self_attn.value_source is mixes[1].source
    assert not any(isinstance(layer.encoder_attn, FeatureAttention) for layer in m.decoder.layers)


def beam_bound(m, biggest: float, steps: int = 6) -> float:
    """How far fairseq's positional scores of a float64 model may be from a float64 full forward: fairseq rounds
    to float32 in its log-softmax (``u_32 (2 max|l| + 8)``, as ``tests/test_qk_norm.py`` derives it) and keeps
    each hypothesis' *cumulative* score in float32, from which a positional score is the difference of two
    steps: the rounding of the sum ``c_t = c_(t-1) + log p_t`` stays in it, ``u_32 |c_t|``, ``|c_t| <= (t + 1) M``
    with ``M = 2 max|l| + log V`` the largest ``|log p|`` (V the vocabulary), plus the difference's own
    ``u_32 M``: ``u_32 ((steps + 2) M + 2 max|l| + 8)``."""
    big_lp = 2 * biggest + math.log(m.decoder.output_projection.out_features)
    return U32 * ((steps + 2) * big_lp + 2 * biggest + 8)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_scores_equal_a_full_forward(family, impl):
    """fairseq's SequenceGenerator (encoder once, the decoder step by step with its key/value caches, the gates
    per step, the sinks per call, the mixed values cached; beams reordered) gives each hypothesis the
    log-probabilities of one teacher-forced full forward (bound: :func:`beam_bound`)."""
    m, _ = model(family, "--attention-impl", impl)
    for mod in m.modules():  # the gates and sinks away from their init; the rest as initialised (the bound's case)
        if isinstance(mod, FeatureAttention):
            randomise(mod.gate or torch.nn.Module(), 2)
            if mod.sinks is not None:
                randomise(torch.nn.ParameterList([mod.sinks]), 2)
    worst, biggest = _beam_hypotheses_scored_by_a_full_forward(m)
    assert worst < beam_bound(m, biggest), (worst, biggest)


ALL_THREE = ("--gated-attention", "--attention-sinks", "--value-residual")
COMPOSED = ["postln_iwslt_de_en", "deepnorm_iwslt_de_en", "admin_closed_iwslt_de_en", "dsinit_iwslt_de_en",
            "qknorm_iwslt_de_en", "subln_iwslt_de_en", "periln_iwslt_de_en", "dyt_iwslt_de_en"]  # fmt: skip


@pytest.mark.parametrize("arch", COMPOSED, ids=[a.split("_iwslt")[0] for a in COMPOSED])
def test_the_three_compose_with_the_other_axes_and_decode_as_the_full_forward(arch):
    """The gate, the sink and the value mix together on another family's model (every axis but the attention's
    own), on the SDPA path: built, trained one backward, and beam search equal to the full forward."""
    m, _ = build_model(arch, *TINY_DIMS, *HEADS, *NO_DROPOUT, *ALL_THREE, "--attention-impl", "sdpa")
    attn = m.decoder.layers[1].self_attn
    assert attn.gate is not None and attn.sinks is not None and attn.value_mix is not None
    from conftest import tiny_batch

    m(**tiny_batch())[0].sum().backward()
    assert attn.sinks.grad is not None and attn.gate.proj.weight.grad is not None
    m = m.double().eval()
    worst, biggest = _beam_hypotheses_scored_by_a_full_forward(m)
    assert worst < beam_bound(m, biggest), (worst, biggest)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_language_model_decodes_incrementally(family, impl):
    lm, _, _ = build_lm(f"{family}_lm_tiny", "--attention-impl", impl, "--dropout", "0")
    lm = lm.double().eval()
    randomise(lm.decoder.layers, 6)
    toks = tokens(2, 6)
    with torch.no_grad():
        full = lm(toks)[0]
        state: dict = {}
        steps = [lm.decoder(toks[:, : t + 1], incremental_state=state)[0] for t in range(toks.size(1))]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-9)


def test_sdpa_keeps_is_causal_with_sinks_and_gates_follow_the_kernel():
    """Under --attention-impl sdpa the decoder's self-attentions call the kernel with is_causal and no mask
    (sinks: the leading dropped query), and the gate multiplies the kernel's output."""
    from deepinit_tools.harness.attention_calls import AttentionCalls

    for family in ("sinks", "gatedattn"):
        lm, _, _ = build_lm(f"{family}_lm_tiny", "--attention-impl", "sdpa")
        with AttentionCalls(lm) as calls:
            lm(tokens(2, 6))[0].sum().backward()
        decoder = calls.self_attention("decoder")
        assert decoder and all(c.path == "sdpa" and c.is_causal and c.mask_shape is None for c in decoder), decoder


def test_gate_and_sink_init():
    """The gate projection starts as fairseq initialises q_proj (xavier_uniform, gain 1/sqrt(2), bias 0); the sinks
    at 0 in float32, one per head."""
    m, _ = model("gatedattn")
    gate = m.encoder.layers[0].self_attn.gate.proj
    bound = (6 / (gate.in_features + gate.out_features)) ** 0.5 / 2**0.5
    assert gate.weight.abs().max() <= bound and gate.weight.abs().max() > 0.8 * bound
    assert gate.bias.abs().max() == 0
    assert m.decoder.layers[0].self_attn.sinks is None
    fresh, _ = build_model("sinks_iwslt_de_en", *TINY_DIMS)
    p = fresh.decoder.layers[0].encoder_attn.sinks
    assert p.dtype == torch.float32 and p.abs().max() == 0 and p.shape == (2,)


# ------------------------------------------------------------------------------------------------ refusals

BAD = [
    ("gatedattn", ("--decoder-layer-type", "matt"), "standard layer"),
    ("sinks", ("--cross-self-attention",), "--cross-self-attention"),
    ("valueres", ("--encoder-layerdrop", "0.1"), "--encoder-layerdrop"),
    ("valueres", ("--checkpoint-activations",), "--checkpoint-activations"),
    ("valueres", ("--value-residual-lambda", "1.5"), "in [0, 1]"),
    ("valueres", ("--value-residual-learned", "--value-residual-lambda", "0.3"), "drop one of them"),
    ("preln", ("--value-residual-lambda", "0.3"), "needs --value-residual"),
    ("preln", ("--gated-attention-granularity", "elementwise"), "needs --gated-attention"),
]


@pytest.mark.parametrize("family,cli,says", BAD, ids=[" ".join(c) for _, c, _ in BAD])
def test_bad_combinations_stop_with_one_line(family, cli, says):
    with pytest.raises(DeepInitConfigError) as e:
        build_model(f"{family}_iwslt_de_en", *TINY_DIMS, *cli)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


NO_CROSS = [("gatedattn", "--no-gated-attention-cross"), ("sinks", "--no-attention-sinks-cross")]


@pytest.mark.parametrize("family,flag", NO_CROSS)
def test_language_model_refuses_no_cross(family, flag):
    with pytest.raises(DeepInitConfigError, match="has no encoder-decoder attention") as e:
        build_lm(f"{family}_lm_tiny", flag)
    assert "\n" not in str(e.value)
    m, _ = model(family, flag)
    assert not any(isinstance(layer.encoder_attn, FeatureAttention) for layer in m.decoder.layers)
    assert all(isinstance(layer.self_attn, FeatureAttention) for layer in m.decoder.layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_export_refuses_the_families_in_one_line(family):
    from fairseq_deepinit.export import route

    for args in (model(family)[1], build_lm(f"{family}_lm_tiny")[1]):
        r = route.classify(args)
        assert set(r.reasons) == set(route.TARGETS), r.reasons
        for why in r.reasons.values():
            assert "neither target has" in why and "\n" not in why and "does not carry" not in why, why


# ---------------------------------------------------------------------------------------------- end to end

TRAIN = [
    "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--cpu", "--num-workers", "0",
    "--log-format", "simple", "--log-interval", "1", "--seed", "1", "--disable-validation", "--no-save",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure
@pytest.mark.parametrize("family,says", [("gatedattn", "gated-attention=headwise"), ("sinks", "attention-sinks"),
                                         ("valueres", "value-residual=0.5")])  # fmt: skip
def test_fairseq_train_translation_and_language_model(family, says, synthetic_bin, tmp_path):
    """fairseq-train, 3 updates each: the translation family on the SDPA path (then fairseq-generate from its
    checkpoint, and the checkpoint loaded strictly into a freshly built model) and the LM family on fairseq's."""
    from fairseq import checkpoint_utils

    from conftest import tiny_batch

    log = run_cli("train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt",
                  "--arch", f"{family}_iwslt_de_en", *TINY_DIMS, "--attention-impl", "sdpa", "--save-dir", tmp_path,
                  *TRAIN[:-1], "--no-epoch-checkpoints", "--max-update", "3", forked=True).stdout  # fmt: skip
    assert says in log and re.search(r"num_updates 3\b", log), log[-2000:]
    ckpt = tmp_path / "checkpoint_last.pt"
    gen = run_cli("generate", synthetic_bin, "--user-dir", USER_DIR, "--path", ckpt, "--beam", "2", "--cpu",
                  "--max-len-b", "5", "--batch-size", "16", "--required-batch-size-multiple", "1",
                  forked=True).stdout  # fmt: skip
    assert len(re.findall(r"^H-\d+\t", gen, re.M)) == 100, gen[-2000:]
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(ckpt)])
    rebuilt = task.build_model(cfg.model)
    rebuilt.load_state_dict(torch.load(ckpt, weights_only=False)["model"])  # strict: the same parameters
    b = tiny_batch(n_symbols=len(task.source_dictionary) - 4)
    with torch.no_grad():
        torch.testing.assert_close(models[0].eval()(**b)[0], rebuilt.eval()(**b)[0], rtol=0, atol=0)
    from test_lm import TRAIN as LM_TRAIN

    lines = [" ".join(f"w{(a + k * i) % 30}" for i in range(4 + a % 8)) for a in range(30) for k in (1, 2, 3)]
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
    run_cli("preprocess", "--only-source", "--trainpref", tmp_path / "train.txt", "--destdir", tmp_path / "bin",
            "--workers", "1", forked=True)  # fmt: skip
    out = run_cli("train", tmp_path / "bin", "--user-dir", USER_DIR, "--task", "language_modeling", "--arch",
                  f"{family}_lm_tiny", *LM_TRAIN, "--max-update", "3", "--no-save", "--disable-validation",
                  "--save-dir", tmp_path / "lm", forked=True).stdout  # fmt: skip
    assert says in out and re.search(r"num_updates 3\b", out), out[-2000:]
