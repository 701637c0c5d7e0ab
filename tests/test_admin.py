"""Admin (Liu et al. 2020): omega by hand, profiling in fairseq-train, profile files, bad input, the
export to a stock Post-LN ``transformer``, and the deep Post-LN that only trains with Admin.

The two-rank test is in ``test_admin_distributed.py``.
"""

from __future__ import annotations

import json
import math
import re
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fairseq.data import Dictionary, data_utils
from fairseq.models import build_model as fairseq_build_model
from omegaconf import OmegaConf

from conftest import USER_DIR, build_model, make_dictionary, run_cli
from fairseq_deepinit import admin, errors
from fairseq_deepinit.admin import export as export_admin
from fairseq_deepinit.admin.task import TranslationAdminTask, merge_and_cap
from fairseq_deepinit.model import DeepInitTransformerModel

PAD = 1
DIMS3 = ["--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
         "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2",
         "--decoder-attention-heads", "2", "--dropout", "0"]  # fmt: skip


def padded_batch(n_symbols: int = 50, seed: int = 0) -> dict:
    """3 sentences, the first two source sentences left-padded (as fairseq batches them)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 4 + n_symbols, (3, 7), generator=g)
    src[0, :2] = PAD
    src[1, :1] = PAD
    prev = torch.randint(4, 4 + n_symbols, (3, 6), generator=g)
    prev[:, 0] = 2  # eos starts prev_output_tokens
    prev[2, -2:] = PAD  # right padding on the target side
    return {"src_tokens": src, "src_lengths": src.ne(PAD).sum(1), "prev_output_tokens": prev}


def var(t: torch.Tensor) -> float:
    return t.double().var(unbiased=False).item()


def by_hand(model, batch: dict, formula: str) -> list[float]:
    """omega of every sub-layer, computed with the model's sub-modules but our own layer glue.

    ``code``: x_i = LN(x_{i-1} * r_i + f_i), r_1 = 1, r_{i+1} = sqrt(Var(x_{i-1} r_i) + Var(f_i)) per stack
    (released code). ``paper``: the same pass with omega = 1, then omega_i = sqrt(sum_{j<i} Var f_j),
    omega_1 = 1.
    """
    enc, dec = model.encoder, model.decoder

    def stack(x, steps):
        ratio, omegas, branch_vars = 1.0, [], []
        for branch, norm in steps:
            f = branch(x)
            w = ratio if formula == "code" else 1.0
            omegas.append(w)
            branch_vars.append(var(f))
            ratio = math.sqrt(var(x * w) + var(f))
            x = norm(x * w + f)
        if formula == "paper":
            omegas = [1.0] + [math.sqrt(sum(branch_vars[:i])) for i in range(1, len(steps))]
        return x, omegas

    def ffn(layer):
        return lambda x: layer.fc2(torch.relu(layer.fc1(x)))

    with torch.no_grad():
        src, prev = batch["src_tokens"], batch["prev_output_tokens"]
        src_mask = src.eq(PAD)
        x = enc.embed_scale * enc.embed_tokens(src) + enc.embed_positions(src)
        x = (x * (~src_mask).unsqueeze(-1)).transpose(0, 1)  # fairseq zeroes padded source positions
        steps = []
        for layer in enc.layers:
            steps.append(
                (lambda x, a=layer.self_attn: a(x, x, x, key_padding_mask=src_mask)[0], layer.self_attn_layer_norm)
            )
            steps.append((ffn(layer), layer.final_layer_norm))
        memory, enc_omegas = stack(x, steps)

        y = (dec.embed_scale * dec.embed_tokens(prev) + dec.embed_positions(prev)).transpose(0, 1)
        causal = dec.buffered_future_mask(y)
        tgt_mask = prev.eq(PAD)
        steps = []
        for layer in dec.layers:
            steps.append(
                (lambda y, a=layer.self_attn: a(y, y, y, key_padding_mask=tgt_mask, attn_mask=causal)[0],
                 layer.self_attn_layer_norm)
            )  # fmt: skip
            steps.append(
                (lambda y, a=layer.encoder_attn: a(y, memory, memory, key_padding_mask=src_mask, static_kv=True)[0],
                 layer.encoder_attn_layer_norm)
            )  # fmt: skip
            steps.append((ffn(layer), layer.final_layer_norm))
        _, dec_omegas = stack(y, steps)
    return enc_omegas + dec_omegas


@pytest.mark.parametrize("formula", ["code", "paper"])
def test_omega_equals_by_hand_computation(formula):
    model, args = build_model("admin_iwslt_de_en", *DIMS3, "--admin-formula", formula)
    model.train()  # profiling runs in training mode (dropout is 0 here, so it is deterministic)
    batch = padded_batch()
    want = by_hand(model, batch, formula)
    profile = admin.profile_model(model, batch, formula)
    residuals = admin.admin_residuals(model)
    assert len(residuals) == 3 * 2 + 3 * 3 and len(want) == len(residuals)
    got = [m.omega.detach() for m in residuals.values()]
    for name, w, g in zip(residuals, want, got, strict=True):
        assert torch.allclose(g, torch.full_like(g, w), rtol=1e-5), (name, w, g[:3])
    assert [r["omega"] for r in profile["sublayers"]] == pytest.approx(want, rel=1e-5)
    assert all(bool(m.profiled) for m in residuals.values()) and admin.is_profiled(model)
    # omega grows with depth (from the second sub-layer on) and restarts at 1 for the decoder
    assert want[0] == want[6] == 1.0 and want[5] > want[1] and want[-1] > want[7]
    if formula == "code":
        # the profile's numbers satisfy the recurrence they came from
        rows = profile["sublayers"]
        for prev, row in zip(rows[:5], rows[1:6], strict=True):
            assert row["omega"] == pytest.approx(math.sqrt(prev["var_skip"] + prev["var_branch"]), rel=1e-9)


def test_profile_counts_padding_and_reports_shape():
    model, _ = build_model("admin_iwslt_de_en", *DIMS3)
    model.train()
    batch = padded_batch()
    profile = admin.profile_model(model, batch)
    row = profile["sublayers"][0]
    assert row["elements"] == 3 * 7 * 16  # every element, padding included (released code: np.var of all)
    assert profile["source_shape"] == [3, 7] and profile["target_shape"] == [3, 6]
    assert profile["encoder_layers"] == 3 and profile["decoder_embed_dim"] == 16


def test_paper_formula_closed_form():
    assert admin.paper_omegas([0.25, 0.5, 1.0]) == pytest.approx([1.0, 0.5, math.sqrt(0.75)])
    assert admin.code_ratio(1.5, 0.75) == pytest.approx(1.5)


def test_merge_and_cap_keeps_padded_tokens_under_the_cap():
    a = {"src_tokens": torch.tensor([[PAD, 5, 6], [7, 8, 9]]), "prev_output_tokens": torch.tensor([[2, 5], [2, 6]])}
    b = {"src_tokens": torch.tensor([[PAD, PAD, PAD, 5, 6], [4, 5, 6, 7, 8]]),
         "prev_output_tokens": torch.tensor([[2, 5, 6, PAD], [2, 4, 5, 6]])}  # fmt: skip
    merged, dropped = merge_and_cap([a, b], PAD, True, False, max_tokens=10**6)
    assert dropped == 0 and merged["src_tokens"].shape == (4, 5) and merged["prev_output_tokens"].shape == (4, 4)
    assert merged["src_tokens"][0].tolist() == [PAD, PAD, PAD, 5, 6]  # left padding kept on the left
    assert merged["prev_output_tokens"][0].tolist() == [2, 5, PAD, PAD]
    assert merged["src_lengths"].tolist() == [2, 3, 2, 5]
    # cap 9: 3 rows x max(3, 3) = 9 fit; the 4th would make 4 x 5 = 20
    capped, dropped = merge_and_cap([a, b], PAD, True, False, max_tokens=9)
    assert dropped == 1 and capped["src_tokens"].shape == (3, 3) and capped["prev_output_tokens"].shape == (3, 3)
    one, dropped = merge_and_cap([b], PAD, True, False, max_tokens=1)
    assert dropped == 1 and one["src_tokens"].tolist() == [[5, 6]]  # at least one sentence, trimmed


# ----------------------------------------------------------------------------------------------
# bad input


def test_admin_with_pre_ln_is_refused():
    with pytest.raises(errors.DeepInitConfigError, match="Post-LN only"):
        build_model("admin_iwslt_de_en", *DIMS3, "--encoder-normalize-before")
    with pytest.raises(errors.DeepInitConfigError, match="Post-LN only"):
        build_model("preln_iwslt_de_en", *DIMS3, "--residual-scale", "admin")


@pytest.mark.parametrize(
    "cli, match",
    [
        (("--arch", "postln_iwslt_de_en", "--admin-formula", "paper"), "only applies to --residual-scale admin"),
        (("--arch", "admin_iwslt_de_en", "--admin-profile-only"), "add it"),
        (("--arch", "admin_iwslt_de_en", "--admin-profile-batches", "0"), "at least 1"),
        (("--arch", "admin_iwslt_de_en", "--admin-profile-path", "p.json"), "--task translation_admin"),
        (("--arch", "admin_iwslt_de_en", "--norm-type", "none", "--force-norm-with-scheme"), "needs one"),
    ],
)
def test_bad_options_are_refused_at_start_up(cli, match):
    with pytest.raises(errors.DeepInitConfigError, match=re.escape(match)):
        build_model(cli[1], *DIMS3, *cli[2:])


def test_profile_that_does_not_fit_the_model_is_refused(tmp_path):
    model, _ = build_model("admin_iwslt_de_en", *DIMS3)
    model.train()
    path = tmp_path / "p.json"
    admin.save_profile(admin.profile_model(model, padded_batch()), str(path))
    profile = admin.load_profile(str(path))
    deeper, _ = build_model("admin_iwslt_de_en", *DIMS3, "--encoder-layers", "4")
    with pytest.raises(errors.AdminConfigError, match="encoder layers = 3, but this model has 4"):
        admin.apply_profile(deeper, profile, "code", str(path))
    wider, _ = build_model(
        "admin_iwslt_de_en", *DIMS3, "--decoder-embed-dim", "32", "--encoder-embed-dim", "32"
    )  # fmt: skip
    with pytest.raises(errors.AdminConfigError, match="embed dim = 16, but this model has 32"):
        admin.apply_profile(wider, profile, "code", str(path))
    with pytest.raises(errors.AdminConfigError, match="--admin-formula code"):
        admin.apply_profile(model, profile, "paper", str(path))
    with pytest.raises(errors.AdminConfigError, match="not found"):
        admin.load_profile(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(errors.AdminConfigError, match="not an Admin profile"):
        admin.load_profile(str(tmp_path / "bad.json"))
    # a fitting profile sets omega and marks the model profiled
    fresh, _ = build_model("admin_iwslt_de_en", *DIMS3)
    admin.apply_profile(fresh, profile, "code", str(path))
    assert admin.is_profiled(fresh)
    assert [m.omega[0].item() for m in admin.admin_residuals(fresh).values()] == pytest.approx(
        [r["omega"] for r in profile["sublayers"]]
    )


def test_profiling_task_refuses_a_model_without_omega():
    model, args = build_model("postln_iwslt_de_en", *DIMS3)
    with pytest.raises(errors.AdminConfigError, match="no Admin omega"):
        admin.profile_model(model, padded_batch())
    d = make_dictionary()
    task = TranslationAdminTask(args, d, d)
    with pytest.raises(errors.AdminConfigError, match="--task translation_admin profiles Admin's omega"):
        task.build_model(args)


def test_task_profiles_once_before_the_first_update_and_never_after_resume():
    """``train_step`` as fairseq's trainer calls it: profile on the first batch, then train."""
    from fairseq.criterions.cross_entropy import CrossEntropyCriterion

    _, args = build_model("admin_iwslt_de_en", *DIMS3)
    d = make_dictionary()
    task = TranslationAdminTask(args, d, d)
    model = task.build_model(args)
    net_input = padded_batch()
    target = torch.cat([net_input["prev_output_tokens"][:, 1:], torch.full((3, 1), 2)], 1)
    target[target.eq(PAD)] = PAD
    sample = {"id": torch.arange(3), "net_input": net_input, "target": target, "nsentences": 3,
              "ntokens": int(target.ne(PAD).sum())}  # fmt: skip
    criterion = CrossEntropyCriterion(task, sentence_avg=False)
    optimizer = SimpleNamespace(backward=lambda loss: loss.backward())
    residuals = admin.admin_residuals(model)
    assert not admin.is_profiled(model)
    task.train_step(sample, model, criterion, optimizer, update_num=0)
    assert admin.is_profiled(model)
    profiled = [m.omega.detach().clone() for m in residuals.values()]
    assert profiled[1][0] > 1.0 and all(w.grad is not None for w in admin.omega_parameters(model))  # trainable
    with torch.no_grad():  # an optimizer step would move omega; a later batch must not re-profile
        for m in residuals.values():
            m.omega.mul_(1.5)
    task.train_step(sample, model, criterion, optimizer, update_num=1)
    assert all(torch.equal(m.omega, 1.5 * w) for m, w in zip(residuals.values(), profiled, strict=True))
    # a resumed run: new task and model, the checkpoint's state loaded before the first batch
    task2 = TranslationAdminTask(args, d, d)
    model2 = task2.build_model(args)
    model2.load_state_dict(model.state_dict())
    task2.train_step(sample, model2, criterion, optimizer, update_num=2)
    assert all(
        torch.equal(a.omega, b.omega)
        for a, b in zip(admin.admin_residuals(model2).values(), residuals.values(), strict=True)
    )


