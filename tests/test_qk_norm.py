"""QK-Norm (``--qk-norm``, ``fairseq_deepinit/methods/qk_norm.py``, ``modules/qk_norm.py``) against the
independent port of the released code (``tests/ports/qk_norm.py``): the q/k norms at init, the output of
the plugin's attention modules with identical weights on both scopes, norm types, kinds (self, cross) and
``--attention-impl`` paths, the logit bound at init, fairseq's beam search equal to a full forward, the
other axes composed with it, the refusals, and fairseq-train / fairseq-generate / checkpoint reload for
translation and the language model.

Tolerances (:func:`attention_tolerance`) follow the float path. The plugin runs in float64; fairseq's
explicit path rounds the softmax to float32 (``fairseq/utils.py:514-518``, ``dtype=torch.float32`` even
for float64 logits), the SDPA path stays in float64. A probability computed from logits ``l`` in a
precision of unit roundoff ``u`` is off by at most ``u (2 max|l| + S + 4)`` relative (the rounded
logit's error ``u |l|`` enters ``exp`` as a relative error, twice through the max shift; ``S`` terms
summed; exp, division and the final rounding one ``u`` each), so the context ``sum_j p_j v_j`` is off by
that times ``max|v|``, and the output ``W_o ctx`` by that times the largest row sum of ``|W_o|``. The
port's own float64 error and the rest of the float64 path are some ``1e3 u_64``, added. A missing or
misplaced norm, the other scope or a wrong epsilon move the outputs by 1e-6 to 1, far beyond: each test
was checked to fail on such mutations of the block (norm after fairseq's softmax scale, scope swapped,
epsilon ignored, keys left unnormalised in the cache).
"""

from __future__ import annotations

import re

import pytest
import torch
from fairseq.modules.multihead_attention import MultiheadAttention
from ports import common
from ports import qk_norm as port

from conftest import TINY_DIMS, USER_DIR, build_model, run_cli, tiny_batch
from fairseq_deepinit.errors import DeepInitConfigError
from fairseq_deepinit.modules.attention import SDPAMultiheadAttention
from fairseq_deepinit.modules.norms import RMSNorm
from fairseq_deepinit.modules.qk_norm import NormedProjection, has_qk_norm

F64 = torch.float64
U32, U64 = 2.0**-24, 2.0**-53
HEADS = ("--encoder-attention-heads", "4", "--decoder-attention-heads", "4")
NO_DROPOUT = ("--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0")
TYPES = {"rmsnorm": "rms", "layernorm": "layer"}


def qk_model(*cli: str, arch: str = "qknorm_iwslt_de_en", seed: int = 1):
    return build_model(arch, *TINY_DIMS, *HEADS, *NO_DROPOUT, *cli, seed=seed)


def attentions(model) -> list:
    return [m for m in model.modules() if isinstance(m, MultiheadAttention)]


def port_norm(norm: torch.nn.Module) -> common.NormSpec:
    """The plugin norm's parameters as a port norm (fairseq's LayerNorm, the plugin's RMSNorm)."""
    spec = common.NormSpec.from_module(norm)
    if isinstance(norm, RMSNorm):
        spec.kind = "rms"
    return spec


def attention_tolerance(logits: torch.Tensor, v: torch.Tensor, wo: torch.Tensor, u: float) -> float:
    """The bound of the module docstring: softmax in unit roundoff ``u``, the rest float64."""
    finite = logits[torch.isfinite(logits)]
    rel = u * (2 * finite.abs().max().item() + logits.size(-1) + 4)
    return rel * v.abs().max().item() * wo.abs().sum(1).max().item() + 1e3 * U64


