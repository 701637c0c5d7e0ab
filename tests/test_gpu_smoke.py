"""benchmarks/gpu_smoke.py on the CPU: every architecture is listed, a subset trains, decodes and is audited.

The CUDA run (fp16, sync debug mode, flash / efficient kernels) needs a GPU (docs/benchmarks.md,
"GPU run"); here the same code path runs with fp32 in place of fp16 and CPU autocast for bf16.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, run_script

SCRIPT = REPO / "benchmarks" / "gpu_smoke.py"
from deepinit_tools.bench import gpu_smoke, smoke_training  # noqa: E402

# one of each kind: stock, a Post-LN init scheme, Admin (profiling on the first step), MAtt (its own
# incremental decoding), Sub-LN and NormFormer (successors with extra norms), DyT (a norm whose backward
# reduces in fp32), three language models (mHC's: its mapping runs in fp32 by design)
SUBSET = ("stock", "postln", "admin", "dsinit_matt", "normformer", "subln", "dyt", "lm:stock", "lm:admin",
          "lm:deepnorm", "lm:mhc")  # fmt: skip
TINY = ["--layers", "2", "--dim", "32", "--ffn", "64", "--heads", "2", "--batch", "4"]


def test_every_family_is_an_architecture_of_the_smoke_test():
    from fairseq_deepinit.architectures import FAMILIES
    from fairseq_deepinit.lm.architectures import LM_FAMILIES

    names = {a.name for a in gpu_smoke.architectures()}
    assert names == {"stock", "lm:stock", *FAMILIES, *(f"lm:{f}" for f in LM_FAMILIES)}
    # the list: MAtt, Admin, the successors, the language models
    assert {"matt", "dsinit_matt", "admin", "admin_closed", "subln", "b2t", "normformer", "lm:admin"} <= names
    admin = next(a for a in gpu_smoke.architectures() if a.name == "admin")
    assert (admin.task, admin.bf16_task) == ("translation_admin", "translation_admin")
    lm = next(a for a in gpu_smoke.architectures() if a.name == "lm:preln")
    assert lm.lm and lm.bf16_task is None  # no language-model task with --autocast-bf16 but Admin's


def test_every_architecture_row_builds_with_the_smoke_tests_flags(tmp_path):
    """What a CPU run of a subset cannot show: no family refuses what the smoke test adds (its attention path,
    its tasks, the precisions' flags); a family that refuses ``--attention-impl sdpa`` keeps its own and says so."""
    from deepinit_tools.harness.fairseq_train import fairseq_config, setup_task

    opts = gpu_smoke.build_parser().parse_args(["--device", "cpu", *TINY])
    data = gpu_smoke.write_dictionaries(tmp_path)
    for a in gpu_smoke.architectures():  # bf16's flags: the model's of every pass, and the autocast task's
        fcfg = fairseq_config(gpu_smoke.train_argv(a, data, "bf16-autocast", opts))
        setup_task(fcfg).build_model(fcfg.model)
    refusing = [a for a in gpu_smoke.architectures() if a.sdpa_refused]
    assert {a.name for a in refusing} == {"attnsoftcap", "lm:attnsoftcap"}
    assert "--attention-impl" not in gpu_smoke.train_argv(refusing[0], data, "fp32", opts)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    proc = run_script(
        str(SCRIPT), "--device", "cpu", "--only", ",".join(SUBSET), *TINY, "--out-dir", str(out), timeout=300
    )  # fmt: skip
    return json.loads((out / "smoke.json").read_text()), (out / "smoke.md").read_text(), proc.stdout


def test_cpu_smoke_trains_decodes_and_audits_every_selected_architecture(smoke):
    doc, md, stdout = smoke
    rows = doc["rows"]
    assert doc["finished"] and len(rows) == 2 * len(SUBSET)
    assert {(r["arch"], r["precision"]) for r in rows} == {(a, p) for a in SUBSET for p in ("fp16", "bf16-autocast")}
    assert doc["passed"] == len(rows), [(r["arch"], r["ran_as"], r.get("error")) for r in rows if r["status"] != "ok"]
    for r in rows:
        assert len(r["train_losses"]) == 3 and r["hypotheses_per_sentence"] == [4], r
        assert len(r["syncs_per_train_step"]) == 3 and r["decode_syncs"] > 0, r
        if r["precision"] == "fp16":  # CPU: fp32 in its place, and the row says so
            assert r["ran_as"] == "fp32" and "fp16 needs CUDA" in r["note"]
            assert set(r["matmul_dtypes_train"]) == {"float32"}
        elif r["arch"] in ("dyt", "lm:mhc"):  # DyT's alpha gradient (modules/dyt.py _full_dot), mHC's mapping
            assert set(r["matmul_dtypes_train"]) == {"bfloat16", "float32"} and r["status"] == "ok", r
        else:  # every matrix product of the last training step under bf16 autocast
            assert set(r["matmul_dtypes_train"]) == {"bfloat16"}, r
        kinds = r["sdpa_train"]
        assert "decoder self_attn" in kinds or r["arch"].endswith("matt"), kinds
        if r["arch"] in ("stock", "lm:stock"):  # fairseq's own attention never calls SDPA here
            assert all(set(v) == {"fairseq"} for v in kinds.values()), kinds
        if r["arch"] in ("postln", "admin", "normformer", "lm:admin", "lm:deepnorm"):  # --attention-impl sdpa
            assert "fairseq" not in kinds["decoder self_attn"], kinds
    # the language models without an autocast task say how bf16 ran
    lm_bf16 = next(r for r in rows if r["arch"] == "lm:deepnorm" and r["precision"] == "bf16-autocast")
    assert "AutocastCriterion" in lm_bf16["note"]
    assert f"{len(rows)} of {len(rows)} passed" in stdout and "| admin | bf16-autocast | ok |" in md


def test_every_optimizer_and_training_hook_of_the_plugin_is_a_training_row():
    from fairseq.optim import OPTIMIZER_REGISTRY

    from fairseq_deepinit.methods import METHODS, TRAINING_HOOKS

    ours = {n for n, cls in OPTIMIZER_REGISTRY.items() if cls.__module__.startswith("fairseq_deepinit.")}
    assert ours and ours <= {s.optimizer for s in smoke_training.SETUPS}
    hooked = {m.name for m in METHODS.values() if any(getattr(m, h) is not None for h in TRAINING_HOOKS)}
    assert hooked and hooked == {m for s in smoke_training.SETUPS for m in s.methods}
    names = [s.name for s in smoke_training.SETUPS]
    assert len(set(names)) == len(names) and not set(names) & {a.name for a in gpu_smoke.architectures()}


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    out = tmp_path_factory.mktemp("training")
    names = ",".join(s.name for s in smoke_training.SETUPS)
    run_script(str(SCRIPT), "--device", "cpu", "--only", names, "--out-dir", str(out), timeout=300)
    return json.loads((out / "smoke.json").read_text())["rows"]


def test_cpu_training_rows_step_every_optimizer_and_hook_through_fairseqs_trainer(training):
    setups = {s.name: s for s in smoke_training.SETUPS}
    assert [(r["arch"], r["precision"]) for r in training] == [(n, p) for n in setups for p in gpu_smoke.PRECISIONS]
    assert all(r["status"] == "ok" for r in training), [(r["arch"], r["ran_as"], r.get("error")) for r in training]
    for r in training:
        s = setups[r["arch"]]
        assert len(r["train_losses"]) == 3 and None not in r["train_losses"], r
        assert r["training_methods"] == list(s.methods) and set(r["logged"]) == set(s.logs), r
        assert r["optimizer"] == s.optimizer and r["optimizer_state"] == ["float32"], r
        assert "fairseq" not in r["sdpa_train"]["decoder self_attn"], r  # --attention-impl sdpa
        if r["precision"] == "fp16":  # real fp16 on the CPU without fairseq's flat master, fp32 (said) with it
            flat = "--fp16-no-flatten-grads" not in s.fp16
            assert r["ran_as"] == ("fp32" if flat else "fp16") and ("fp16 needs CUDA" in r.get("note", "")) == flat
            assert ("--fp16" in r["flags"].split()) != flat, r
    zloss = next(r for r in training if r["arch"] == "train:z_loss")
    assert 0 < zloss["logged"]["z_loss"] < zloss["logged"]["z_loss_unscaled"]


@pytest.mark.parametrize("setup, says", [
    (smoke_training.Setup("x", ("--optimizer", "adam"), methods=("z_loss",)), "methods with a training hook on"),
    (smoke_training.Setup("x", ("--optimizer", "adam"), logs=("z_loss",)), "not logged: z_loss"),
    (smoke_training.Setup("x", ("--optimizer", "adam", "--lr", "0")), "weights never moved"),
])  # fmt: skip
def test_a_training_row_fails_what_it_did_not_see(setup, says):
    row = smoke_training.smoke_training_one(
        setup, "bf16-autocast", gpu_smoke.build_parser().parse_args(["--device", "cpu"])
    )
    assert row["status"] == "failed" and says in row["error"], row


def test_host_syncs_are_counted_on_the_cpu():
    import torch

    x = torch.ones(3)
    with gpu_smoke.count_host_syncs("cpu") as n:
        x.sum().item()
        bool(x.any())
        torch.nonzero(x)
        torch.tensor([3]).item()  # made on the host from a Python number: no device to wait for
    with gpu_smoke.count_host_syncs("cpu") as none:
        x.add_(1)
    assert (n["n"], none["n"]) == (3, 0)


def test_results_are_written_after_every_row(tmp_path, monkeypatch):
    """A run cut after its first row leaves that row in smoke.json, marked unfinished."""
    calls = []

    def fake(a, precision, data, opts):
        if calls:
            raise KeyboardInterrupt  # the time limit
        calls.append(a.name)
        return {"arch": a.name, "precision": precision, "ran_as": precision, "status": "ok", "seconds": 0.1}

    monkeypatch.setattr(gpu_smoke, "smoke_one", fake)
    with pytest.raises(KeyboardInterrupt):
        gpu_smoke.main(["--device", "cpu", "--only", "postln", "--out-dir", str(tmp_path)])
    doc = json.loads((tmp_path / "smoke.json").read_text())
    assert doc["finished"] is False and [r["arch"] for r in doc["rows"]] == ["postln"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--only", "nope"], "unknown architecture"),
        (["--precisions", "fp8"], "--precisions"),
        (["--dim", "30", "--heads", "4"], "must divide"),
    ],
)
def test_bad_options_are_one_line(args, message):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *args], capture_output=True, text=True)
    assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_gpu_results_merges_a_session_into_gpu_json_and_refuses_cpu_results(tmp_path):
    """benchmarks/gpu_results.py: each file under its slot; a newer pass replaces the stored one; CPU refused."""
    from deepinit_tools.bench import gpu_results

    def result(name: str, device: str, value: int):
        path = tmp_path / name
        path.write_text(json.dumps({"meta": {"device": device}, "rows": [value]}))
        return path

    store = gpu_results.merge({"matrix": {"gpu-18l-36l": {"rows": [0]}}}, [result("smoke.json", "cuda", 1),
                              result("gpu-6l.json", "cuda", 2), result("prof.json", "cuda", 3)])  # fmt: skip
    assert store["smoke"]["rows"] == [1] and store["profile"]["prof"]["rows"] == [3]
    assert set(store["matrix"]) == {"gpu-18l-36l", "gpu-6l"}
    store = gpu_results.merge(store, [result("gpu-6l.json", "cuda", 4)])
    assert store["matrix"]["gpu-6l"]["rows"] == [4]
    with pytest.raises(ValueError, match="measured on the CPU"):
        gpu_results.merge(store, [result("smoke.json", "cpu", 5)])
    with pytest.raises(ValueError, match="report --converged"):
        gpu_results.merge(store, [result("converged.json", "cuda", 6)])
    into = tmp_path / "docs" / "gpu.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_results.py"), str(tmp_path / "smoke.json"),
                           "--into", str(into)], capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 1 and "measured on the CPU" in proc.stderr and not into.exists()
