"""benchmarks/throughput.py: a smoke run on real Multi30k batches, and its report logic.

No timing is asserted here (speed targets are ratios the script prints, measured side by side);
the tests check that every configuration is the model it claims to be, that all were timed on the
same tokens, and that the printed table agrees with the JSON.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MULTI30K, REPO, run_script
from deepinit_tools.bench import throughput as tp
from deepinit_tools.bench import throughput_report
from deepinit_tools.harness import flops, report, timing

SCRIPT = REPO / "benchmarks" / "throughput.py"
SCRIPTS = (
    "throughput.py",
    "speed.py",
    "matt_speed.py",
    "admin_profiling.py",
    "gpu_profile.py",
    "gpu_smoke.py",
    "gpu_results.py",
    "gpu_readiness.py",
    "quickstart_precision.py",
    "stabiliser_cost.py",
    "hc_cost.py",
    "mhc_precision.py",
    "optimizer_kernels.py",
)


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory) -> Path:
    """One --work-dir for every script run here: the quick runs' Multi30k is binarised once (the
    scripts reuse a binarisation whose STAMP.json matches)."""
    return tmp_path_factory.mktemp("bench-data")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, work_dir):
    if not (MULTI30K / "train.de.gz").exists():
        pytest.skip(f"Multi30k not found at {MULTI30K} (set MULTI30K_DIR)")
    out = tmp_path_factory.mktemp("bench")
    proc = run_script(
        str(SCRIPT), "--quick", "--multi30k", str(MULTI30K), "--work-dir", str(work_dir),
        "--json", str(out / "result.json"), "--markdown", str(out / "result.md"),
    )  # fmt: skip
    return json.loads((out / "result.json").read_text()), (out / "result.md").read_text(), proc.stdout


def test_quick_run_builds_the_claimed_models_on_the_same_tokens(quick_run):
    result, _, _ = quick_run
    (shape,) = result["shapes"]
    rows = result["shapes"][shape]
    # the quick configurations plus the references they are compared against, added automatically
    assert list(rows) == ["stock", "stock-preln", "postln", "preln", "preln-scalenorm"]
    meta = result["meta"]
    assert meta["device"] == "cpu" and meta["date"] and "throughput.py --quick" in meta["command"]
    assert len({row["tokens_per_trial"] for row in rows.values()}) == 1  # identical fixed batches
    assert rows["stock"]["model_class"] == rows["stock-preln"]["model_class"] == "TransformerModel"
    assert {rows[n]["model_class"] for n in ("postln", "preln", "preln-scalenorm")} == {"DeepInitTransformerModel"}
    assert rows["stock"]["norm_classes"] == rows["postln"]["norm_classes"] == ["LayerNorm"]
    assert rows["preln-scalenorm"]["norm_classes"] == ["ScaleNorm"]
    # identical dims: the init-only scheme has exactly stock's parameters; ScaleNorm has one g per
    # norm instead of LayerNorm's 2d (Pre-LN: 2 + 3 per layer and one final norm per stack)
    assert rows["postln"]["params"] == rows["stock"]["params"]
    assert rows["preln"]["params"] == rows["stock-preln"]["params"] == rows["stock"]["params"] + 2 * 2 * 64
    n_norms = 2 * 2 + 2 * 3 + 2
    assert rows["preln"]["params"] - rows["preln-scalenorm"]["params"] == n_norms * (2 * 64 - 1)
    repeats = result["meta"]["repeats"]
    for name, row in rows.items():
        assert len(row["tokens_per_s"]) == len(row["tokens_per_cpu_s"]) == repeats, name
        assert all(math.isfinite(v) and v > 0 for v in row["tokens_per_s"] + row["tokens_per_cpu_s"]), name
        assert row["peak_mib"] > 0, name
        assert len(row["ratio_to_ref"]) == repeats
    assert rows["stock"]["ratio_to_ref"] == [1.0] * repeats  # paired with itself
    # paired ratios are per-round quotients of the recorded tokens/s
    for got, a, b in zip(
        rows["postln"]["ratio_to_ref"], rows["postln"]["tokens_per_s"], rows["stock"]["tokens_per_s"], strict=True
    ):
        assert got == pytest.approx(a / b)
    assert len(rows["preln-scalenorm"]["ratio_to_preln"]) == repeats


def test_quick_run_table_matches_json(quick_run):
    result, table, stdout = quick_run
    assert table.strip() in stdout  # the printed table is the one written to --markdown
    rows = next(iter(result["shapes"].values()))
    lines = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| config")]
    assert len(lines) == len(rows)
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        name, tok = cells[0], cells[4]
        median = float(re.match(r"(\d+) \[", tok).group(1))
        assert median == pytest.approx(tp.median(rows[name]["tokens_per_s"]), abs=0.5)
    verdicts = [line for line in table.splitlines() if line.startswith("- ")]
    # postln and preln (init-only) and ScaleNorm vs LayerNorm each get a verdict
    assert len(verdicts) == 3 and all(re.search(r": (MET|MISSED)$", v) for v in verdicts)


def _fake(ratios: dict) -> dict:
    rows = {n: {"ratio_to_ref": [r], "tokens_per_s": [1.0]} for n, r in ratios.items()}
    rows.setdefault("preln-scalenorm", {"ratio_to_ref": [1.0], "tokens_per_s": [1.0]})
    return {"shapes": {"s": rows}}


def test_verdicts_apply_the_targets():
    res = _fake({"stock": 1.0, "postln": 0.979, "lipschitz": 0.98, "deepnorm": 0.5})
    res["shapes"]["s"]["preln-scalenorm"]["ratio_to_preln"] = [0.999, 1.2, 0.9]
    lines = throughput_report.verdicts(res)
    assert any(line.startswith("s postln vs stock") and line.endswith("MISSED") for line in lines)
    assert any(line.startswith("s lipschitz vs stock") and line.endswith("MET") for line in lines)
    assert not any("deepnorm" in line for line in lines)  # not init-only: reported, no target
    (norm,) = [line for line in lines if "preln-scalenorm vs preln" in line]
    assert "0.999 [0.900-1.200]" in norm and norm.endswith("MISSED")  # median 0.999 < 1.00


def test_options_add_references_and_reject_cpu_half_precision():
    opts = tp.parse_args(["--configs", "twt", "t-fixup"])
    assert [c.name for c in opts.configs] == ["stock", "stock-preln", "t-fixup", "twt"]
    opts = tp.parse_args(["--configs", "preln-scalenorm"])
    assert [c.name for c in opts.configs] == ["stock-preln", "preln", "preln-scalenorm"]
    bad_args = (["--fp16"], ["--steps", "0"], ["--gpu-matrix", "--fp16"], ["--layers", "6"], ["--out-dir", "x"],
                ["--gpu-matrix", "--compile-only", "--layers", "6"],
                ["--gpu-matrix", "--deadline-min", "0"])  # fmt: skip
    for bad in bad_args:
        with pytest.raises(SystemExit) as exc:
            tp.parse_args(bad)
        assert exc.value.code == 1  # one-line error, exit status 1
    # the GPU matrix in passes: depths in ascending order, files named after the pass
    opts = tp.parse_args(["--gpu-matrix", "--layers", "36", "18", "--out-dir", "o"])
    assert (
        opts.layers == [18, 36] and str(opts.json) == "o/gpu-18l-36l.json" and str(opts.markdown) == "o/gpu-18l-36l.md"
    )
    assert str(tp.parse_args(["--gpu-matrix", "--compile-only", "--out-dir", "o"]).json) == "o/gpu-compile.json"
    assert tp.parse_args(["--gpu-matrix", "--quick"]).layers == [1, 2]
    assert tp.Shape.parse("18x128x512x4").flags()[:2] == ["--encoder-layers", "18"]
    with pytest.raises(Exception, match="heads must divide"):
        tp.Shape.parse("6x100x400x3")


# --- the speed fixes keep the math ------------------------------------------------------------


def test_scalenorm_hand_written_backward_is_autograd_of_eq3():
    """ScaleNorm's custom backward (its CPU path) equals autograd through g * x / hypot(||x||, eps)
    (TwT eq. 3 with the fused kernel's eps, ScaleNorm's docstring), on a transposed input with a zero
    row and a row whose norm is far below eps."""
    import torch

    from fairseq_deepinit.modules.norms import ScaleNorm, _ScaleNormFunction

    eps = 1e-5
    torch.manual_seed(0)
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    x[0, 0] = 0.0
    x[1, 2] *= 1e-7  # ||x|| << eps: the scale is about the constant g / eps there
    x = x.transpose(0, 1).requires_grad_()
    g = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    # finite-difference step far below eps: the scale bends on the scale of eps around the small rows
    assert torch.autograd.gradcheck(lambda x, g: _ScaleNormFunction.apply(x, g, eps), (x, g), eps=1e-10)

    dy = torch.randn(3, 4, 6, dtype=torch.float64)
    want_y = g * x / torch.hypot(x.norm(dim=-1, keepdim=True), torch.tensor(eps, dtype=torch.float64))
    want = torch.autograd.grad(want_y, (x, g), dy)
    y = _ScaleNormFunction.apply(x, g, eps)
    got = torch.autograd.grad(y, (x, g), dy)
    torch.testing.assert_close(y, want_y, rtol=1e-14, atol=0)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=0)
    # the zero row: the gradient is g / eps * dy, as the released max(||x||, eps) gives there
    torch.testing.assert_close(got[0][0, 0], 2.5 / eps * dy[0, 0], rtol=1e-14, atol=0)
    assert y.is_contiguous()  # laid out like LayerNorm's output, whatever the input's strides

    # fp16 module: the norm in fp32, output and gradients in the parameter/input dtype
    norm = ScaleNorm(6).half()
    xh = torch.randn(3, 4, 6).half().requires_grad_()
    out = norm(xh)
    out.float().sum().backward()
    assert out.dtype == xh.grad.dtype == norm.g.grad.dtype == torch.float16


def test_residual_sum_is_contiguous_on_fairseqs_transposed_stream():
    """The residual modules sum branch first: same values, contiguous result (Linears stay on addmm)."""
    import torch

    from fairseq_deepinit.modules.residual import ConstantResidual, Residual, ReZeroResidual

    residual = torch.randn(4, 3, 8).transpose(0, 1)  # (T, B, C) view of (B, T, C), as fairseq's
    branch = torch.randn(3, 4, 8)
    rezero = ReZeroResidual()
    with torch.no_grad():
        rezero.alpha.fill_(0.3)
    for module, want in (
        (Residual(), residual + branch),
        # one fused add (tests/test_kernels.py bounds its rounding against branch + 1.7 * residual)
        (ConstantResidual(1.7), torch.add(branch, residual, alpha=1.7)),
        (rezero, residual + 0.3 * branch),
    ):
        out = module(branch, residual)
        assert out.is_contiguous(), type(module).__name__
        assert torch.equal(out, want), type(module).__name__


# --- the GPU matrix, its CPU smoke run -----------------------------------------------------


@pytest.fixture(scope="module")
def matrix_run(tmp_path_factory, work_dir):
    if not (MULTI30K / "train.de.gz").exists():
        pytest.skip(f"Multi30k not found at {MULTI30K} (set MULTI30K_DIR)")
    out = tmp_path_factory.mktemp("matrix")
    run_script(
        str(SCRIPT), "--gpu-matrix", "--quick", "--multi30k", str(MULTI30K), "--work-dir",
        str(work_dir), "--json", str(out / "gpu.json"), "--markdown", str(out / "gpu.md"),
    )  # fmt: skip
    return json.loads((out / "gpu.json").read_text()), (out / "gpu.md").read_text()


def test_gpu_matrix_quick_runs_the_cpu_rows_and_records_the_cuda_rows_as_skipped(matrix_run):
    doc, md = matrix_run
    keys = {"config", "layers", "device", "precision", "tokens_per_s", "ratio_to_stock", "peak_mem_gib", "mfu"}
    assert doc["device"] and doc["date"] and "--gpu-matrix --quick" in doc["command"] and doc["finished"]
    for row in doc["rows"]:
        assert keys <= set(row) <= keys | {"note"}, row
        if row["precision"] == "fp16" or row["config"].endswith("compile"):
            assert row["note"].startswith("skipped:") and row["tokens_per_s"] is None, row
        else:
            assert "note" not in row and row["tokens_per_s"] > 0 and row["mfu"] is None, row  # CPU: no peak known
    measured = {(r["config"], r["layers"], r["precision"]) for r in doc["rows"] if r["tokens_per_s"]}
    assert measured == {("stock", 1, "fp32"), ("plugin", 1, "bf16-autocast"), ("plugin-sdpa", 1, "bf16-autocast"),
                        ("plugin-sdpa-foreach", 1, "bf16-autocast"), ("plugin-sdpa", 2, "bf16-autocast")}  # fmt: skip
    stock = next(r for r in doc["rows"] if r["config"] == "stock" and r["precision"] == "fp32")
    assert stock["ratio_to_stock"] == 1.0  # CPU: the baseline falls back to stock fp32
    loss = doc["loss_check"]
    assert loss["updates"] == 2 and loss["stock_config"] == "stock fp32 1L"
    assert loss["difference"] == pytest.approx(loss["fast_final_loss"] - loss["stock_final_loss"])
    assert any(t.startswith("loss curve:") for t in doc["targets"])
    assert doc["command"] in md and "| stock | 1 | fp32 |" in md


def test_gpu_matrix_first_pass_is_the_full_depth_alone_and_stops_at_its_deadline(tmp_path, work_dir):
    """The device's first pass (``--layers 6 --no-compile``; quick: 1 layer) under a deadline already
    passed: one timing round, the loss check skipped and said so, the pass's own file under --out-dir."""
    if not (MULTI30K / "train.de.gz").exists():
        pytest.skip(f"Multi30k not found at {MULTI30K} (set MULTI30K_DIR)")
    run_script(
        str(SCRIPT), "--gpu-matrix", "--quick", "--layers", "1", "--no-compile", "--repeats", "3",
        "--deadline-min", "0.001", "--multi30k", str(MULTI30K), "--work-dir", str(work_dir),
        "--out-dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu-1l.json", "gpu-1l.md"]
    doc = json.loads((tmp_path / "out" / "gpu-1l.json").read_text())
    assert doc["finished"] and {r["layers"] for r in doc["rows"]} == {1}
    assert not any(r["config"].endswith("compile") for r in doc["rows"])
    assert doc["loss_check"] == {"note": "skipped: --deadline-min reached before the loss-curve check"}
    timed = [d for d in doc["details"].values() if d.get("rates")]
    assert timed and all(d["rounds"] == 1 and len(d["rates"]) == 1 for d in timed)