def randomise(attn: MultiheadAttention, seed: int) -> None:
    """Weights, biases and norm parameters away from their init (so that a gain or bias left out shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.5 if p.dim() == 1 else p.size(-1) ** -0.5))
            if p.dim() == 1 and p.shape[0] in (attn.head_dim, attn.embed_dim) and p is not attn.out_proj.bias:
                p.add_(1.0)  # gains around 1


# --------------------------------------------------------------------------------------- the modules


@pytest.mark.parametrize("scope", ["head", "proj"])
@pytest.mark.parametrize("norm_type", ["rmsnorm", "layernorm"])
def test_norms_at_init_as_released(scope, norm_type):
    """One q and one k norm per attention (encoder self, decoder self, cross), of ``head_dim`` features per
    head or the whole projection (ports.qk_norm.norm_size), unit gain, zero bias, the given epsilon; the
    rest of the model is the ``preln_*`` model's, weight for weight (the same random draws)."""
    model, args = qk_model("--qk-norm-scope", scope, "--qk-norm-type", norm_type, "--qk-norm-eps", "1e-4")
    attns = attentions(model)
    assert len(attns) == 6 and all(has_qk_norm(a) for a in attns)
    for a in attns:
        for proj in (a.q_proj, a.k_proj):
            want = port.init_norm(scope, a.num_heads, a.head_dim, TYPES[norm_type], 1e-4, bias=norm_type == "layernorm")
            got = port_norm(proj.norm)
            assert (got.kind, got.eps) == (want.kind, want.eps)
            torch.testing.assert_close(got.weight.double(), want.weight, rtol=0, atol=0)
            assert (got.bias is None) == (want.bias is None)
            if want.bias is not None:
                torch.testing.assert_close(got.bias.double(), want.bias, rtol=0, atol=0)
            assert proj.groups == (a.num_heads if scope == "head" else 1)
    preln, _ = build_model("preln_iwslt_de_en", *TINY_DIMS, *HEADS, *NO_DROPOUT, seed=1)
    sd, ref = model.state_dict(), preln.state_dict()
    assert [k for k in sd if ".norm." not in k or "_proj." not in k] == list(ref)
    for k, v in ref.items():
        torch.testing.assert_close(sd[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("impl", ["fairseq", "sdpa"])
@pytest.mark.parametrize("kind", ["self", "cross"])
@pytest.mark.parametrize("norm_type", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("scope", ["head", "proj"])
def test_attention_equals_the_port(scope, norm_type, kind, impl):
    """The plugin's encoder self-attention / decoder cross-attention, identical weights, equals
    ``ports.qk_norm.qk_norm_attention`` (batch-first) with a key-padding mask; float64."""
    model, _ = qk_model("--qk-norm-scope", scope, "--qk-norm-type", norm_type, "--attention-impl", impl)
    model = model.double().eval()
    attn = model.encoder.layers[0].self_attn if kind == "self" else model.decoder.layers[1].encoder_attn
    assert type(attn) is (SDPAMultiheadAttention if impl == "sdpa" else MultiheadAttention)
    randomise(attn, seed=7)
    g = torch.Generator().manual_seed(0)
    B, T, S, C = 3, 5, 7 if kind == "cross" else 5, attn.embed_dim
    x_q = torch.randn(B, T, C, generator=g, dtype=F64)
    x_kv = x_q if kind == "self" else torch.randn(B, S, C, generator=g, dtype=F64) * 3
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[0, -2:] = True
    with torch.no_grad():
        got, _ = attn(
            x_q.transpose(0, 1), x_kv.transpose(0, 1), x_kv.transpose(0, 1), key_padding_mask=pad, need_weights=False,
            static_kv=kind == "cross",
        )  # fmt: skip
        w = common.AttnWeights.from_module(attn)
        want, logits = port.qk_norm_attention(
            x_q, x_kv, w, attn.num_heads, scope, port_norm(attn.q_proj.norm), port_norm(attn.k_proj.norm),
            key_padding_mask=pad, return_logits=True,
        )  # fmt: skip
    v = common.linear(x_kv, w.wv, w.bv)
    tol = attention_tolerance(logits, v, w.wo, U32 if impl == "fairseq" else U64)
    torch.testing.assert_close(got.transpose(0, 1), want, rtol=0, atol=tol)


@pytest.mark.parametrize("scope", ["head", "proj"])
def test_logits_at_init_stay_within_the_released_bound(scope):
    """Unit gains: every logit within ``ports.qk_norm.max_logit_bound`` however large the input (fairseq's
    pre-softmax weights, ``before_softmax``); the same layer without its norms exceeds it by far."""
    model, _ = qk_model("--qk-norm-scope", scope, "--qk-norm-type", "rmsnorm")
    attn = model.encoder.layers[0].self_attn
    x = torch.randn(9, 2, attn.embed_dim, generator=torch.Generator().manual_seed(1)) * 100
    with torch.no_grad():
        logits, _ = attn(x, x, x, before_softmax=True)
        bound = port.max_logit_bound(scope, attn.num_heads, attn.head_dim)
        assert logits.abs().max() <= bound * (1 + 1e-6)
        plain = torch.nn.Linear(attn.embed_dim, attn.embed_dim)
        plain.weight, plain.bias = attn.q_proj.weight, attn.q_proj.bias
        attn.q_proj, attn.k_proj = plain, plain
        assert attn(x, x, x, before_softmax=True)[0].abs().max() > 10 * bound


def test_the_norm_precedes_fairseqs_softmax_scale():
    """fairseq scales the projected queries in place (``q *= self.scaling``): the norm must run first (an
    RMS norm after it would cancel the scale, ports.qk_norm's docstring). Pre-softmax logits equal the
    port's ``head_dim^-1/2 <N(q), N(k)>``."""
    model, _ = qk_model("--qk-norm-scope", "head")
    model = model.double()
    attn = model.encoder.layers[1].self_attn
    randomise(attn, seed=3)
    x = torch.randn(2, 6, attn.embed_dim, generator=torch.Generator().manual_seed(2), dtype=F64)
    with torch.no_grad():
        got, _ = attn(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1), before_softmax=True)
        _, want = port.qk_norm_attention(
            x, x, common.AttnWeights.from_module(attn), attn.num_heads, "head", port_norm(attn.q_proj.norm),
            port_norm(attn.k_proj.norm), return_logits=True,
        )  # fmt: skip
    torch.testing.assert_close(got.view(2, attn.num_heads, 6, 6), want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------- decoding, composition


def _beam_hypotheses_scored_by_a_full_forward(model, beam: int = 2, steps: int = 6) -> tuple:
    """fairseq's SequenceGenerator (incremental decoding, its key caches) against teacher-forced full forwards
    of the hypotheses it returns: the largest difference of the positional log-probabilities, and the
    largest |logit| seen."""
    from fairseq.sequence_generator import SequenceGenerator

    from conftest import make_dictionary

    d = make_dictionary()
    gen = SequenceGenerator([model], d, beam_size=beam, max_len_b=steps, min_len=steps)
    b = tiny_batch()
    worst = biggest = 0.0
    with torch.no_grad():
        hyps = gen.forward({"net_input": {"src_tokens": b["src_tokens"], "src_lengths": b["src_lengths"]}})
        for i, sent in enumerate(hyps):
            for h in sent:
                tokens = h["tokens"][None]
                prev = torch.cat([tokens.new_full((1, 1), d.eos()), tokens[:, :-1]], 1)
                logits = model(b["src_tokens"][i : i + 1], b["src_lengths"][i : i + 1], prev)[0]
                lp = torch.log_softmax(logits.double(), -1)[0].gather(-1, tokens[0, :, None])[:, 0]
                worst = max(worst, (lp - h["positional_scores"].double()).abs().max().item())
                biggest = max(biggest, logits.abs().max().item())
    return worst, biggest


@pytest.mark.parametrize("impl", ["fairseq", "sdpa"])
@pytest.mark.parametrize("scope", ["head", "proj"])
def test_beam_search_scores_equal_a_full_forward(scope, impl):
    """fairseq-generate's path (encoder once, the decoder step by step with cached normalised keys, beam
    reorders) gives each hypothesis the log-probabilities of one full forward. The model runs in float64;
    fairseq rounds to float32 twice on the way: its log-softmax of the output (``utils.log_softmax``
    casts the logits to float32: ``u_32 |l|`` each, through the max shift twice, the sum and the log a
    few ``u_32``, the result's rounding ``u_32 |log p| <= 2 u_32 max|l|``) and the softmax of the
    attentions that return weights (the last layer's alignment, on both paths), whose effect on the
    logits is below the first's. Bound: ``u_32 (4 max|l| + 8)``."""
    model, _ = qk_model("--qk-norm-scope", scope, "--attention-impl", impl)
    model = model.double().eval()
    worst, biggest = _beam_hypotheses_scored_by_a_full_forward(model)
    assert worst < U32 * (4 * biggest + 8), (worst, biggest)


COMPOSED = [
    ("postln_iwslt_de_en", (), ()),
    ("admin_iwslt_de_en", (), ()),
    ("deepnorm_iwslt_de_en", (), ()),
    ("tfixup_iwslt_de_en", (), ()),
    ("rezero_iwslt_de_en", (), ()),
    ("subln_iwslt_de_en", (), ()),
    ("b2t_iwslt_de_en", (), ()),
    ("normformer_iwslt_de_en", (), ()),
    ("twt_iwslt_de_en", (), ()),
    ("lipschitz_iwslt_de_en", ("--lipschitz-bias-free",), ()),
    ("matt_iwslt_de_en", ("--matt-self-branch", "self-attn"), ()),
    ("dsinit_iwslt_de_en", (), ("--qk-norm-scope", "proj", "--no-qk-norm-cross")),
]


@pytest.mark.parametrize("arch,cli,qk", COMPOSED, ids=[a.split("_iwslt")[0] for a, _, _ in COMPOSED])
def test_composes_with_the_other_axes(arch, cli, qk):
    """Every other axis keeps its modules and gains q/k norms on each attention (the cross-attention's unless
    --no-qk-norm-cross); the norms act (outputs differ from the same weights without them) and incremental
    decoding equals the full forward."""
    model, args = build_model(arch, *TINY_DIMS, *NO_DROPOUT, *cli, "--qk-norm", *qk)
    model.eval()
    for a in attentions(model):
        assert has_qk_norm(a) == (args.qk_norm_cross or not a.encoder_decoder_attention), a
        assert not isinstance(a.v_proj, NormedProjection) and not isinstance(a.out_proj, NormedProjection)
    if "--lipschitz-bias-free" in cli:
        assert all(not isinstance(a.q_proj.bias, torch.nn.Parameter) for a in attentions(model))
    b = tiny_batch()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".residuals." in name:
                p.fill_(0.5)  # ReZero's branches start at 0 (no attention in the output at all)
        full = model(**b)[0]
        enc = model.encoder(b["src_tokens"], src_lengths=b["src_lengths"])
        state: dict = {}
        steps = [
            model.decoder(b["prev_output_tokens"][:, : t + 1], encoder_out=enc, incremental_state=state)[0]
            for t in range(b["prev_output_tokens"].size(1))
        ]
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)
        plain, _ = build_model(arch, *TINY_DIMS, *NO_DROPOUT, *cli)
        plain.load_state_dict({k: v for k, v in model.state_dict().items() if not re.search(r"\.[qk]_proj\.norm\.", k)})
        assert not torch.allclose(plain.eval()(**b)[0], full, atol=1e-3)


# ------------------------------------------------------------------------------------------ refusals

BAD = [
    ("preln_iwslt_de_en", ["--qk-norm-scope", "proj"], "--qk-norm-scope needs --qk-norm"),
    (
        "preln_iwslt_de_en",
        ["--no-qk-norm-cross", "--qk-norm-eps", "1e-5"],
        "--qk-norm-eps --no-qk-norm-cross need --qk-norm",
    ),
    ("qknorm_iwslt_de_en", ["--qk-norm-eps", "0"], "--qk-norm-eps must be a finite number greater than 0"),
    ("qknorm_iwslt_de_en", ["--qk-norm-eps", "nan"], "--qk-norm-eps must be"),
    ("qknorm_iwslt_de_en", ["--quant-noise-pq", "0.1"], "does not combine with --quant-noise-pq"),
    ("qknorm_iwslt_de_en", ["--no-cross-attention", "--no-qk-norm-cross"], "has no encoder-decoder attention"),
    ("qknorm_iwslt_de_en", ["--encoder-xformers-att-config", "{}"], "xFormers path has no place for a q/k norm"),
]


@pytest.mark.parametrize("arch,cli,says", BAD, ids=[" ".join(c) for _, c, _ in BAD])
def test_bad_combinations_stop_with_one_line(arch, cli, says):
    with pytest.raises(DeepInitConfigError) as e:
        build_model(arch, *TINY_DIMS, *cli)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_bad_choices_are_argparse_errors():
    for flag, value in (("--qk-norm-scope", "heads"), ("--qk-norm-type", "batchnorm")):
        with pytest.raises(SystemExit) as e:
            build_model("qknorm_iwslt_de_en", flag, value)
        assert e.value.code == 2


def test_language_model_refuses_no_cross_and_decodes_incrementally():
    from test_lm import build_lm, tokens

    with pytest.raises(DeepInitConfigError, match="has no encoder-decoder attention") as e:
        build_lm("qknorm_lm_tiny", "--no-qk-norm-cross")
    assert "\n" not in str(e.value)
    for scope in ("head", "proj"):
        model, args, _ = build_lm("qknorm_lm_tiny", "--qk-norm-scope", scope, "--dropout", "0")
        assert args.qk_norm and all(has_qk_norm(a) for a in attentions(model))
        model = model.double().eval()
        toks = tokens(2, 6)
        with torch.no_grad():
            full = model(toks)[0]
            state: dict = {}
            steps = [model.decoder(toks[:, : t + 1], incremental_state=state)[0] for t in range(toks.size(1))]
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------- end to end

TRAIN = [
    "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--cpu", "--num-workers", "0",
    "--log-format", "simple", "--log-interval", "1", "--seed", "1", "--disable-validation", "--no-epoch-checkpoints",
]  # fmt: skip


@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
def test_translation_trains_generates_reloads_and_refuses_a_scope_change(synthetic_bin, tmp_path):
    """fairseq-train (3 updates, SDPA path, the projection scope), fairseq-generate from the checkpoint, the
    checkpoint reloaded into an identical model, and a resume with another scope stopped in one line."""
    from fairseq import checkpoint_utils

    common = [synthetic_bin, "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt", "--arch",
              "qknorm_iwslt_de_en", *TINY_DIMS, "--save-dir", tmp_path, *TRAIN]  # fmt: skip
    log = run_cli(
        "train", *common, "--qk-norm-scope", "proj", "--attention-impl", "sdpa", "--max-update", "3", forked=True
    ).stdout
    assert "qk-norm=proj/rmsnorm(eps=1e-06)" in log and re.search(r"num_updates 3\b", log), log[-2000:]
    ckpt = tmp_path / "checkpoint_last.pt"
    gen = run_cli("generate", synthetic_bin, "--user-dir", USER_DIR, "--path", ckpt, "--beam", "2", "--cpu",
                  "--max-len-b", "5", "--batch-size", "16", "--required-batch-size-multiple", "1",
                  forked=True).stdout  # fmt: skip
    assert len(re.findall(r"^H-\d+\t", gen, re.M)) == 100, gen[-2000:]

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(ckpt)])
    state = torch.load(ckpt, weights_only=False)["model"]
    assert any(k.endswith("encoder_attn.k_proj.norm.weight") for k in state)
    torch.manual_seed(5)
    rebuilt = task.build_model(cfg.model)
    rebuilt.load_state_dict(state)  # strict: the same parameters
    b = tiny_batch(n_symbols=len(task.source_dictionary) - 4)
    with torch.no_grad():
        torch.testing.assert_close(models[0].eval()(**b)[0], rebuilt.eval()(**b)[0], rtol=0, atol=0)

    proc = run_cli("train", *common, "--qk-norm-scope", "head", "--max-update", "4", check=False)
    assert proc.returncode == 1, proc.stdout[-2000:]
    error = [line for line in proc.stdout.splitlines() if "error:" in line]
    assert len(error) == 1 and "--qk-norm-scope proj -> head" in error[0] and "Traceback" not in proc.stdout, (
        proc.stdout[-2000:]
    )


