"""Decoder-only language models (``deepinit_lm``): every axis, the decoder-only formulas
by hand, Admin profiling and export, the bad-input rules, and train / resume / eval-lm / sampling.

In-process tests build models as fairseq-train does; the CLI tests share one tiny corpus (a
deterministic synthetic language of arithmetic word sequences, written by the test: no network).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO, USER_DIR, make_dictionary, run_cli
from fairseq_deepinit.errors import AdminConfigError, DeepInitConfigError

N_SYMBOLS = 50
LM_FAMILIES = (
    "postln",
    "preln",
    "lipschitz",
    "tfixup",
    "dsinit",
    "twt",
    "deepnorm",
    "rezero",
    "rezero_postln",
    "admin",
)


def build_lm(arch: str = "deepinit_lm_tiny", *cli: str, task: str = "language_modeling", seed: int = 1):
    """``(model, args, task)`` built in-process as fairseq-train builds them."""
    from fairseq import options, tasks

    import fairseq_deepinit  # noqa: F401  (registers the model)

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, ["/nonexistent", "--task", task, "--arch", arch, *cli])
    d = make_dictionary(N_SYMBOLS)
    task_obj = tasks.TASK_REGISTRY[task](args, d, d)
    torch.manual_seed(seed)
    return task_obj.build_model(args), args, task_obj


def tokens(bsz: int = 3, length: int = 9, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 4 + N_SYMBOLS, (bsz, length), generator=g)


def sublayer_linears(model) -> dict:
    """``{kind: [Linear, ...]}`` over every decoder layer (kind: q, k, v, out, fc1, fc2)."""
    out: dict = {k: [] for k in ("q", "k", "v", "out", "fc1", "fc2")}
    for layer in model.decoder.layers:
        a = layer.self_attn
        for kind, lin in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("out", a.out_proj)):
            out[kind].append(lin)
        out["fc1"].append(layer.fc1)
        out["fc2"].append(layer.fc2)
    return out


def pooled_std(linears, scale) -> tuple:
    """Std of ``w / scale(lin)`` pooled over ``linears`` (should be 1) and the number of entries."""
    x = torch.cat([(lin.weight.detach().double() / scale(lin)).flatten() for lin in linears])
    return x.std(unbiased=False).item(), x.numel()


# ---------------------------------------------------------------------------------------------
# the model and its axes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", LM_FAMILIES)
def test_every_family_builds_a_decoder_only_model(family):
    from fairseq_deepinit.lm.model import DeepInitLanguageModel

    model, args, _ = build_lm(f"{family}_lm_tiny", "--decoder-layers", "3")
    assert isinstance(model, DeepInitLanguageModel) and not hasattr(model, "encoder")
    assert args.encoder_layers == 0 and len(model.decoder.layers) == 3
    assert all(layer.encoder_attn is None for layer in model.decoder.layers)
    assert args.decoder_normalize_before == (family in ("preln", "twt"))  # not fairseq's forced Pre-LN
    out, _ = model(tokens())
    assert out.shape == (3, 9, len(model.decoder.dictionary)) and torch.isfinite(out).all()


@pytest.mark.parametrize("norm", ["layernorm", "scalenorm", "rmsnorm", "none"])
@pytest.mark.parametrize("pre", [False, True])
def test_norm_type_and_position(norm, pre):
    from fairseq_deepinit.modules.norms import is_norm

    cli = ["--norm-type", norm] + (["--decoder-normalize-before"] if pre else [])
    model, args, _ = build_lm("deepinit_lm_tiny", *cli)
    assert args.norm_type == norm and args.decoder_normalize_before == pre
    names = {type(m).__name__ for m in model.modules() if is_norm(m)}
    if norm == "none":
        assert not names
    else:
        assert len(names) == 1, names
        n_norms = sum(1 for m in model.modules() if is_norm(m))
        assert n_norms == 2 * 2 + (1 if pre else 0)  # two per layer, plus Pre-LN's final norm
    assert torch.isfinite(model(tokens())[0]).all()


@pytest.mark.parametrize("residual", ["none", "deepnorm", "rezero"])
def test_residual_scaling_axis(residual):
    from fairseq_deepinit.modules.residual import ConstantResidual, ReZeroResidual

    model, args, _ = build_lm("deepinit_lm_tiny", "--residual-scale", residual)
    mods = [m for layer in model.decoder.layers for m in layer.residuals.values()]
    assert len(mods) == 2 * 2  # self-attention and FFN: no cross-attention sub-layer
    want = {"none": "Residual", "deepnorm": ConstantResidual.__name__, "rezero": ReZeroResidual.__name__}[residual]
    assert {type(m).__name__ for m in mods} == {want}


def test_fixnorm_ties_unit_norm_embeddings():
    from fairseq_deepinit.modules.fixnorm import FixNormEmbedding, FixNormOutputProjection

    model, _, _ = build_lm("deepinit_lm_tiny", "--fixnorm", "--share-decoder-input-output-embed")
    assert isinstance(model.decoder.embed_tokens, FixNormEmbedding)
    assert isinstance(model.decoder.output_projection, FixNormOutputProjection)


# ---------------------------------------------------------------------------------------------
# decoder-only formulas, by hand
# ---------------------------------------------------------------------------------------------


@pytest.mark.numerics
def test_deepnorm_decoder_only_constants():
    """DeepNet Table 1, decoder-only: alpha = (2N)^(1/4), beta = (8N)^(-1/4) (not (3M)^(1/4), (12M)^(-1/4))."""
    n = 6
    model, _, _ = build_lm("deepnorm_lm_tiny", "--decoder-layers", str(n), "--decoder-embed-dim", "128")
    for layer in model.decoder.layers:
        for res in layer.residuals.values():
            assert res.alpha == pytest.approx(12**0.25, rel=1e-12)  # (2 * 6)^(1/4)
    beta = 48**-0.25  # (8 * 6)^(-1/4)
    lins = sublayer_linears(model)
    for kind in ("v", "out", "fc1", "fc2"):
        std, count = pooled_std(lins[kind], lambda lin: beta * math.sqrt(2.0 / (lin.in_features + lin.out_features)))
        assert abs(std - 1) < 6 / math.sqrt(2 * count), f"{kind}: std/(beta*xavier) = {std}"
    for kind in ("q", "k"):  # Figure 2: xavier_normal with gain 1
        std, count = pooled_std(lins[kind], lambda lin: math.sqrt(2.0 / (lin.in_features + lin.out_features)))
        assert abs(std - 1) < 6 / math.sqrt(2 * count), f"{kind}: std/xavier = {std}"


@pytest.mark.numerics
def test_tfixup_decoder_only_scales_the_baseline_exactly():
    """This project's decoder-only T-Fixup: the paper's decoder rules with N the layers, (9N)^(-1/4)."""
    n = 4
    cli = ("--decoder-layers", str(n), "--share-decoder-input-output-embed")
    model, args, _ = build_lm("tfixup_lm_tiny", *cli)
    base, _, _ = build_lm("postln_lm_tiny", *cli, "--norm-type", "none")
    assert args.norm_type == "none"
    s = 36**-0.25  # (9 * 4)^(-1/4)
    factors = {"fc1.weight": s, "fc2.weight": s, "self_attn.out_proj.weight": s, "self_attn.v_proj.weight": s * 2**0.5}
    b = dict(base.named_parameters())
    scaled = 0
    for name, p in model.named_parameters():
        suffix = name.split(".", 3)[-1]
        if ".layers." in name and suffix in factors:
            torch.testing.assert_close(p, b[name] * factors[suffix], rtol=0, atol=0)
            scaled += 1
        elif name == "decoder.embed_tokens.weight":
            torch.testing.assert_close(p, b[name] * s, rtol=0, atol=0)
        else:
            assert torch.equal(p, b[name]), name
    assert scaled == 4 * n
    assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight


@pytest.mark.numerics
def test_dsinit_per_layer_bound():
    model, _, _ = build_lm("dsinit_lm_tiny", "--decoder-layers", "4")
    for l_idx, layer in enumerate(model.decoder.layers, start=1):
        for lin in (layer.fc1, layer.fc2, layer.self_attn.q_proj, layer.self_attn.out_proj):
            bound = math.sqrt(6.0 / (lin.in_features + lin.out_features)) / math.sqrt(l_idx)
            w = lin.weight.detach().abs().max().item()
            assert bound * 0.98 <= w <= bound * (1 + 1e-6), (l_idx, w, bound)


@pytest.mark.numerics
def test_lipschitz_smallinit_rezero_closed_forms():
    model, _, _ = build_lm("lipschitz_lm_tiny")
    emb = model.decoder.embed_tokens
    bound = math.sqrt(2.0 / (emb.num_embeddings + emb.embedding_dim))
    assert bound * 0.98 <= emb.weight.abs().max().item() <= bound * (1 + 1e-6)
    for lin in sublayer_linears(model)["fc1"]:
        assert lin.weight.abs().max().item() <= 1 / math.sqrt(lin.in_features) * (1 + 1e-6)
    model, args, _ = build_lm("twt_lm_tiny", "--decoder-layers", "6")
    assert (args.norm_type, args.fixnorm, args.decoder_normalize_before) == ("scalenorm", True, True)
    for kind in ("q", "k", "v", "out"):
        std, count = pooled_std(sublayer_linears(model)[kind], lambda lin: math.sqrt(2.0 / (5 * lin.in_features)))
        assert abs(std - 1) < 6 / math.sqrt(2 * count), kind
    model, args, _ = build_lm("rezero_lm_tiny")
    assert args.norm_type == "none"
    assert all(r.alpha.item() == 0.0 for layer in model.decoder.layers for r in layer.residuals.values())


def _capture(model, net_input) -> list:
    """``(branch, skip input)`` of every Admin sub-layer, in forward order, from a fresh forward pass."""
    from fairseq_deepinit.admin import admin_residuals

    seen, handles = [], []
    for m in admin_residuals(model).values():
        handles.append(m.register_forward_hook(lambda mod, inp, out: seen.append((inp[0], inp[1], mod.omega))))
    with torch.no_grad():
        model.decoder.extract_features(net_input["src_tokens"], encoder_out=None)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.numerics
@pytest.mark.parametrize("formula", ["code", "paper"])
def test_admin_decoder_only_omega_closed_form(formula):
    """One stack: omega_1 = 1, then the released code's recurrence / the paper's sum over the 2N sub-layers."""
    from fairseq_deepinit.admin import profile_model

    model, _, _ = build_lm("admin_lm_tiny", "--decoder-layers", "3")
    model.eval()  # deterministic: the recomputation below sees the profiling pass's activations
    net_input = {"src_tokens": tokens(4, 11)}
    if formula == "paper":
        unit = _capture(model, net_input)  # omega = 1 everywhere, as the paper profiles
    profile = profile_model(model, net_input, formula)
    omegas = [row["omega"] for row in profile["sublayers"]]
    assert len(omegas) == 6 and omegas[0] == 1.0
    if formula == "code":
        rows = _capture(model, net_input)
        for i in range(1, 6):
            branch, skip, omega = rows[i - 1]
            want = math.sqrt((skip * omega).double().var(unbiased=False).item() + branch.double().var(unbiased=False))
            assert omegas[i] == pytest.approx(want, rel=1e-5), i
    else:
        variances = [b.double().var(unbiased=False).item() for b, _s, _w in unit]
        for i in range(1, 6):
            assert omegas[i] == pytest.approx(math.sqrt(sum(variances[:i])), rel=1e-5), i


# the successor families (docs/schemes.md): decoder-only constants by the layers' kind (test_successors.py)
SUCCESSOR_LM_FAMILIES = ("admin_closed", "deepnorm_torchscale", "subln", "b2t", "normformer")


@pytest.mark.parametrize("family", SUCCESSOR_LM_FAMILIES)
def test_successor_families_build_decoder_only_models(family):
    model, args, _ = build_lm(f"{family}_lm_tiny", "--decoder-layers", "3", "--dropout", "0")
    assert args.encoder_layers == 0 and len(model.decoder.layers) == 3
    assert {layer.kind.name for layer in model.decoder.layers} == {"decoder-only"}
    model.eval()
    toks = tokens(2, 6)
    with torch.no_grad():
        full = model(toks)[0]
        state: dict = {}
        steps = [model.decoder(toks[:, : t + 1], incremental_state=state)[0] for t in range(toks.size(1))]
    assert torch.isfinite(full).all()
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)


def test_incremental_decoding_matches_full_forward_for_every_family():
    """What fairseq-interactive / sequence generation uses: step-by-step logits == one full pass."""
    for family in LM_FAMILIES:
        model, _, _ = build_lm(f"{family}_lm_tiny", "--decoder-layers", "2", "--dropout", "0")
        model.eval()
        toks = tokens(2, 6)
        with torch.no_grad():
            full = model(toks)[0]
            state: dict = {}
            steps = [model.decoder(toks[:, : t + 1], incremental_state=state)[0] for t in range(toks.size(1))]
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5, msg=family)


# ---------------------------------------------------------------------------------------------
# bad input: one DeepInitConfigError with a message that says what to change
# ---------------------------------------------------------------------------------------------

BAD = [
    (("deepinit_lm_tiny", "--decoder-layer-type", "matt"), "decoder-only language model does not have"),
    (("deepnorm_lm_tiny", "--decoder-normalize-before"), "defined for Post-LN only"),
    (("admin_lm_tiny", "--decoder-normalize-before"), "defined for Post-LN only"),
    (("admin_lm_tiny", "--norm-type", "none"), "needs --norm-type"),
    (("deepinit_lm_tiny", "--fixnorm"), "--share-decoder-input-output-embed"),
    (("tfixup_lm_tiny", "--norm-type", "layernorm"), "--force-norm-with-scheme"),
    (("tfixup_lm_tiny", "--fixnorm", "--share-decoder-input-output-embed"), "undo T-Fixup"),
    (("lipschitz_lm_tiny", "--adaptive-input", "--adaptive-input-cutoff", "20"), "--adaptive-input replaces"),
    (("deepinit_lm_tiny", "--character-embeddings", "--init-scheme", "t-fixup"), "--character-embeddings"),
    (("deepinit_lm_tiny", "--norm-eps", "0"), "--norm-eps must be"),
    (("deepinit_lm_tiny", "--ds-init-alpha", "0.5"), "only applies to --init-scheme ds-init"),
    (("admin_lm_tiny", "--admin-profile-batches", "2"), "--task language_modeling_admin"),
    (("admin_lm_tiny", "--decoder-layerdrop", "0.1"), "--decoder-layerdrop"),
    (("deepinit_lm_tiny", "--tie-adaptive-weights"), "--tie-adaptive-weights needs"),
]


@pytest.mark.parametrize("cli,message", BAD, ids=[" ".join(c[1:]) or c[0] for c, _ in BAD])
def test_bad_input_is_refused(cli, message):
    with pytest.raises(DeepInitConfigError, match=re.escape(message)):
        build_lm(*cli)


def test_admin_task_refuses_a_model_without_omega():
    with pytest.raises(AdminConfigError, match="has none"):
        build_lm("deepnorm_lm_tiny", task="language_modeling_admin")


def test_cross_entropy_diagnostics_refuses_label_smoothing():
    from fairseq_deepinit.lm.criterion import CrossEntropyDiagnosticsCriterion

    _, _, task = build_lm()
    with pytest.raises(DeepInitConfigError, match="plain cross-entropy"):
        CrossEntropyDiagnosticsCriterion(task, False, label_smoothing=0.1)


def test_profiling_batch_merge_and_cap():
    from fairseq_deepinit.lm.task import merge_and_cap_lm

    a = torch.tensor([[5, 6, 7, 2], [5, 6, 1, 1]])
    b = torch.tensor([[8, 9, 2]])
    net, dropped = merge_and_cap_lm([{"src_tokens": a}, {"src_tokens": b}], pad=1, max_tokens=8)
    assert dropped == 1 and net["src_tokens"].tolist() == [[5, 6, 7, 2], [5, 6, 1, 1]]
    assert net["src_lengths"].tolist() == [4, 2]
    net, dropped = merge_and_cap_lm([{"src_tokens": b}], pad=1, max_tokens=1)
    assert dropped == 0 and net["src_tokens"].tolist() == [[8, 9, 2]]  # at least one row


# ---------------------------------------------------------------------------------------------
# end to end: fairseq-train, resume, eval-lm, interactive sampling, Admin, export, ranks
# ---------------------------------------------------------------------------------------------

TRAIN = [
    "--tokens-per-sample", "32", "--max-tokens", "256", "--optimizer", "adam", "--lr", "2e-3",
    "--num-workers", "0", "--cpu", "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "5",
    "--seed", "1", "--decoder-layers", "3",
]  # fmt: skip


def _ppl(output: str) -> float:
    m = re.search(r"Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.]+)", output)
    assert m, output[-2000:]
    return float(m.group(2))


def test_train_resume_eval_lm_and_sample(lm_bin, tmp_path):
    save = tmp_path / "ckpt"
    common = [lm_bin, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "deepnorm_lm_tiny", *TRAIN]
    common += ["--criterion", "cross_entropy_diagnostics", "--diagnostics-interval", "5", "--save-dir", save]
    out = run_cli("train", *common, "--max-update", "10").stdout
    assert "diag_gnorm/decoder.layers.2=" in out and "diag_var/decoder.layers.0.self_attn=" in out
    out = run_cli("train", *common, "--max-update", "15").stdout  # resumes checkpoint_last.pt
    assert "Loaded checkpoint" in out and "(epoch" in out
    ckpt = torch.load(save / "checkpoint_last.pt", weights_only=False)
    assert ckpt["optimizer_history"][-1]["num_updates"] == 15
    ev = run_cli("eval_lm", lm_bin, "--user-dir", USER_DIR, "--path", save / "checkpoint_last.pt",
                 "--tokens-per-sample", "32", "--cpu", "--num-workers", "0").stdout  # fmt: skip
    assert 1.0 < _ppl(ev) < 60  # learned something of a 34-word vocabulary
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "fairseq_cli.interactive",
            lm_bin,
            "--user-dir",
            USER_DIR,
            "--task",
            "language_modeling",
            "--path",
            save / "checkpoint_last.pt",
            "--sampling",
            "--beam",
            "1",
            "--seed",
            "3",
            "--max-len-b",
            "8",
            "--cpu",
        ],  # fmt: skip
        input="w3 w5 w7\n",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        timeout=300,
    )
    assert gen.returncode == 0, gen.stdout[-3000:]
    hyp = [line for line in gen.stdout.splitlines() if line.startswith("H-0")]
    assert hyp and hyp[0].split("\t")[2].startswith("w3 w5 w7"), gen.stdout[-2000:]


@pytest.mark.parametrize("family", ["subln", "admin_closed"])
def test_successor_lm_trains(family, lm_bin, tmp_path):
    """Sub-LN's LM builds under fairseq-train (it asked for --encoder-normalize-before, which the LM parser lacks);
    closed-form Admin trains under the plain language_modeling task (omega set at build time, never profiled)."""
    out = run_cli("train", lm_bin, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch",
                  f"{family}_lm_tiny", *TRAIN, "--max-update", "6", "--no-save", "--disable-validation",
                  "--save-dir", tmp_path).stdout  # fmt: skip
    assert "done training" in out and re.search(r"num_updates 6\b", out), out[-2000:]
    assert ("subln" in out) if family == "subln" else ("residual=admin" in out), out[-2000:]
    losses = [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", out)]
    assert losses and all(math.isfinite(x) for x in losses), out[-2000:]


def test_admin_lm_task_profiles_and_exports_to_stock_transformer_lm(lm_bin, tmp_path):
    save = tmp_path / "ckpt"
    run_cli("train", lm_bin, "--user-dir", USER_DIR, "--task", "language_modeling_admin", "--arch", "admin_lm_tiny",
            *TRAIN, "--save-dir", save, "--max-update", "8")  # fmt: skip
    state = torch.load(save / "checkpoint_last.pt", weights_only=False)
    omega = [k for k in state["model"] if k.endswith(".omega")]
    assert len(omega) == 6 and all(bool(state["model"][k.replace("omega", "profiled")]) for k in omega)
    assert state["model"]["decoder.layers.2.residuals.ffn.omega"].mean() > 1.0
    env = {"PYTHONPATH": str(REPO)}
    exp = subprocess.run(
        [sys.executable, "-m", "fairseq_deepinit.lm.export", save / "checkpoint_last.pt", tmp_path / "stock.pt"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env}, timeout=300,
    )  # fmt: skip
    assert exp.returncode == 0 and "arch transformer_lm" in exp.stdout, exp.stdout[-3000:]
    eval_args = ["--tokens-per-sample", "32", "--cpu", "--num-workers", "0"]
    plugin = run_cli("eval_lm", lm_bin, "--user-dir", USER_DIR, "--path", save / "checkpoint_last.pt", *eval_args)
    stock = run_cli("eval_lm", lm_bin, "--path", tmp_path / "stock.pt", *eval_args)  # no --user-dir
    assert "fairseq_deepinit" not in stock.stdout
    assert _ppl(stock.stdout) == pytest.approx(_ppl(plugin.stdout), rel=1e-3)
    bad = subprocess.run(
        [sys.executable, "-m", "fairseq_deepinit.lm.export", tmp_path / "stock.pt", tmp_path / "again.pt"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env}, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 1 and "error:" in bad.stdout.splitlines()[-1]


def test_bad_input_ends_the_command_with_one_line(lm_bin, tmp_path):
    proc = run_cli("train", lm_bin, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch",
                   "deepinit_lm_tiny", "--decoder-layer-type", "matt", *TRAIN, "--save-dir", tmp_path,
                   check=False)  # fmt: skip
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    errors = [line for line in proc.stdout.splitlines() if "error:" in line]
    assert len(errors) == 1 and "decoder-only language model" in errors[0], proc.stdout[-2000:]


def test_two_ranks_profile_the_same_omega(lm_bin, tmp_path):
    from test_admin_distributed import WORKER, free_port, torchrun

    dump = tmp_path / "dump"
    dump.mkdir()
    cmd = [*torchrun(), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(WORKER), str(lm_bin), "--user-dir", USER_DIR, "--task", "language_modeling_admin", "--arch",
           "admin_lm_tiny", *TRAIN, "--max-tokens", "128", "--max-update", "2", "--no-save", "--save-dir",
           str(tmp_path / "ckpt"), "--disable-validation", "--distributed-world-size", "2",
           "--distributed-init-method", "env://", "--distributed-backend", "gloo", "--distributed-no-spawn",
           "--ddp-backend", "legacy_ddp"]  # fmt: skip
    env = {**os.environ, "ADMIN_DUMP_DIR": str(dump), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "2 rank(s)" in proc.stdout
    a, b = (torch.load(dump / f"rank{r}.pt") for r in (0, 1))
    assert not torch.equal(a["first_ids"], b["first_ids"])  # different batches ...
    for key in a["state"]:  # ... one omega, and identical weights after the updates
        assert torch.equal(a["state"][key], b["state"][key]), key
    assert a["state"]["decoder.layers.2.residuals.ffn.omega"].mean() > 1.0


def test_numpy_compat_lets_fairseq_build_eos_blocks():
    from fairseq.data import TokenBlockDataset

    import fairseq_deepinit  # noqa: F401  (installs numpy.compat.long where numpy >= 2 lacks it)

    ds = [torch.tensor([4, 5, 2]), torch.tensor([6, 2])]
    blocks = TokenBlockDataset(ds, [3, 2], block_size=None, pad=1, eos=2, break_mode="eos")
    assert len(blocks) == 2


def test_lm_architectures_cover_fairseq_sizes():
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    import fairseq_deepinit  # noqa: F401

    for family in LM_FAMILIES:
        for size in ("lm", "lm_big", "lm_gpt", "lm_gpt2_small", "lm_24l", "lm_48l", "lm_tiny_48l"):
            assert ARCH_MODEL_NAME_REGISTRY.get(f"{family}_{size}") == "deepinit_lm", (family, size)
    assert "matt_lm" not in ARCH_MODEL_NAME_REGISTRY and "dsinit_matt_lm" not in ARCH_MODEL_NAME_REGISTRY
    _, args, _ = build_lm("preln_lm_big")
    assert (args.decoder_embed_dim, args.decoder_layers, args.decoder_attention_heads) == (1024, 12, 16)


def test_divergence_guard_names_the_layer(lm_bin, tmp_path):
    proc = run_cli("train", lm_bin, "--user-dir", USER_DIR, "--task", "language_modeling", "--arch", "postln_lm_tiny",
                   *TRAIN, "--criterion", "cross_entropy_diagnostics", "--diagnostics-inject-nan",
                   "3:decoder.layers.1.fc1.weight", "--save-dir", tmp_path, "--max-update", "5",
                   check=False)  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "divergence guard: training stopped at update 3" in proc.stdout
    assert "decoder.layers.1" in proc.stdout.split("divergence guard", 1)[1]
    assert not (tmp_path / "checkpoint_last.pt").exists()


def test_preln_lm_is_stock_transformer_lm_parameter_for_parameter():
    """``preln_lm_big`` under ``--init-scheme fairseq`` is fairseq's ``transformer_lm_big``, parameter for parameter."""
    from fairseq import options
    from fairseq.models.transformer_lm import TransformerLanguageModel
    from fairseq.tasks.language_modeling import LanguageModelingTask

    dims = ["--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64"]
    ours, _, _ = build_lm("preln_lm_big", *dims, "--init-scheme", "fairseq")
    args = options.parse_args_and_arch(
        options.get_training_parser(),
        ["/nonexistent", "--task", "language_modeling", "--arch", "transformer_lm_big", *dims],
    )
    d = make_dictionary(N_SYMBOLS)
    stock = LanguageModelingTask(args, d, d).build_model(args)
    assert type(stock) is TransformerLanguageModel
    theirs = {k: tuple(v.shape) for k, v in stock.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == theirs
    ours.load_state_dict(stock.state_dict())
    ours.eval()
    stock.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens())[0], stock(tokens())[0])


def test_normformer_options_on_the_language_model():
    """fairseq's transformer_lm defines --scale-attn/--scale-fc/--scale-heads itself; the plugin's NormFormer
    options reuse them (no duplicate flags) and keep the Pre-LN rule for a decoder-only model."""
    model, _, _ = build_lm("preln_lm_tiny", "--scale-attn", "--scale-fc", "--scale-heads")
    layer = model.decoder.layers[0]
    assert layer.attn_ln is not None and layer.ffn_layernorm is not None and layer.c_attn is not None
    with pytest.raises(DeepInitConfigError, match="add --decoder-normalize-before "):
        build_lm("postln_lm_tiny", "--scale-attn")
