"""Diagnostics: statistics equal by-hand computations, the output-change growth separates Post-LN from
Pre-LN as a fitted slope, plots are written, the criterion's metrics reach fairseq-train's log, and
the divergence guard stops an injected NaN while the last good checkpoint survives."""

import json
import math
import re
import struct

import pytest
import torch
from fairseq.logging import metrics

from conftest import TINY_DIMS, USER_DIR, build_model, make_dictionary, run_cli, tiny_batch
from fairseq_deepinit.diagnostics import diagnose, hooks
from fairseq_deepinit.diagnostics import stats as diagnostics
from fairseq_deepinit.diagnostics.criterion import (
    DiagnosticsCriterion,
    DivergenceError,
    _parse_inject,
)

NO_DROPOUT = ("--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0")


def _spy(modules: dict, store: dict, what):
    handles = []
    for name, m in modules.items():

        def hook(module, inputs, output, name=name):
            store.setdefault(name, []).append(what(module, inputs, output))

        handles.append(m.register_forward_hook(hook))
    return handles


# ---- hooks.py additions ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["postln_iwslt_de_en", "preln_iwslt_de_en", "twt_iwslt_de_en"])
def test_norm_input_statistics_by_hand(arch):
    model, _ = build_model(arch, *TINY_DIMS, *NO_DROPOUT)
    model.eval()
    norms = hooks.norm_modules(model)
    # every sub-layer norm (2 per encoder layer, 3 per decoder layer), plus the Pre-LN stack norms
    expected = 2 * 2 + 2 * 3 + (0 if arch.startswith("postln") else 2)
    assert len(norms) == expected
    seen: dict = {}
    handles = _spy(norms, seen, lambda m, i, o: i[0].detach().double())
    with hooks.NormInputStatistics(model) as stats:
        model(**tiny_batch(seed=0))
        model(**tiny_batch(seed=1, src_len=5, tgt_len=4))
    for h in handles:
        h.remove()
    result = stats.statistics()
    assert list(result) == list(seen)  # forward order
    for name, xs in seen.items():
        vectors = torch.cat([x.reshape(-1, x.size(-1)) for x in xs])
        n = vectors.norm(dim=-1)
        assert result[name]["count"] == vectors.size(0)
        assert result[name]["mean_norm"] == pytest.approx(n.mean().item(), rel=1e-12)
        assert result[name]["rms_norm"] == pytest.approx(n.pow(2).mean().sqrt().item(), rel=1e-12)
        assert result[name]["var"] == pytest.approx(vectors.var(unbiased=False).item(), rel=1e-10)


def test_norm_detection_covers_fairseq_layernorm_and_fused(monkeypatch):
    from fairseq.modules import LayerNorm
    from fairseq.modules import layer_norm as fairseq_layer_norm

    assert hooks.is_norm_module(LayerNorm(8))  # torch.nn.LayerNorm on a CPU machine

    class FakeFused(torch.nn.Module):  # stands in for apex's FusedLayerNorm (not an nn.LayerNorm)
        pass

    assert not hooks.is_norm_module(FakeFused())
    monkeypatch.setattr(fairseq_layer_norm, "_FusedLayerNorm", FakeFused, raising=False)
    assert hooks.is_norm_module(FakeFused())
    assert not hooks.is_norm_module(torch.nn.Linear(2, 2))


def test_residual_parameters_and_scalenorm_gains_read_generically():
    model, _ = build_model("rezero_iwslt_de_en", *TINY_DIMS)
    params = hooks.residual_parameters(model)
    assert len(params) == 2 * 2 + 2 * 3 and all(set(p) == {"alpha"} for p in params.values())
    with torch.no_grad():
        model.encoder.layers[1].residuals["ffn"].alpha.fill_(0.25)
    assert hooks.residual_parameters(model)["encoder.layers.1.ffn"]["alpha"].item() == 0.25

    # any Residual that owns a vector parameter is read the same way (Admin's omega)
    from fairseq_deepinit.modules.residual import Residual

    class VectorResidual(Residual):
        def __init__(self):
            super().__init__()
            self.omega = torch.nn.Parameter(torch.tensor([1.0, 2.0, 6.0]))

    model.decoder.layers[0].residuals["self_attn"] = VectorResidual()
    assert hooks.residual_parameters(model)["decoder.layers.0.self_attn"]["omega"].mean().item() == 3.0

    twt, _ = build_model("twt_iwslt_de_en", *TINY_DIMS)
    gains = hooks.scalenorm_gains(twt)
    assert len(gains) == 2 * 2 + 2 * 3 + 2 and all(g == pytest.approx(8.0) for g in gains.values())  # sqrt(64)
    with torch.no_grad():
        twt.decoder.layers[1].final_layer_norm.g.fill_(3.5)
    assert hooks.scalenorm_gains(twt)["decoder.layers.1.final_layer_norm"] == 3.5


