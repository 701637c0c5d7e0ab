"""Logit soft-capping (``--attention-softcap``, ``--output-softcap``) against the independent port of Gemma's
released code (``tests/ports/softcap.py``): every attention kind of a translation model, the output logits of a
translation model and of a language model, incremental decoding equal to the full forward, fairseq-train and
fairseq-generate, the refusals. Float64 models: the two float64 paths differ in the order of a few sums of
O(1) terms, so they agree to a small multiple of float64's eps (:data:`TOL`).
"""

from __future__ import annotations

import re

import pytest
import torch
from ports import common
from ports import softcap as port

from conftest import TINY_DIMS, USER_DIR, build_model, make_dictionary, not_one_line, run_cli
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.modules.attention_features import FeatureAttention

F64 = torch.float64
TOL = dict(rtol=0, atol=1e-12)  # O(1) outputs of float64 sums of a few dozen terms
NO_DROPOUT = ("--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0")
CAPS = ("--attention-softcap", "--attention-softcap-value", "0.7", "--output-softcap", "--output-softcap-value", "2")


def model(*cli: str, arch: str = "preln_iwslt_de_en"):
    m, args = build_model(arch, *TINY_DIMS, *NO_DROPOUT, *cli)
    return m.double().eval(), args


def build_lm(*cli: str):
    from fairseq import options, tasks

    import fairseq_deepinit  # noqa: F401

    argv = ["/nonexistent", "--task", "language_modeling", "--arch", "preln_lm_tiny", *NO_DROPOUT, *cli]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    d = make_dictionary(50)
    task = tasks.TASK_REGISTRY["language_modeling"](args, d, d)
    torch.manual_seed(1)
    return task.build_model(args).double().eval(), args