@pytest.mark.slow
@pytest.mark.kernel_independent  # fairseq's CLIs, checked by structure and exact round trips
def test_language_model_trains(tmp_path):
    """fairseq-train of ``qknorm_lm_tiny`` (3 updates, LayerNorm q/k norms) on a small synthetic corpus."""
    from test_lm import TRAIN as LM_TRAIN

    lines = [" ".join(f"w{(a + k * i) % 30}" for i in range(4 + a % 8)) for a in range(30) for k in (1, 2, 3)]
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n")
    run_cli("preprocess", "--only-source", "--trainpref", tmp_path / "train.txt", "--destdir", tmp_path / "bin",
            "--workers", "1", forked=True)  # fmt: skip
    out = run_cli("train", tmp_path / "bin", "--user-dir", USER_DIR, "--task", "language_modeling", "--arch",
                  "qknorm_lm_tiny", *LM_TRAIN, "--max-update", "3", "--no-save", "--disable-validation",
                  "--save-dir", tmp_path, "--qk-norm-type", "layernorm", forked=True).stdout  # fmt: skip
    assert "qk-norm=head/layernorm" in out and re.search(r"num_updates 3\b", out), out[-2000:]


# ------------------------------------------------------------------------------------------ Admin's fold


def test_admin_fold_stays_exact_with_qk_norms_and_the_export_refuses_them():
    """Admin's omega fold (export/omega.py) scales the q/k projections' input columns by 1/omega; the q/k
    norms act on their output, so the folded weights in a plain Post-LN model *with* the same q/k norms
    give Admin's logits. The export to a stock ``transformer`` (no q/k norms) stops in one line."""
    from fairseq_deepinit.admin import admin_residuals
    from fairseq_deepinit.admin.export import check_exportable, fold_state_dict
    from fairseq_deepinit.errors import AdminExportError

    pos = ("--encoder-learned-pos", "--decoder-learned-pos")  # no sinusoid to turn into a table
    model, args = qk_model(*pos, "--qk-norm", arch="admin_closed_iwslt_de_en")
    with torch.no_grad():  # a trained omega varies per dimension; trained q/k gains are not 1
        g = torch.Generator().manual_seed(4)
        for m in admin_residuals(model).values():
            m.omega.mul_(torch.empty(m.omega.shape).uniform_(0.5, 1.5, generator=g))
        for name, p in model.named_parameters():
            if re.search(r"\.[qk]_proj\.norm\.", name):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    plain_sd, changes = fold_state_dict(model.state_dict(), args)
    assert changes == {} and any(".q_proj.norm." in k for k in plain_sd)
    plain, _ = qk_model(*pos, "--qk-norm", "--init-scheme", "fairseq", arch="postln_iwslt_de_en")
    plain.load_state_dict(plain_sd)  # strict: the same parameters, omega gone
    b = tiny_batch()
    with torch.no_grad():
        want, got = model.eval()(**b)[0], plain.eval()(**b)[0]
    # the folded weights are rounded to float32 once (u_32 relative each) and the two models sum in another
    # order: some u_32 per layer of the logits' size; 64 u_32 |logits| (1.4e-6 measured, 1.3e-5 allowed;
    # unfolded weights miss by 2.8)
    torch.testing.assert_close(got, want, rtol=0, atol=64 * U32 * want.abs().max().item())
    with pytest.raises(AdminExportError, match="--qk-norm") as e:
        check_exportable(args)
    assert "\n" not in str(e.value)