# ---- diagnostics.py -------------------------------------------------------------------------


def _backward(model, batch):
    out, _ = model(**batch)
    loss = out.float().log_softmax(-1)[..., 7].mean().neg()
    loss.backward()
    return loss


def test_grad_norms_per_layer_by_hand():
    model, _ = build_model("postln_iwslt_de_en", *TINY_DIMS, *NO_DROPOUT)
    _backward(model, tiny_batch())
    per_layer = diagnostics.grad_norms_per_layer(model)
    assert list(per_layer)[:3] == ["encoder.embed_tokens", "encoder.layers.0", "encoder.layers.1"]
    by_hand: dict = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            m = re.match(r"((en|de)coder\.layers\.\d+)\.", name)
            key = m.group(1) if m else name.rsplit(".", 1)[0]
            by_hand[key] = by_hand.get(key, 0.0) + p.grad.double().pow(2).sum().item()
    assert set(by_hand) == set(per_layer)
    for key, sq in by_hand.items():
        assert per_layer[key] == pytest.approx(math.sqrt(sq), rel=1e-10)
    assert diagnostics.stack_layers(per_layer, "decoder") == [
        per_layer["decoder.layers.0"],
        per_layer["decoder.layers.1"],
    ]


@pytest.mark.parametrize("arch", ["postln_iwslt_de_en", "preln_iwslt_de_en"])
def test_gradient_flow_by_hand(arch):
    """beta_LN = |dL/dr| / |dL/dy|, beta_RC = |dL/dx| / |dL/dr|, Var(r), against retained gradients."""
    model, _ = build_model(arch, *TINY_DIMS, *NO_DROPOUT)
    post = arch.startswith("postln")
    res = model.encoder.layers[1].residuals["ffn"]
    norm = model.encoder.layers[1].final_layer_norm
    kept: dict = {}

    def keep_res(module, inputs, output):
        inputs[1].retain_grad()
        output.retain_grad()
        kept["x"], kept["r"] = inputs[1], output

    def keep_norm(module, inputs, output):
        if inputs[0] is kept.get("r"):
            output.retain_grad()
            kept["y"] = output

    h1 = res.register_forward_hook(keep_res)
    h2 = norm.register_forward_hook(keep_norm)
    with diagnostics.GradientFlow(model) as flow:
        _backward(model, tiny_batch())
    h1.remove()
    h2.remove()
    got = flow.results()["encoder.layers.1.ffn"]
    gx, gr = kept["x"].grad.double().norm().item(), kept["r"].grad.double().norm().item()
    gy = kept["y"].grad.double().norm().item() if post else gr  # Pre-LN: the sub-layer output is r
    assert ("y" in kept) == post
    assert got["beta_ln"] == pytest.approx(gr / gy, rel=1e-9)
    assert got["beta_rc"] == pytest.approx(gx / gr, rel=1e-9)
    assert got["beta"] == pytest.approx(gx / gy, rel=1e-9)
    assert got["var_r"] == pytest.approx(kept["r"].double().var(unbiased=False).item(), rel=1e-9)
    if post:
        assert got["beta_ln"] != pytest.approx(1.0, abs=1e-3)  # the LayerNorm really changes the gradient
    else:
        assert got["beta_ln"] == 1.0
    results = flow.results()
    assert len(results) == 2 * 2 + 2 * 3
    table = diagnostics.per_type_means(results, ("beta_ln", "beta_rc"))
    assert list(table) == [
        "encoder self_attn",
        "encoder ffn",
        "decoder self_attn",
        "decoder encoder_attn",
        "decoder ffn",
    ]
    enc_ffn = [results[f"encoder.layers.{i}.ffn"]["beta_rc"] for i in range(2)]
    assert table["encoder ffn"]["beta_rc"] == pytest.approx(sum(enc_ffn) / 2)