def test_training_an_unprofiled_admin_model_is_an_error():
    model, _ = build_model("admin_iwslt_de_en", *DIMS3)
    model.train()
    model(**padded_batch())  # a forward outside fairseq's training step is fine (diagnostics)
    model.set_num_updates(0)  # fairseq's train_step does this before the forward
    with pytest.raises(errors.AdminNotProfiledError, match="--task translation_admin"):
        model(**padded_batch())
    admin.profile_model(model, padded_batch())
    model(**padded_batch())
    model.eval()


def test_fp16_master_weights_get_the_profiled_omega():
    """--fp16 keeps fp32 master weights built before the first batch; they must see the new omega."""
    model, _ = build_model("admin_iwslt_de_en", *DIMS3)
    params = [p for p in model.parameters() if p.requires_grad]
    omegas = admin.omega_parameters(model)
    flat = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    flat_opt = SimpleNamespace(fp16_params=params, fp32_params={None: torch.nn.Parameter(flat)}, has_flat_params=True)
    listed = SimpleNamespace(
        fp16_params=params, fp32_params=[torch.nn.Parameter(p.detach().clone()) for p in params], has_flat_params=False
    )  # fmt: skip
    model.train()
    admin.profile_model(model, padded_batch())
    assert admin.refresh_master_params(flat_opt, omegas) == len(omegas)
    assert admin.refresh_master_params(listed, omegas) == len(omegas)
    offset = 0
    for p, p32 in zip(params, listed.fp32_params, strict=True):
        n = p.numel()
        torch.testing.assert_close(flat_opt.fp32_params[None].data[offset : offset + n].view_as(p), p.detach())
        torch.testing.assert_close(p32.data, p.detach())
        offset += n
    assert admin.refresh_master_params(SimpleNamespace(), omegas) == 0  # plain fp32 optimizers