def test_gpu_profile_quick_times_the_phases_of_the_cpu_rows(tmp_path, work_dir):
    """benchmarks/gpu_profile.py on the CPU: the CUDA-only rows are left out, the bf16 SDPA row is profiled."""
    if not (MULTI30K / "train.de.gz").exists():
        pytest.skip(f"Multi30k not found at {MULTI30K} (set MULTI30K_DIR)")
    run_script(
        str(REPO / "benchmarks" / "gpu_profile.py"), "--quick", "--no-compile", "--multi30k",
        str(MULTI30K), "--work-dir", str(work_dir), "--json", str(tmp_path / "p.json"), "--text",
        str(tmp_path / "p.txt"),
    )  # fmt: skip
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["device"] == "cpu" and "--quick" in doc["command"] and doc["finished"]
    # fp16 and compile rows need CUDA
    assert list(doc["rows"]) == ["plugin-sdpa bf16-autocast 1L", "plugin-sdpa-foreach bf16-autocast 1L"]
    fig = doc["rows"]["plugin-sdpa bf16-autocast 1L"]
    assert "note" not in fig, fig
    assert 0 < fig["forward_backward_ms"] < fig["step_ms"] and 0 < fig["update_ms"] < fig["step_ms"]
    assert fig["gpu_kernel_ms_per_step"] == 0 and fig["kernel_launches_per_step"] == 0  # no CUDA activity on a CPU
    assert fig["target_tokens_per_step"] > 0
    text = (tmp_path / "p.txt").read_text()
    assert "aten::" in text and "Self CPU" in text  # the profiler's operator table