def randomise(m: torch.nn.Module, seed: int) -> None:
    """Weights large enough that many logits pass the cap (|l| > c), so that a missing cap shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(
                torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.5 if p.dim() == 1 else 2 * p.size(-1) ** -0.5)
            )


def _case(kind: str, m):
    """(attention, query (T, B, C), keys (S, B, C), plugin kwargs, allowed (B, T, S) for the port)."""
    g = torch.Generator().manual_seed(7)
    B, T, S, C = 3, 5, 6, 64
    x = torch.randn(T, B, C, generator=g, dtype=F64)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[0, :2], pad[2, :1] = True, True
    if kind == "encoder-self":
        kpm = pad[:, :T]
        kw = dict(query=x, key=x, value=x, key_padding_mask=kpm, need_weights=False)
        return m.encoder.layers[1].self_attn, x, x, kw, (~kpm)[:, None, :].expand(B, T, T)
    if kind == "decoder-self":
        future = torch.triu(torch.full((T, T), float("-inf"), dtype=F64), 1)
        kw = dict(query=x, key=x, value=x, attn_mask=future, need_weights=False)
        return m.decoder.layers[1].self_attn, x, x, kw, torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    mem = torch.randn(S, B, C, generator=g, dtype=F64)
    kw = dict(query=x, key=mem, value=mem, key_padding_mask=pad, static_kv=True, need_weights=False)
    return m.decoder.layers[1].encoder_attn, x, mem, kw, (~pad)[:, None, :].expand(B, T, S)


@pytest.mark.parametrize("need_weights", [False, True], ids=["core", "with-weights"])
@pytest.mark.parametrize("kind", ["encoder-self", "decoder-self", "cross"])
def test_every_attention_equals_gemmas_capped_attention(kind, need_weights):
    """Each attention kind against ``ports.softcap.attention`` (the cap before the mask); the port without the
    cap, or with it after the mask (a deliberate mutation), is far off."""
    m, _ = model("--attention-softcap", "--attention-softcap-value", "0.7")
    attn, x_q, x_kv, kw, allowed = _case(kind, m)
    assert isinstance(attn, FeatureAttention) and attn.softcap == 0.7
    randomise(attn, 3)
    with torch.no_grad():
        got = attn(**{**kw, "need_weights": need_weights})[0].transpose(0, 1)
        w = common.AttnWeights.from_module(attn)
        q, kv = x_q.transpose(0, 1), x_kv.transpose(0, 1)
        want = port.attention(q, kv, w, attn.num_heads, 0.7, allowed)
        uncapped = port.attention(q, kv, w, attn.num_heads, None, allowed)
        mutated = port.attention(q, kv, w, attn.num_heads, 0.7, allowed, cap_after_mask=True)
    torch.testing.assert_close(got, want, **TOL)
    assert (got - uncapped).abs().max() > 1e-3
    assert (got - mutated).abs().max() > 1e-3


def test_output_logits_are_capped_in_training_and_in_the_normalised_probabilities():
    """The decoder's output (what the criterion and the generator read) is ``ports.softcap.softcap`` of the
    uncapped model's logits, for a translation model and a language model; ``get_normalized_probs`` its
    log-softmax (in float32, as fairseq takes it: a few float32 ulps of its largest value); the uncapped logits
    exceed the cap."""
    from conftest import tiny_batch

    for build, batch in ((model, tiny_batch()), (build_lm, None)):
        capped, _ = build("--output-softcap", "--output-softcap-value", "2")
        plain, _ = build()
        randomise(capped, 4)
        plain.load_state_dict(capped.state_dict())
        if batch is None:
            batch = {"src_tokens": torch.randint(4, 54, (3, 6), generator=torch.Generator().manual_seed(0))}
        with torch.no_grad():
            z, extra = capped(**batch)
            z0 = plain(**batch)[0]
            lprobs = capped.get_normalized_probs((z, extra), log_probs=True)
        assert z0.abs().max() > 4, "the case must pass the cap"
        torch.testing.assert_close(z, port.softcap(z0, 2.0), **TOL)
        want = torch.log_softmax(port.softcap(z0, 2.0).float(), -1)  # fairseq's log-softmax is float32's
        torch.testing.assert_close(lprobs, want, rtol=0, atol=8 * torch.finfo(torch.float32).eps * want.abs().max())
        assert z.abs().max() < 2


def _incremental_equals_full(m, enc_input: dict | None, prev: torch.Tensor) -> None:
    with torch.no_grad():
        if enc_input is None:  # a language model
            full = m(prev)[0]
            state: dict = {}
            steps = [m.decoder(prev[:, : t + 1], incremental_state=state)[0] for t in range(prev.size(1))]
        else:
            enc = m.encoder(**enc_input)
            full = m.decoder(prev, encoder_out=enc)[0]
            state = {}
            steps = [m.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)[0]
                     for t in range(prev.size(1))]  # fmt: skip
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)
    assert full.abs().max() < 2  # the output cap on every step


def test_incremental_decoding_equals_the_full_forward():
    """With both caps, the decoder step by step (fairseq's key/value caches, the cap on each step's logits) gives
    the teacher-forced full forward, translation (source padded) and language model."""
    from conftest import tiny_batch

    m, _ = model(*CAPS)
    randomise(m, 5)
    b = tiny_batch()
    b["src_tokens"][0, :2] = 1  # left-padded source
    _incremental_equals_full(m, {"src_tokens": b["src_tokens"], "src_lengths": b["src_lengths"]},
                             b["prev_output_tokens"])  # fmt: skip
    lm, _ = build_lm(*CAPS)
    randomise(lm, 6)
    _incremental_equals_full(lm, None, torch.randint(4, 54, (2, 7), generator=torch.Generator().manual_seed(1)))


BAD = [
    (("--attention-softcap", "--attention-impl", "sdpa"), "use --attention-impl fairseq"),
    (("--attention-softcap-value", "10"), "needs --attention-softcap"),
    (("--output-softcap", "--output-softcap-value", "0"), "greater than 0"),
    (("--attention-softcap", "--attention-softcap-value", "inf"), "greater than 0"),
    (("--output-softcap", "--adaptive-softmax-cutoff", "20"), "adaptive softmax"),
    (("--attention-softcap", "--cross-self-attention"), "does not combine with --cross-self-attention"),
    (("--attention-softcap", "--decoder-layer-type", "matt"), "standard"),
]


@pytest.mark.parametrize("cli,says", BAD, ids=[" ".join(c) for c, _ in BAD])
def test_refusals_are_one_line(cli, says):
    with pytest.raises(DeepInitConfigError) as e:
        build_model("preln_iwslt_de_en", *TINY_DIMS, *cli)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_export_routes():
    """The attention cap: refused by every target in one line; the output cap: stock fairseq refuses it (and so Hugging
    Face, through it), CTranslate2 carries it (its log-probabilities: tests/test_export.py, family ``outsoftcap``)."""
    from fairseq_deepinit.export import route

    for cli, targets in ((("--attention-softcap",), set(route.TARGETS)),
                         (("--output-softcap",), {route.FAIRSEQ, route.HUGGINGFACE})):  # fmt: skip
        for args in (model(*cli)[1], build_lm(*cli)[1]):
            r = route.classify(args)
            assert set(r.reasons) == targets, r.reasons
            assert all("softcap" in why and "\n" not in why for why in r.reasons.values()), r.reasons


TRAIN = [
    "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--cpu", "--num-workers", "0",
    "--log-format", "simple", "--log-interval", "1", "--seed", "1", "--disable-validation",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure
def test_fairseq_train_generate_and_a_language_model(synthetic_bin, lm_bin, tmp_path):
    """fairseq-train with both caps, 3 updates: translation (then fairseq-generate, beam 2) and a language model;
    and ``--attention-impl sdpa`` with the attention cap ends in one line, exit status 1."""
    log = run_cli("train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt",
                  "--arch", "preln_iwslt_de_en", *TINY_DIMS, *CAPS, "--save-dir", tmp_path, *TRAIN,
                  "--no-epoch-checkpoints", "--max-update", "3", forked=True).stdout  # fmt: skip
    assert "attention-softcap=0.7, output-softcap=2" in log and re.search(r"num_updates 3\b", log), log[-2000:]
    gen = run_cli("generate", synthetic_bin, "--user-dir", USER_DIR, "--path", tmp_path / "checkpoint_last.pt",
                  "--beam", "2", "--cpu", "--max-len-b", "5", "--batch-size", "16",
                  "--required-batch-size-multiple", "1", forked=True).stdout  # fmt: skip
    assert len(re.findall(r"^H-\d+\t", gen, re.M)) == 100, gen[-2000:]
    out = run_cli("train", lm_bin, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "preln_lm_tiny",
                  *CAPS, *TRAIN, "--tokens-per-sample", "32", "--max-update", "3", "--no-save",
                  "--save-dir", tmp_path / "lm", forked=True).stdout  # fmt: skip
    assert "attention-softcap=0.7" in out and re.search(r"num_updates 3\b", out), out[-2000:]
    bad = run_cli("train", synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt",
                  "--arch", "preln_iwslt_de_en", *TINY_DIMS, "--attention-softcap", "--attention-impl", "sdpa",
                  "--save-dir", tmp_path / "bad", *TRAIN, "--max-update", "1", check=False)  # fmt: skip
    assert not not_one_line({"sdpa": bad}, {"sdpa": "use --attention-impl fairseq"})


def test_beam_search_scores_equal_a_full_forward():
    """fairseq's SequenceGenerator (the decoder step by step with its caches, beams reordered) gives each hypothesis
    of a model with both caps the log-probabilities of one teacher-forced full forward, within the bound of the
    gated-attention test (fairseq's float32 scores; :func:`test_attention_features.beam_bound`)."""
    from test_attention_features import beam_bound
    from test_qk_norm import _beam_hypotheses_scored_by_a_full_forward

    m, _ = build_model("preln_iwslt_de_en", *TINY_DIMS, *NO_DROPOUT, *CAPS, "--encoder-attention-heads", "4",
                       "--decoder-attention-heads", "4")  # fmt: skip
    m = m.double().eval()
    worst, biggest = _beam_hypotheses_scored_by_a_full_forward(m)
    assert worst < beam_bound(m, biggest), (worst, biggest)