# ----------------------------------------------------------------------------------------------
# export (paper appendix C)


def _randomise(model, seed: int, same_first_omega: bool = False) -> None:
    """A 'trained' Admin model: per-dimension omega far from 1 (first sub-layer included), LN moved."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in admin.admin_residuals(model).values():
            m.omega.copy_(0.4 + 2.0 * torch.rand(m.omega.shape, generator=g))
            m.profiled.fill_(1)
        if same_first_omega:
            model.decoder.layers[0].residuals["self_attn"].omega.copy_(
                model.encoder.layers[0].residuals["self_attn"].omega
            )
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize(
    "flags, changes",
    [
        (("--share-all-embeddings",), {"share_all_embeddings": False, "encoder_learned_pos": True}),
        (("--share-decoder-input-output-embed",), {"decoder_learned_pos": True}),
        ((), {"encoder_learned_pos": True, "decoder_learned_pos": True}),
        (("--layernorm-embedding", "--share-all-embeddings"), {}),
        (("--encoder-learned-pos", "--decoder-learned-pos", "--share-all-embeddings", "same"), {}),
        (("--no-token-positional-embeddings",), {}),
    ],
)
def test_export_folds_omega_exactly(flags, changes):
    same = "same" in flags
    flags = tuple(f for f in flags if f != "same")
    model, args = build_model("admin_iwslt_de_en", *DIMS3, *flags)
    _randomise(model, seed=len(flags), same_first_omega=same)
    sd, got = export_admin.fold_state_dict(model.state_dict(), args, dtype=torch.float64)
    for key, value in changes.items():
        assert got[key] == value, got
    if same:
        assert "share_all_embeddings" not in got  # one shared embedding, scaled once
    plain_args = export_admin.export_args(args, got)
    assert plain_args["arch"] == "transformer" and "init_scheme" not in plain_args and "admin_formula" not in plain_args
    diff = export_admin.verify(model.state_dict(), args, sd, plain_args, tolerance=1e-9)
    assert diff < 1e-9  # folded and compared in float64: the same function up to rounding


def test_export_refuses_what_a_stock_transformer_cannot_represent():
    _, args = build_model("admin_iwslt_de_en", *DIMS3, "--norm-type", "rmsnorm")
    with pytest.raises(errors.AdminExportError, match="--norm-type rmsnorm"):
        export_admin.check_exportable(args)
    _, args = build_model("postln_iwslt_de_en", *DIMS3)
    with pytest.raises(errors.AdminExportError, match="not Admin"):
        export_admin.check_exportable(args)


# ----------------------------------------------------------------------------------------------
# fairseq-train / fairseq-generate end to end (tiny model on the synthetic corpus)

TRAIN = ["--user-dir", USER_DIR, "--task", "translation_admin", "-s", "src", "-t", "tgt", "--arch", "admin_iwslt_de_en",
         "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
         "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
         "--decoder-attention-heads", "2", "--share-all-embeddings", "--optimizer", "adam", "--lr", "3e-3",
         "--max-tokens", "600", "--dropout", "0.1", "--cpu", "--num-workers", "0", "--no-epoch-checkpoints",
         "--log-format", "simple", "--log-interval", "10", "--seed", "1"]  # fmt: skip
OMEGA_LINE = re.compile(r"admin: (\w+\.layers\.\d+\.\w+)\s+\S+\s+\S+\s+(\S+)")


def logged_omegas(log: str) -> dict:
    return {name: float(w) for name, w in OMEGA_LINE.findall(log)}


@pytest.fixture(scope="module")
def runs(synthetic_bin, tmp_path_factory):
    """profile-only run -> training from the profile -> export -> generate with both checkpoints."""
    root = tmp_path_factory.mktemp("admin")
    profile = root / "profile" / "admin.json"
    out = SimpleNamespace(root=root, profile=profile, data=synthetic_bin)
    out.profile_log = run_cli(
        "train", synthetic_bin, *TRAIN, "--save-dir", root / "profile_only", "--admin-profile-only",
        "--admin-profile-path", profile, "--admin-profile-batches", "3", "--admin-profile-max-tokens", "1000",
    ).stdout  # fmt: skip
    save = root / "ckpt"
    out.train_log = run_cli("train", synthetic_bin, *TRAIN, "--save-dir", save, "--max-update", "30",
                            "--admin-profile-path", profile).stdout  # fmt: skip
    out.checkpoint = save / "checkpoint_last.pt"
    out.exported = root / "plain.pt"
    assert export_admin.main([str(out.checkpoint), str(out.exported)]) == 0  # the console command's entry point
    gen = ["-s", "src", "-t", "tgt", "--gen-subset", "test", "--beam", "4", "--batch-size", "50",
           "--required-batch-size-multiple", "1", "--cpu"]  # fmt: skip
    with ThreadPoolExecutor(max_workers=2) as pool:  # overlap the two start-ups
        plain = pool.submit(run_cli, "generate", synthetic_bin, "--path", out.exported, *gen)  # no --user-dir
        adm = pool.submit(run_cli, "generate", synthetic_bin, "--user-dir", USER_DIR, "--path", out.checkpoint, *gen)
        out.gen_plain, out.gen_admin = plain.result().stdout, adm.result().stdout
    return out


def test_profile_only_run_writes_a_readable_profile_and_stops(runs):
    assert "stopping before the first update" in runs.profile_log
    assert "num_updates" not in runs.profile_log.split("admin: omega from")[-1]  # no update after profiling
    assert not list((runs.root / "profile_only").glob("*.pt"))
    p = json.loads(runs.profile.read_text())
    assert p["formula"] == "code" and p["encoder_layers"] == 2 and p["ranks"] == 1
    rows = p["sublayers"]
    assert [r["name"] for r in rows][:3] == [
        "encoder.layers.0.self_attn",
        "encoder.layers.0.ffn",
        "encoder.layers.1.self_attn",
    ]
    assert all(r["var_branch"] > 0 and r["var_skip"] > 0 and r["omega"] > 0 for r in rows)
    # 3 batches merged and cut: rows * max(source, target length) within the cap, beyond one batch's 600
    padded = max(p["source_shape"][1], p["target_shape"][1]) * p["sentences"]
    assert 600 < padded <= 1000
    assert logged_omegas(runs.profile_log) == pytest.approx({r["name"]: r["omega"] for r in rows}, rel=1e-5)


def test_two_step_run_loads_the_profile_and_the_checkpoint_carries_omega(runs):
    assert f"omega from profile {runs.profile}" in runs.train_log
    assert "omega from profiling" not in runs.train_log  # loaded, not profiled again
    state = torch.load(runs.checkpoint)
    omegas = {k: v for k, v in state["model"].items() if k.endswith(".omega")}
    flags = [v for k, v in state["model"].items() if k.endswith(".profiled")]
    assert len(omegas) == 2 * 2 + 2 * 3 and len(flags) == len(omegas) and all(int(f) == 1 for f in flags)
    profile = {r["name"]: r["omega"] for r in json.loads(runs.profile.read_text())["sublayers"]}
    # omega is trainable: it moved from its profiled value, per dimension
    w = omegas["encoder.layers.1.residuals.ffn.omega"]
    assert w.std() > 0 and (w - profile["encoder.layers.1.ffn"]).abs().max() < 0.5


def test_generate_needs_no_profile_file(runs):
    assert "Translated 100 sentences" in runs.gen_admin


def hypotheses(log: str) -> dict:
    out = {}
    for line in log.splitlines():
        if line.startswith(("H-", "P-")):
            tag, *cols = line.split("\t")
            out[tag] = cols
    return out


def test_exported_checkpoint_loads_in_stock_fairseq_and_translates_identically(runs):
    plain, adm = hypotheses(runs.gen_plain), hypotheses(runs.gen_admin)
    assert "Translated 100 sentences" in runs.gen_plain and len(plain) == 200
    assert {k: v[-1] for k, v in plain.items() if k.startswith("H-")} == {
        k: v[-1] for k, v in adm.items() if k.startswith("H-")
    }
    for key in (k for k in plain if k.startswith("P-")):  # per-token scores
        a = [float(x) for x in plain[key][0].split()]
        b = [float(x) for x in adm[key][0].split()]
        # fairseq prints 4 decimals: two scores that differ by round-off (the logits agree to well below
        # 1e-4, test below) can straddle a rounding boundary and print one unit apart, e.g. -4.1998 and
        # -4.1999 on an AVX2 kernel path; at most one unit, plus the float parse of the printout
        assert a == pytest.approx(b, abs=1e-4 + 1e-9)
    # the file holds tensors and plain containers only: torch's weights_only loading, no plugin types
    state = torch.load(runs.exported, weights_only=True)
    assert state["cfg"]["model"]["arch"] == "transformer" and state["args"] is None
    assert not any(".residuals." in k for k in state["model"])


def test_exported_logits_match_within_1e4(runs):
    """Both checkpoints as fairseq loads them, in float32, on test sentences of the corpus."""
    d = Dictionary.load(str(runs.data / "dict.src.txt"))
    task = SimpleNamespace(source_dictionary=d, target_dictionary=d)
    adm_state, plain_state = torch.load(runs.checkpoint), torch.load(runs.exported)
    args = adm_state["cfg"]["model"]
    a = DeepInitTransformerModel.build_model(Namespace(**{**vars(args), "task": None}), task)
    a.load_state_dict(adm_state["model"], model_cfg=args)
    b = fairseq_build_model(OmegaConf.create(plain_state["cfg"]["model"]), task)
    b.load_state_dict(plain_state["model"])
    assert type(b).__module__.startswith("fairseq.") and not admin.admin_residuals(b)
    raw = runs.data.parent / "raw"
    src = [d.encode_line(s, add_if_not_exist=False) for s in (raw / "test.src").read_text().splitlines()[:20]]
    tgt = [d.encode_line(t, add_if_not_exist=False) for t in (raw / "test.tgt").read_text().splitlines()[:20]]
    src_tokens = data_utils.collate_tokens(src, d.pad(), left_pad=True)
    prev = data_utils.collate_tokens(tgt, d.pad(), move_eos_to_beginning=True)
    outs = []
    for m in (a, b):
        m.eval()
        with torch.no_grad():
            outs.append(m(src_tokens, src_tokens.ne(d.pad()).sum(1), prev)[0])
    assert (outs[0] - outs[1]).abs()[prev.ne(d.pad())].max().item() < 1e-4


# ----------------------------------------------------------------------------------------------
# the deep Post-LN that diverges without Admin


def test_18_layer_post_ln_stalls_where_admin_trains():
    """18+18 layers, Adam at lr 3e-3 with no warmup, fitting one fixed batch (Admin paper, Table 2).

    A model that ignores the source cannot get below the batch's unigram entropy; Post-LN stalls
    there (its updates are amplified O(N) through the residual branches), Admin keeps going.
    """
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, 44, (8, 8), generator=g)
    target = torch.cat([torch.flip((src - 3) % 40 + 4, [1]), torch.full((8, 1), 2)], 1)  # reverse and shift, eos
    prev = torch.cat([torch.full((8, 1), 2), target[:, :-1]], 1)
    batch = {"src_tokens": src, "src_lengths": torch.full((8,), 8), "prev_output_tokens": prev}
    counts = torch.bincount(target.reshape(-1)).double()
    p = counts[counts > 0] / counts.sum()
    unigram = -(p * p.log()).sum().item()
    dims = ["--encoder-layers", "18", "--decoder-layers", "18", "--encoder-embed-dim", "32", "--decoder-embed-dim",
            "32", "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
            "--decoder-attention-heads", "2", "--dropout", "0", "--share-all-embeddings"]  # fmt: skip
    final = {}
    for arch in ("postln_iwslt_de_en", "admin_iwslt_de_en"):
        model, _ = build_model(arch, *dims, n_symbols=44, seed=1)
        model.train()
        if arch.startswith("admin"):
            admin.profile_model(model, batch)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98))
        for _ in range(30):
            logits, _ = model(**batch)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        final[arch] = loss.item()
    assert final["postln_iwslt_de_en"] > unigram - 0.1, (final, unigram)  # stuck at token frequencies
    assert final["admin_iwslt_de_en"] < unigram - 1.0, (final, unigram)  # learns the mapping


def test_export_of_a_missing_file_is_one_line_and_exit_1(tmp_path, capsys):
    assert export_admin.main([str(tmp_path / "missing.pt"), str(tmp_path / "out.pt")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("deepinit-export-admin: error: ") and "missing.pt" in err[0]
    assert not (tmp_path / "out.pt").exists()