def test_gpu_readiness_quick_fills_every_column(tmp_path):
    """benchmarks/gpu_readiness.py on one family (2 layers) and its special rows: every figure is there,
    stock's reads beside the plugin's, and the markdown carries the command it came from."""
    run_script(
        str(REPO / "benchmarks" / "gpu_readiness.py"), "--quick", "--json", str(tmp_path / "r.json"),
           "--markdown", str(tmp_path / "r.md")
    )  # fmt: skip
    doc = json.loads((tmp_path / "r.json").read_text())
    rows = {r["row"]: r for r in doc["rows"]}
    assert list(rows) == ["postln", "matt decoding", "admin profiling", "diagnostics (twt)"]
    post = rows["postln"]
    assert (post["cpu_reads"], post["meta"]["reads"], post["meta"]["plugin_reads"]) == (0, 0, 0)
    assert post["stock"] == {"cpu_reads": 3, "meta_reads": 3, "ops": post["stock"]["ops"]}  # 2 encoder layers + decoder
    assert post["op_ratio"] == post["ops"] / post["stock"]["ops"] <= 1.02 and post["op_targeted"]
    assert post["causal"] == [2, 2] and post["sdpa"] == [4, 4]  # 2 decoder layers; 2 + 2 self-attentions
    assert post["fp32_mm"]["plain"] == 0 and isinstance(post["fp32_mm"]["checkpoint"], int)
    assert rows["admin profiling"]["meta"]["plugin_reads"] == 2
    assert rows["diagnostics (twt)"]["meta"]["diagnostic_reads"] == 1
    assert {n["norm"] for n in doc["norms"]} == {"layernorm", "rmsnorm", "scalenorm", "zc-rmsnorm"}
    md = (tmp_path / "r.md").read_text()
    assert doc["meta"]["command"] in md and "| postln | ok | 0 / 0 (3 / 3) ok |" in md