def test_output_change_random_by_hand():
    model, _ = build_model("postln_iwslt_de_en", *TINY_DIMS, *NO_DROPOUT)
    net_input = tiny_batch(bsz=4)
    net_input["src_tokens"][0, :2] = 1  # padding, excluded from the mean
    net_input["prev_output_tokens"][1, -1] = 1
    got = diagnostics.output_change(model, [{"net_input": net_input}], "random", 1e-3, seed=5)
    moved = __import__("copy").deepcopy(model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in moved.named_parameters():
            if ".layers." in name:
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)
    model.eval()
    moved.eval()
    with torch.no_grad():
        a = diagnostics.encoder_decoder_features(model, net_input)
        b = diagnostics.encoder_decoder_features(moved, net_input)
    enc = (a["encoder"] - b["encoder"]).double().pow(2).sum(-1).t()[net_input["src_tokens"].ne(1)]
    dec = (a["decoder"] - b["decoder"]).double().pow(2).sum(-1)[net_input["prev_output_tokens"].ne(1)]
    assert got["encoder"] == pytest.approx(enc.mean().item(), rel=1e-9)
    assert got["decoder"] == pytest.approx(dec.mean().item(), rel=1e-9)
    assert got["encoder"] > 0


def test_output_change_of_a_language_model_by_hand():
    """A decoder-only model has one output: its decoder's last hidden states over the right-padded ``src_tokens``."""
    from fairseq import options, tasks

    args = options.parse_args_and_arch(
        options.get_training_parser(),
        ["/nonexistent", "--task", "language_modeling", "--arch", "postln_lm_tiny", *NO_DROPOUT],
    )
    d = make_dictionary(40)
    torch.manual_seed(1)
    model = tasks.TASK_REGISTRY["language_modeling"](args, d, d).build_model(args)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, len(d), (3, 9), generator=g)
    src[1, -3:] = d.pad()  # right padding, excluded from the mean
    net_input = {"src_tokens": src, "src_lengths": src.ne(d.pad()).sum(1)}
    got = diagnostics.output_change(model, [{"net_input": net_input}], "random", 1e-3, seed=5, pad=d.pad())
    assert set(got) == {"decoder"}
    moved = __import__("copy").deepcopy(model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in moved.named_parameters():
            if ".layers." in name:
                p.add_(torch.randn(p.shape, generator=g) * 1e-3)
    model.eval()
    moved.eval()
    with torch.no_grad():
        a, _ = model.decoder(src, features_only=True)
        b, _ = moved.decoder(src, features_only=True)
    want = (a - b).double().pow(2).sum(-1)[src.ne(d.pad())].mean().item()
    assert got["decoder"] == pytest.approx(want, rel=1e-9) and want > 0


def test_fit_growth_closed_forms():
    n = [2, 4, 8, 16]
    lin = diagnostics.fit_growth(n, [3 + 2 * x for x in n])
    assert lin["slope"] == pytest.approx(2) and lin["intercept"] == pytest.approx(3) and lin["r2_linear"] == 1.0
    assert lin["relative_slope"] == pytest.approx(2 / 7)
    log = diagnostics.fit_growth(n, [1 + 5 * math.log(x) for x in n])
    assert log["log_slope"] == pytest.approx(5) and log["r2_log"] == pytest.approx(1.0)
    power = diagnostics.fit_growth(n, [4 * x**1.5 for x in n])
    assert power["exponent"] == pytest.approx(1.5) and power["r2_power"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        diagnostics.fit_growth([2], [1.0])


def _growth(arch: str, kind: str, depths=(2, 4, 8, 16), repeats=4) -> dict:
    dims = [*TINY_DIMS[:-4], "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]  # d=64, 4 heads
    batches = [{"net_input": tiny_batch(bsz=16, src_len=12, tgt_len=12, seed=1)}]
    curve = []
    for n in depths:
        total = 0.0
        for r in range(repeats):
            model, _ = build_model(
                arch, *dims, *NO_DROPOUT, "--encoder-layers", str(n), "--decoder-layers", str(n), seed=1 + r
            )
            change = diagnostics.output_change(
                model, batches, kind, 1e-4, seed=1001 + r, loss_fn=lambda m, b: _backward_loss(m, b)
            )
            total += change["encoder"] / repeats
        curve.append(total)
    return diagnostics.fit_growth(depths, curve)


def _backward_loss(model, batch):
    out, _ = model(**batch["net_input"])
    return out.float().log_softmax(-1)[..., 7].mean().neg()


def test_output_change_grows_linearly_for_postln_and_much_slower_for_preln():
    """Admin (Liu et al. 2020) Fig. 4 / Theorem 2: O(N) for Post-LN, O(log N) for Pre-LN, as fitted slopes."""
    post = _growth("postln_iwslt_de_en", "random")
    pre = _growth("preln_iwslt_de_en", "random")
    assert 0.8 <= post["exponent"] <= 1.5 and post["r2_linear"] >= 0.9  # linear in N
    assert pre["exponent"] <= 0.8 and post["exponent"] - pre["exponent"] >= 0.25
    assert post["relative_slope"] >= 2.0 * pre["relative_slope"]


# ---- the criterion: statistics through logging outputs --------------------------------------


def _criterion_setup(arch="postln_iwslt_de_en", *cli):
    from fairseq.tasks.translation import TranslationTask

    model, args = build_model(arch, *TINY_DIMS, *NO_DROPOUT, *cli)
    d = make_dictionary()
    task = TranslationTask(args, d, d)
    crit = DiagnosticsCriterion(task, sentence_avg=False, label_smoothing=0.1)
    return model, task, crit


def _sample(seed, src_len=7, tgt_len=6):
    net_input = tiny_batch(seed=seed, src_len=src_len, tgt_len=tgt_len)
    target = torch.roll(net_input["prev_output_tokens"], -1, dims=1)
    return {"net_input": net_input, "target": target, "ntokens": target.numel(), "id": torch.arange(3)}


def test_reduce_metrics_pools_batches_exactly():
    """Two logging outputs (gradient accumulation, or two ranks) give the pooled statistics."""
    model, task, crit = _criterion_setup("rezero_postln_iwslt_de_en")
    model.train()
    branches: dict = {}
    inputs: dict = {}
    handles = _spy(hooks.residual_modules(model), branches, lambda m, i, o: i[0].detach().double())
    handles += _spy(hooks.norm_modules(model), inputs, lambda m, i, o: i[0].detach().double())
    crit._run.collect = True
    logs = [crit(model, _sample(0))[2], crit(model, _sample(1, 4, 9))[2]]
    for h in handles:
        h.remove()
    with metrics.aggregate() as agg:
        DiagnosticsCriterion.reduce_metrics(logs)
    values = agg.get_smoothed_values()
    for name, xs in branches.items():
        pooled = torch.cat([x.flatten() for x in xs])
        key = "diag_var/" + hooks.sublayer_name(name)
        assert values[key] == pytest.approx(pooled.var(unbiased=False).item(), rel=1e-10)
    for name, xs in inputs.items():
        pooled = torch.cat([x.reshape(-1, x.size(-1)) for x in xs]).norm(dim=-1)
        assert values["diag_norm_in/" + name] == pytest.approx(pooled.mean().item(), rel=1e-10)
    assert values["diag_alpha/encoder.layers.0.self_attn"] == 0.0  # ReZero's alpha starts at 0
    assert "loss" in values
    crit._run.collect = False
    assert not any(k.startswith("_diag") for k in crit(model, _sample(0))[2])  # nothing on other updates


def test_per_layer_grad_norms_are_rescaled_to_fairseqs_total():
    model, task, crit = _criterion_setup()
    _backward(model, tiny_batch())
    by_hand = diagnostics.grad_norms_per_layer(model)
    total = math.sqrt(sum(v * v for v in by_hand.values()))
    for p in model.parameters():  # a uniform factor, as an fp16 loss scale or a pending division leaves
        if p.grad is not None:
            p.grad.mul_(64.0)
    crit._run.model = model
    crit._run.collect = True
    # the task hands the update's per-layer norms to reduce_metrics with its logging outputs
    crit._run.grad_stats = crit._grad_norm_statistics(torch.tensor(total, dtype=torch.float64), sharded=False)
    with metrics.aggregate() as agg:
        task.reduce_metrics([{"loss": torch.tensor(1.0), "sample_size": 1, "ntokens": 1, "nsentences": 1}], crit)
    values = agg.get_smoothed_values()
    for key, v in by_hand.items():
        assert values[f"diag_gnorm/{key}"] == pytest.approx(v, rel=1e-9)
    assert crit.take_grad_statistics() is None  # handed over once

    # a non-finite total (an AMP update fairseq skipped) logs no per-layer norms
    crit._run.grad_stats = crit._grad_norm_statistics(torch.tensor(float("inf")), sharded=False)
    with metrics.aggregate() as agg:
        task.reduce_metrics([{"loss": torch.tensor(1.0), "sample_size": 1, "ntokens": 1, "nsentences": 1}], crit)
    assert not any(k.startswith("diag_gnorm/") for k in agg.get_smoothed_values())


def test_criterion_rejects_bad_options():
    from fairseq.tasks.translation import TranslationTask

    _, args = build_model("deepinit_tiny")
    d = make_dictionary()
    task = TranslationTask(args, d, d)
    with pytest.raises(ValueError, match="--diagnostics-stats: unknown bogus"):
        DiagnosticsCriterion(task, False, 0.1, diagnostics_stats="var,bogus")
    with pytest.raises(ValueError, match="must be >= 0"):
        DiagnosticsCriterion(task, False, 0.1, diagnostics_interval=-1)
    for bad in ("5", "x:encoder.layers.0.fc1.weight", "0:p", "3:p:later"):
        with pytest.raises(ValueError, match="--diagnostics-inject-nan"):
            _parse_inject(bad)
    assert _parse_inject("3:encoder.layers.0.fc1.weight:after") == (3, "encoder.layers.0.fc1.weight", "after")


def test_guard_names_first_nonfinite_layer_in_process():
    model, task, crit = _criterion_setup()
    sample = _sample(0)
    crit.begin_update(4, model, None, sample)
    with torch.no_grad():
        model.encoder.layers[1].fc2.weight[0, 0] = float("inf")
    assert diagnostics.nonfinite_parameters(model) == ["encoder.layers.1.fc2.weight"]
    assert diagnostics.first_nonfinite_output(model, lambda: model(**sample["net_input"])) == "encoder.layers.1.fc2"
    with pytest.raises(DivergenceError) as err:
        crit._diverge("test", replay=True)
    msg = str(err.value)
    assert "update 5" in msg and "encoder.layers.1 (first module with a NaN/Inf output: encoder.layers.1.fc2" in msg
    assert "first sub-layer: encoder.layers.1.ffn" in msg and "encoder.layers.1.fc2.weight" in msg


# ---- fairseq-train and deepinit-diagnose end to end -----------------------------------------


def _train_args(data, save_dir, *extra):
    return [
        data, "--user-dir", USER_DIR, "--arch", "deepinit_tiny", *TINY_DIMS,
        "--criterion", "label_smoothed_cross_entropy_diagnostics", "--label-smoothing", "0.1",
        "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--save-dir", save_dir,
        "--no-progress-bar", "--log-format", "json", "--seed", "3", "--no-epoch-checkpoints", *extra,
    ]  # fmt: skip


def _json_lines(output: str, tag: str) -> list:
    return [json.loads(line[line.index("{") :]) for line in output.splitlines() if f"| {tag} |" in line and "{" in line]


def test_metrics_reach_the_training_log_and_diagnose_reads_the_checkpoint(synthetic_bin, tmp_path):
    save = tmp_path / "ckpt"
    args = _train_args(synthetic_bin, save, "--arch", "twt_iwslt_de_en", "--max-update", "4")
    args += ["--diagnostics-interval", "2", "--log-interval", "1", "--disable-validation"]
    out = run_cli("train", *args).stdout
    lines = _json_lines(out, "train_inner")
    assert [line["num_updates"] for line in lines] == ["1", "2", "3", "4"]
    for line in lines:
        has = any(k.startswith("diag_") for k in line)
        assert has == (int(line["num_updates"]) % 2 == 0), line  # logged on updates 2, 4 only; no stale None
    line = lines[1]
    for key in (
        "diag_var/encoder.layers.0.self_attn",
        "diag_var/decoder.layers.1.encoder_attn",
        "diag_norm_in/encoder.layers.0.self_attn_layer_norm",
        "diag_norm_in/decoder.layer_norm",
        "diag_scalenorm_g/encoder.layers.1.final_layer_norm",
        "diag_gnorm/encoder.layers.0",
        "diag_gnorm/decoder.layers.1",
    ):
        assert key in line and math.isfinite(float(line[key])), key
    # the per-layer gradient norms add up (in squares) to fairseq's own gnorm of that update
    layer_sq = sum(float(v) ** 2 for k, v in line.items() if k.startswith("diag_gnorm/"))
    assert math.sqrt(layer_sq) == pytest.approx(float(line["gnorm"]), rel=2e-3)

    # deepinit-diagnose on the trained checkpoint: learned ScaleNorm g against depth (TwT Fig. 3)
    outdir = tmp_path / "diag"
    assert diagnose.main([str(synthetic_bin), "--checkpoint", str(save / "checkpoint_last.pt"),
                          "--output-dir", str(outdir), "--max-tokens", "400"]) == 0  # fmt: skip
    result = json.loads((outdir / "diagnostics.json").read_text())
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    for name, g in result["scalenorm_g"].items():
        assert g == pytest.approx(state[name + ".g"].item())
    assert any(abs(g - 8.0) > 1e-6 for g in result["scalenorm_g"].values())  # trained, no longer sqrt(d)
    for png in ("scalenorm_g.png", "grad_norm.png", "gradient_flow.png", "norm_input.png"):
        _assert_png(outdir / png)
    assert "output_change" not in result


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(data) < 150_000, path
    width, height = struct.unpack(">II", data[16:24])
    assert width > 300 and height > 200


def test_diagnose_command_writes_json_and_plots(synthetic_bin, tmp_path):
    out = tmp_path / "run"
    argv = [str(synthetic_bin), "--arch", "postln_iwslt_de_en", *TINY_DIMS, "--output-dir", str(out),
            "--max-tokens", "600", "--num-batches", "2", "--depths", "1,2,3", "--repeats", "1"]  # fmt: skip
    assert diagnose.main(argv) == 0
    result = json.loads((out / "diagnostics.json").read_text())
    assert len(result["grad_norm"]["encoder"]) == 2 and len(result["grad_norm"]["decoder"]) == 2
    assert result["batches"]["count"] == 2
    assert set(result["gradient_flow"]["per_type"]) == {
        "encoder self_attn", "encoder ffn", "decoder self_attn", "decoder encoder_attn", "decoder ffn"
    }  # fmt: skip
    oc = result["output_change"]
    assert (
        oc["depths"] == [1, 2, 3] and len(oc["random"]["encoder"]) == 3 and "exponent" in oc["adam"]["fit"]["decoder"]
    )
    for png in ("grad_norm.png", "gradient_flow.png", "norm_input.png", "output_change.png"):
        _assert_png(out / png)
    assert result["scalenorm_g"] is None and not (out / "scalenorm_g.png").exists()
    cmp = tmp_path / "cmp"
    assert diagnose.main(["--compare", str(out), str(out), "--output-dir", str(cmp)]) == 0
    _assert_png(cmp / "grad_norm.png")
    _assert_png(cmp / "output_change.png")
    # bad input: one line, exit status 1 (tests/test_probes.py has the whole table)
    assert diagnose.main([str(synthetic_bin), "--output-dir", str(out), "--measure", "grad,bogus"]) == 1
    assert diagnose.main([str(tmp_path / "missing"), "--arch", "deepinit_tiny", "--output-dir", str(out)]) == 1


def test_guard_stops_on_injected_nan_and_checkpoint_survives(synthetic_bin, tmp_path):
    save = tmp_path / "ckpt"
    args = _train_args(synthetic_bin, save, "--max-update", "20", "--save-interval-updates", "2",
                       "--diagnostics-inject-nan", "5:encoder.layers.1.fc1.weight")  # fmt: skip
    proc = run_cli("train", *args, check=False)
    assert proc.returncode != 0
    out = proc.stdout
    # the plugin's one-line error (fairseq_deepinit.errors); the full report is in the log above it
    assert "fairseq-deepinit: error: divergence guard: training stopped at update 5" in out
    assert proc.returncode == 1 and "Traceback" not in out and "terminate called" not in out
    assert "First layer whose statistics went non-finite (forward order): encoder.layers.1" in out
    assert "first sub-layer: encoder.layers.1.ffn" in out and "Non-finite weights: encoder.layers.1.fc1.weight" in out
    ckpt = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert ckpt["optimizer_history"][-1]["num_updates"] == 4
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values() if t.is_floating_point())
    assert not (save / "crash.pt").exists()


def test_guard_refuses_to_save_weights_that_went_nan_after_a_step(synthetic_bin, tmp_path):
    save = tmp_path / "ckpt"
    args = _train_args(synthetic_bin, save, "--max-update", "20", "--save-interval-updates", "3",
                       "--diagnostics-inject-nan", "6:decoder.layers.0.self_attn.k_proj.weight:after")  # fmt: skip
    proc = run_cli("train", *args, check=False)
    assert proc.returncode != 0
    assert "fairseq was about to save a checkpoint of them (not written)" in proc.stdout
    assert "Non-finite weights: decoder.layers.0.self_attn.k_proj.weight" in proc.stdout
    ckpt = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert ckpt["optimizer_history"][-1]["num_updates"] == 3
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values() if t.is_floating_point())