def test_gpu_matrix_rows_and_compile_guard(monkeypatch):
    """The full matrix's rows; a failing torch.compile is recorded in its row, the others still run."""
    from deepinit_tools.bench import gpu_matrix

    rows = gpu_matrix.matrix([6, 18, 36], compile_row=True)
    assert len(rows) == 15 + 3 + 3
    # passes: the deep depths alone get the deep rows only; --compile-only the compiled row and its references
    deep = gpu_matrix.matrix([18, 36], compile_row=False, full=6)
    assert [(r.label, r.layers) for r in deep] == [
        (c, n) for n in (18, 36) for c in ("stock", "plugin-sdpa", "plugin-sdpa")
    ]
    assert [r.key for r in gpu_matrix.matrix([6], compile_row=False, full=6)] == [
        r.key for r in rows if r.layers == 6 and not r.variant.compile
    ]
    pair = ["stock fp16 6L", "plugin-sdpa-foreach bf16-autocast 6L", "plugin-sdpa-foreach-compile bf16-autocast 6L"]
    assert [r.key for r in gpu_matrix.compile_pair(6)] == pair
    assert {r.label for r in rows if r.layers == 36} == {"stock", "plugin-sdpa"}
    assert sum(r.variant.compile for r in rows) == 1
    foreach = [r.key for r in rows if r.variant.optimizer == "adam_foreach"]
    assert foreach == ["plugin-sdpa-foreach bf16-autocast 6L", "plugin-sdpa-foreach-compile bf16-autocast 6L"]
    assert [r.key for r in rows if r.layers == 6][:2] == ["stock fp32 6L", "stock fp16 6L"]

    class FakeRun:
        n_params, overflows = 10, 0

        def step(self, sample) -> int:
            return 100

    class FakeBuilder:
        configs = tp.CONFIGS

        def build(self, row):
            if row.variant.compile:
                raise RuntimeError("inductor: no C++ compiler\nlong traceback")
            return FakeRun()

        def shape(self, layers):
            return tp.Shape(layers, 8, 16, 2)

        def task(self):
            from fairseq.data import Dictionary

            return type("T", (), {"target_dictionary": Dictionary()})()

    import torch

    batch = {"net_input": {"src_lengths": torch.tensor([3])}, "target": torch.tensor([[5, 6]])}
    opts = type("O", (), {"device": "cpu", "warmup": 0, "steps": 1, "repeats": 3, "deadline": None})()
    out: dict = {}
    sel = [r for r in rows if r.layers == 6 and r.variant.precision == "bf16-autocast"]
    seen: list = []  # what the caller could write at every update: rows built, rounds timed
    gpu_matrix.measure_depth(sel, FakeBuilder(), [batch], opts, out, on_update=lambda: seen.append(
        (len(out), max((len(v.get("rates", [])) for v in out.values()), default=0))))  # fmt: skip
    compiled = next(r for r in sel if r.variant.compile)
    assert out[compiled]["note"] == "error: RuntimeError: inductor: no C++ compiler"
    assert all(len(out[r]["rates"]) == 3 for r in sel if r is not compiled)
    assert seen == [(n, 0) for n in range(1, len(sel) + 1)] + [(len(sel), r) for r in (1, 2, 3)]
    # past the deadline, no further round starts (the first always runs)
    opts.deadline, out = 0.0, {}
    gpu_matrix.measure_depth(sel, FakeBuilder(), [batch], opts, out)
    assert all(len(out[r]["rates"]) == 1 for r in sel if r is not compiled)


# --- the harness, on fake timers ----------------------------------------------------------------


class FakeClock:
    """A clock that advances only when a trial says so (deterministic timings)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_interleave_rotates_the_start_and_pairs_ratios_per_round():
    clock, cpu, log = FakeClock(), FakeClock(), []
    # seconds per trial, per round: "b" twice as fast as "a"; round 2 is slow for both (drift)
    cost = {"a": [2.0, 4.0, 2.0], "b": [1.0, 2.0, 1.0], "c": [4.0, 4.0, 4.0]}
    calls = {n: 0 for n in cost}

    def trial(name):
        def one():
            log.append(name)
            if calls[name] > 0:  # the first call of each is the warm-up
                clock.now += cost[name][calls[name] - 1]
                cpu.now += 1.0
            calls[name] += 1
            return 100

        return one

    rounds = timing.interleave({n: trial(n) for n in cost}, 3, warmup=1, clocks=timing.Clocks(clock, cpu))
    assert log[:3] == ["a", "b", "c"]  # warm-up
    assert rounds.orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert rounds.orders == [timing.rotation(["a", "b", "c"], r) for r in range(3)]
    assert rounds.rates("a") == [50.0, 25.0, 50.0]
    assert rounds.ratios("b", "a") == [2.0, 2.0, 2.0]  # the drift cancels within a round
    assert rounds.rates("c", "cpu") == [100.0, 100.0, 100.0]
    stat = timing.Stat.of(rounds.rates("a"))
    assert (stat.median, stat.lo, stat.hi, stat.n) == (50.0, 25.0, 50.0, 3)
    assert stat.text("{:.0f}") == "50 [25-50]" and timing.Stat.of([]).text() == "n/a"
    assert timing.median([3.0, 1.0, 2.0, 10.0]) == 2.5 and math.isnan(timing.median([]))
    with pytest.raises(ValueError, match="same rounds"):
        timing.paired_ratios([1.0], [1.0, 2.0])


def test_json_and_markdown_writers(tmp_path):
    meta = {"device": "cpu", "device_name": "Fake CPU, 2 cores", "date": "2026-01-02", "time_utc": "03:04",
            "command": "python benchmarks/x.py --quick", "torch": "t", "fairseq": "f", "python": "3",
            "threads": 1}  # fmt: skip
    report.write_json(tmp_path / "sub" / "r.json", {"rows": [{"x": float("nan"), "y": 1.5}]}, meta)
    doc = json.loads((tmp_path / "sub" / "r.json").read_text())
    assert doc == {"meta": meta, "rows": [{"x": None, "y": 1.5}]}  # NaN -> null, strict JSON
    table = report.markdown_table(["name", "value"], [["a", 1], ["b", None]], right=(1,))
    assert table.splitlines() == ["| name | value |", "|---|---:|", "| a | 1 |", "| b | n/a |"]
    with pytest.raises(ValueError):
        report.markdown_table(["one"], [["a", "b"]])
    prov = report.provenance(meta)
    assert "Fake CPU, 2 cores" in prov and "2026-01-02" in prov and "`python benchmarks/x.py --quick`" in prov
    assert report.command_line("x.py", ["--a", "b c"]).endswith("python benchmarks/x.py --a 'b c'")


def test_model_flops_against_a_hand_count():
    """1+1 layers, d=2, FFN 4, target vocabulary 3; one sentence of 2 source and 1 target tokens."""
    dims = flops.Dims(enc_layers=1, dec_layers=1, dim=2, ffn=4, tgt_vocab=3)
    # weights seen per source token: encoder q,k,v,o 4*2*2 + FFN 2*2*4 = 32; decoder cross k,v 2*2*2 = 8
    # per target token: decoder self q,k,v,o 16 + cross q,o 8 + FFN 16 + output 2*3 = 46
    assert flops.weight_flops_per_token(dims) == (6 * 40, 6 * 46)
    # attention, 12 d lq lk per layer: encoder 2*2, decoder self 1*1, cross 1*2 -> 12*2*7
    lengths = flops.BatchLengths(src=[2], tgt=[1])
    assert flops.attention_flops(dims, lengths) == 168
    assert flops.step_flops(dims, lengths) == 6 * 40 * 2 + 6 * 46 * 1 + 168
    # the per-token weight count is the built model's matrix sizes (stock transformer base, 6+6 layers)
    base = flops.Dims(6, 6, 512, 2048, 10000)
    per_src, per_tgt = flops.weight_flops_per_token(base)
    enc = 6 * (4 * 512 * 512 + 2 * 512 * 2048)
    dec = 6 * (8 * 512 * 512 + 2 * 512 * 2048)
    assert per_src + per_tgt == 6 * (enc + dec + 512 * 10000)


def test_mfu_peaks_by_device_name():
    assert flops.peak_flops("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert flops.peak_flops("NVIDIA H100 PCIe")[0] == 756e12
    assert flops.peak_flops("NVIDIA H200")[0] == 989e12
    peak, note = flops.peak_flops("Some GPU")
    assert peak is None and "null" in note
    assert flops.mfu(494.5e12, "NVIDIA H100 80GB HBM3") == pytest.approx(0.5)
    assert flops.mfu(1e12, "Some GPU") is None


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_option_has_help_with_its_default(script):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--help"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    options = re.findall(r"^  (--[\w-]+)", proc.stdout, flags=re.M)
    assert options, proc.stdout
    # each option's help block (up to the next option) names its default
    blocks = re.split(r"\n  (?=--)", proc.stdout.split("options:", 1)[1])
    for block in blocks[1:]:
        name = block.split()[0]
        if name in ("--help", "-h"):
            continue
        assert "default" in " ".join(block.split()), f"{script} {name}: no default in its help"


def test_the_speed_target_is_stated_once_and_as_the_matrix_checks_it():
    """docs/benchmarks.md states the target FAST_TARGET / LOSS_TOLERANCE apply; docs/speed.md refers to it."""
    from deepinit_tools.bench import gpu_matrix_rows as gpu_matrix

    bench = (REPO / "docs" / "benchmarks.md").read_text()
    stated = re.search(r"\*\*at least ([\d.]+)x stock fairseq fp16 target tokens/s at equal\s+batch", bench)
    assert stated and float(stated.group(1)) == gpu_matrix.FAST_TARGET
    assert f"within {100 * gpu_matrix.LOSS_TOLERANCE:g} % of stock fp16's" in " ".join(bench.split())
    speed = " ".join((REPO / "docs" / "speed.md").read_text().split())
    assert "benchmarks.md#gpu-run" in speed and "\n## GPU run\n" in bench
    assert not re.search(r"target is at least [\d.]+x|[\d.]+x target", speed)  # no second statement


def test_hc_cost_prints_every_case_with_its_ratios_to_pre_ln():
    """benchmarks/hc_cost.py at a toy shape: one row per case, Pre-LN's ratios 1, mHC's parameters and kernels above
    Pre-LN's, the recomputing Sinkhorn saving less than autograd through its iterates."""
    proc = run_script(REPO / "benchmarks" / "hc_cost.py", "--shape", "1x16x32x2", "--batch", "2x4", "--rounds", "1",
                      "--updates", "1")  # fmt: skip
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| case")}  # fmt: skip
    assert list(rows) == ["preln", "hc", "hc-static", "mhc", "mhc-autograd"]
    assert [c.strip() for c in rows["preln"][2:4]] == ["1.000 [1.000-1.000]"] * 2
    saved = {case: float(cells[4]) for case, cells in rows.items()}
    ops = {case: int(cells[8]) for case, cells in rows.items()}
    assert ops["mhc"] > ops["hc"] > ops["hc-static"] > ops["preln"]
    assert saved["mhc-autograd"] > saved["mhc"] > saved["preln"]


def test_hc_cost_attention_residual_cases_and_an_unknown_case():
    """``--cases``: Pre-LN always first, the Attention Residuals cases keep more activations than Pre-LN (each
    sub-layer's sources), Full more than Block; an unknown case is one line naming the choices."""
    proc = run_script(REPO / "benchmarks" / "hc_cost.py", "--shape", "2x32x64x2", "--batch", "4x16", "--rounds", "1",
                      "--updates", "1", "--cases", "attnres,blockattnres")  # fmt: skip
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| case")}  # fmt: skip
    assert list(rows) == ["preln", "attnres", "blockattnres"]
    saved = {case: float(cells[5]) for case, cells in rows.items()}  # the ratio to Pre-LN's (2 decimals)
    assert saved["attnres"] > saved["blockattnres"] > saved["preln"] == 1
    bad = subprocess.run([sys.executable, str(REPO / "benchmarks" / "hc_cost.py"), "--cases", "attnres,nope"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    want = "error: --cases: unknown nope; choose from preln, hc, hc-static, mhc, mhc-autograd, attnres, blockattnres"
    assert bad.returncode == 1 and bad.stderr.strip() == want, bad.stderr


def test_hc_cost_ratio_of_an_unmeasured_reference_is_a_dash():
    """A toy shape's update may grow Pre-LN's RSS by nothing: its ratio column says ``-`` instead of dividing by 0."""
    from deepinit_tools.bench.hc_cost import vs

    assert vs(3.0, 2.0) == "1.50" and vs(0.0, 0.0) == "-" and vs(5.0, 0.0) == "-"
