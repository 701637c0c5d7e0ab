"""The converged Multi30k matrix (``multi30k_matrix.py converge`` / ``report --converged``):
patience and status rules, each paper's regime flags, the chunk budget estimate, CUDA command
construction, and a 2-cell CUDA-free smoke run of the whole converge path (train to the epoch cap,
decode, result file, resume, pack, report) on the first lines of the real Multi30k."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MULTI30K, REPO, read_multi30k
from deepinit_tools.matrix import budget as est
from deepinit_tools.matrix import commands as cmds
from deepinit_tools.matrix import logs
from deepinit_tools.matrix import regimes as rg
from deepinit_tools.matrix import report as rp

SCRIPT = REPO / "scripts" / "multi30k_matrix.py"


def curve(*losses: float) -> list:
    return [(e + 1, x, x - 0.1, 100 * (e + 1)) for e, x in enumerate(losses)]


@pytest.mark.parametrize(
    "losses, patience, expected",
    [
        ((9.0, 8.0, 7.0, 7.5, 7.2), 2, True),  # best at epoch 3, two epochs without a better loss
        ((9.0, 8.0, 7.0, 7.5), 2, False),  # only one epoch since the best
        ((9.0, 8.0, 7.0, 6.9), 1, False),  # still improving
        ((9.0, 7.0, 7.0), 1, True),  # equal is not better (fairseq's strict rule)
        ((9.0,), 1, False),
    ],
)
def test_patience_rule(losses, patience, expected):
    assert logs.plateaued(curve(*losses), patience) is expected


def test_status_of_a_finished_cell():
    plateau, improving = curve(9.0, 6.0, 5.0, 5.1, 5.2), curve(9.0, 6.0, 5.0, 4.9, 4.8)
    early = "INFO | fairseq_cli.train | early stop since valid performance hasn't improved for last 2 runs"
    ok = {"distinct": 900, "sentences": 1000}
    assert logs.classify(plateau, early, 0, 2, 7.9, ok) == ("converged", "patience")
    assert logs.classify(improving, "", 0, 2, 7.9, ok) == ("capped", "epoch-cap")
    assert logs.classify(plateau, "", 0, 2, 4.0, ok)[0] == "stalled"  # never below the unigram bits
    assert logs.classify(plateau, early, 0, 2, 7.9, {"distinct": 3, "sentences": 1000})[0] == "source-blind"
    assert logs.classify(curve(9.0, float("nan")), "", 0, 2, 7.9, ok)[0] == "diverged"
    assert logs.classify(plateau, "FloatingPointError: Minimum loss scale reached (0.0001).", 1, 2, 7.9, ok)[0] == (
        "diverged"
    )
    assert logs.classify(plateau, "Killed", 137, 2, 7.9, ok)[0] == "failed"
    lr = "early stop since lr is lower than 5e-05"
    assert logs.classify(improving, lr, 0, 2, 7.9, ok) == ("converged", "min-lr")


def test_valid_curve_keeps_one_record_per_epoch_and_reads_tokens_per_second():
    def v(epoch: int, loss: float) -> str:
        rec = {"epoch": epoch, "valid_loss": loss, "valid_nll_loss": loss - 0.2, "valid_num_updates": 100 * epoch}
        return f"2026 | INFO | valid | {json.dumps(rec)}"

    text = "\n".join([v(1, 8.0), v(2, 7.0), v(2, 6.9), '2026 | INFO | train | {"epoch": 1, "train_wps": "1000"}'])
    for epoch, wps in ((2, 3000), (3, 2000)):
        text += f'\n2026 | INFO | train | {{"epoch": {epoch}, "train_wps": "{wps}"}}'
    # a resumed run validates epoch 2 again: the last record wins
    assert logs.valid_curve(text) == [(1, 8.0, 7.8, 100), (2, 6.9, pytest.approx(6.7), 200)]
    assert logs.train_wps(text) == 2000


def flags_of(method: str, regime: str, depth: int = 18) -> str:
    return " ".join(rg.Cell(depth, method, regime).spec.flags())


def test_each_paper_regime_has_its_recipe_flags():
    admin = flags_of("admin", "paper")
    assert "--optimizer radam" in admin and "--lr 0.0007" in admin and "--warmup-updates 550" in admin
    assert "--dropout 0.3 --attention-dropout 0.1 --activation-dropout 0.1" in admin
    assert flags_of("postln", "paper") == admin and flags_of("preln", "paper") == admin  # Admin's Table 2 rows
    tfixup = flags_of("tfixup", "paper")  # T-Fixup's claim: no warm-up; P = 4000 IWSLT updates = 3.6 epochs
    assert "--lr-scheduler tfixup --decay-period 360" in tfixup and "--warmup-updates" not in tfixup
    assert "--dropout 0.5" in tfixup and "--lr 0.0005" in tfixup
    tfixup_w = flags_of("tfixup", "paper-warmup")  # ... and run the other way too
    assert "--lr-scheduler inverse_sqrt --warmup-updates 360" in tfixup_w and "--dropout 0.5" in tfixup_w
    twt = flags_of("twt", "paper")
    assert "reduce_lr_on_plateau" in twt and "--lr-shrink 0.8 --lr-patience 3" in twt and "--clip-norm 1" in twt
    assert "--warmup-updates" not in flags_of("twt", "paper-nowarmup") and "--lr 0.0003" in flags_of(
        "twt", "paper-nowarmup"
    )
    deepnorm = flags_of("deepnorm", "paper")
    assert "--optimizer radam" in deepnorm and "--lr 0.001" in deepnorm and "--weight-decay 0 " in deepnorm + " "
    assert "--warmup-updates 150" in deepnorm  # 8000 WMT17 updates at 4x8192 tokens = 1.5 epochs
    assert "--lr 0.0007" in flags_of("lipschitz", "paper") and "--dropout 0.1" in flags_of("lipschitz", "paper")
    common = flags_of("postln", "common")
    assert "--optimizer adam" in common and "--lr 0.0005" in common and "--warmup-updates 360" in common
    # DS-Init's paper regime is the common one: one cell, not two
    assert rg.Cell.parse("dsinit:18:common") == rg.Cell(18, "dsinit", "paper")
    both = rg.cells_of(18, "both")
    assert len(both) == len(set(both)) == 11 + 7
    assert {c.regime for c in both if c.method == "tfixup"} == {"paper", "paper-warmup", "common"}


def test_every_warm_up_starts_above_the_stop_floor(tmp_path):
    """fairseq-train stops before an epoch whose lr is <= --stop-min-lr, the first one included
    (fairseq_cli/train.py:196): a plateau cell that warms up from below the floor trains 0 updates."""
    opts = cmds.Options(data=tmp_path, runs=tmp_path)
    for method in rg.METHODS:
        for regime in rg.regimes_of(method):
            argv = cmds.train_command(rg.Cell(18, method, regime), opts)
            if "--warmup-init-lr" in argv and "--stop-min-lr" in argv:
                init = float(argv[argv.index("--warmup-init-lr") + 1])
                assert init > float(argv[argv.index("--stop-min-lr") + 1]), (method, regime)
    assert "--warmup-init-lr" in cmds.train_command(rg.Cell(18, "twt", "paper"), opts)


def test_chunks_cover_the_matrix_and_the_estimate_follows_the_h100_figures():
    cells = [c for name, ch in rg.CHUNKS.items() if name != "smoke" for c in ch.cells]
    assert len(cells) == len(set(cells))
    for d in (6, 18, 36):
        assert set(rg.cells_of(d, "both")) <= set(cells)
    assert {c.seed for c in cells if c.depth == 18 and c.regime == "paper" and c.method == "admin"} == {1, 2, 3}
    # the anchors: d=512 at 6 and 18 layers give the known H100 figures (18 layers within the CPU-vs-H100 gap)
    assert est.h100_tokens_per_s(6, 512) == pytest.approx(173_000)
    assert est.h100_tokens_per_s(18, 512) == pytest.approx(62_000, rel=0.03)
    one = [rg.Cell(18, "preln", "paper")]
    single = est.estimate_cell_s(one[0], 256, est.EPOCHS_EXPECTED) / 60
    assert est.estimate_chunk(one, 256, 4) == pytest.approx(single)  # one cell: no sharing gain
    eight = [rg.Cell(18, m, "paper") for m in rg.METHODS[:8]]
    assert est.estimate_chunk(eight, 256, 4) == pytest.approx(8 * single / est.JOBS_SPEEDUP[4])
    assert est.estimate_chunk(eight, 256, 1) > est.estimate_chunk(eight, 256, 4)
    assert est.estimate_chunk(eight, 512, 4) > est.estimate_chunk(eight, 256, 4)
    for name, ch in rg.CHUNKS.items():
        if not name.startswith("100l"):
            assert est.estimate_chunk(ch.cells, 256, 4) < 22, name  # one GPU session each


def opts(tmp_path: Path, **kw) -> cmds.Options:
    return cmds.Options(tmp_path, tmp_path / "runs", **kw)


def test_cuda_commands(tmp_path):
    cell = rg.Cell(18, "preln", "paper")
    fp16 = cmds.train_command(cell, opts(tmp_path, device="cuda", precision="fp16"))
    assert "--fp16" in fp16 and "--cpu" not in fp16 and "--bf16" not in fp16
    bf16 = " ".join(cmds.train_command(cell, opts(tmp_path, device="cuda", precision="bf16")))
    assert "--task translation_deepinit --autocast-bf16" in bf16 and "--fp16" not in bf16
    admin = cmds.train_command(rg.Cell(18, "admin", "paper"), opts(tmp_path, device="cuda", precision="bf16"))
    assert admin.count("--task") == 1 and "translation_admin" in admin and "--autocast-bf16" in admin
    split = cmds.train_command(rg.Cell(100, "tfixup", "paper"), opts(tmp_path, device="cuda", max_tokens_per_job=4096))
    i, j = split.index("--max-tokens"), split.index("--update-freq")
    assert (split[i + 1], split[j + 1]) == ("4096", "2")  # 8192 tokens per update in two forwards
    whole = cmds.train_command(cell, opts(tmp_path, device="cuda", max_tokens_per_job=16384))
    assert whole[whole.index("--update-freq") + 1] == "1"
    assert est.update_freq(12000, 5000) == (4000, 3)
    cpu = cmds.train_command(cell, opts(tmp_path))
    assert "--cpu" in cpu and "--patience" in cpu and cpu[cpu.index("--max-epoch") + 1] == "50"
    with pytest.raises(cmds.ConvergeError, match="needs --device cuda"):
        cmds.precision_flags("preln", "cpu", "fp16")


def driver(*args: str, m30k: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "MULTI30K_DIR": str(m30k), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert not check or proc.returncode == 0, proc.stdout[-3000:]
    return proc


def test_bad_input_is_one_line(tmp_path):
    for args, msg in (
        (["converge", "--chunk", "nope"], "unknown --chunk"),
        (["converge", "--cells", "bert:6:paper"], "unknown method"),
        (["converge", "--cells", "tfixup:6:paper-nowarmup"], "has no regime"),
        (["converge", "--device", "cpu", "--precision", "bf16", "--cells", "preln:6:paper"], "needs --device cuda"),
        (["converge", "--patience", "0"], "at least 1"),
    ):
        proc = driver(*args, "--work-dir", str(tmp_path), m30k=tmp_path, check=False)
        assert proc.returncode == 1 and msg in proc.stdout and "Traceback" not in proc.stdout, proc.stdout
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    proc = driver("report", "--converged", "--packs", str(bad), "--docs-dir", str(tmp_path), m30k=tmp_path, check=False)
    assert proc.returncode == 1 and "is not a `converge --pack` file" in proc.stdout


def test_dry_run_prints_commands_and_estimate(tmp_path):
    out = driver(
        "converge", "--chunk", "18l-seed2", "--device", "cuda", "--dry-run", "--work-dir", str(tmp_path), m30k=tmp_path
    ).stdout
    commands = [ln for ln in out.splitlines() if ln.startswith("fairseq-train ")]
    assert len(commands) == 9 and all("--seed 2" in c and "--autocast-bf16" in c for c in commands)
    assert "estimated" in out and "H100 minutes" in out


@pytest.fixture(scope="module")
def tiny_multi30k(tmp_path_factory) -> Path:
    """The first lines of every Multi30k split, gzip, in Multi30k's own file names."""
    if not (MULTI30K / "train.de.gz").exists():
        pytest.skip(f"Multi30k not found at {MULTI30K} (set MULTI30K_DIR)")
    root = tmp_path_factory.mktemp("m30k")
    for split, n in {"train": 300, "val": 30, "test_2016_flickr": 16, "test_2017_flickr": 12}.items():
        for lang in ("de", "en"):
            with gzip.open(root / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("\n".join(read_multi30k(split, lang, n)) + "\n")
    return root


def test_two_cell_smoke_run_resumes_packs_and_reports(tiny_multi30k, tmp_path):
    """The converge code path without CUDA: 2 cells to the epoch cap, a result file per cell with
    every field, a second invocation that skips them, one pack, and the report into a temp docs folder."""
    pack = tmp_path / "out" / "chunk.json"
    args = [
        "converge",
        "--work-dir",
        str(tmp_path / "w"),
        "--bpe-merges",
        "300",
        "--cells",
        "preln:2:paper,tfixup:2:paper",
        "--dim",
        "32",
        "--ffn",
        "64",
        "--heads",
        "2",
        "--max-epochs",
        "2",
        "--patience",
        "1",
        "--max-tokens",
        "1024",
        "--beam",
        "2",
        "--jobs",
        "2",
        "--pack",
        str(pack),
    ]
    driver(*args, m30k=tiny_multi30k)
    runs = tmp_path / "w" / "converged"
    for name in ("preln-2-paper-s1", "tfixup-2-paper-s1"):
        r = json.loads((runs / name / "result.json").read_text())
        for key in (*rp.REQUIRED, "command", "date", "settings", "tokens_per_s", "dev_loss", "probe", "bleu_signature"):
            assert r.get(key) is not None, key
        assert r["epochs"] == 2 and r["settings"]["patience"] == 1 and r["settings"]["max_epochs"] == 2
        assert r["command"].startswith("fairseq-train ") and "--cpu" in r["command"] and r["device_type"] == "cpu"
        assert r["status"] in ("converged", "capped", "stalled", "source-blind")
        assert not list((runs / name).glob("*.pt"))  # checkpoints deleted once the result exists
    again = driver(*args, m30k=tiny_multi30k).stdout
    assert again.count("finished before") == 2 and "train preln" not in again
    packed = json.loads(pack.read_text())
    assert packed["format"] == cmds.PACK_FORMAT and len(packed["cells"]) == 2
    # the pack measures the cells' rates for --plan; --measure-jobs measures a pack of K processes (CPU here)
    planned = driver("converge", "--plan", "--rates", str(pack), m30k=tiny_multi30k).stdout
    assert "CPU-MEASURED, not a GPU plan" in planned
    rates = tmp_path / "out" / "rates.json"
    model = ["--work-dir", str(tmp_path / "w"), "--dim", "32", "--ffn", "64", "--heads", "2", "--max-tokens", "1024"]
    driver("converge", *model, "--measure-jobs", "1", "--measure-updates", "10", "--measure-cells", "preln:2:paper",
           "--rates", str(rates), m30k=tiny_multi30k)  # fmt: skip
    measured = json.loads(rates.read_text())["measurements"]
    assert [(m["jobs"], len(m["per_process"])) for m in measured] == [(1, 1)] and measured[0]["aggregate"] > 0

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results.md").write_text(f"intro\n{rp.BEGIN}\nold\n{rp.END}\nkept\n")
    driver(
        "report",
        "--converged",
        "--packs",
        str(pack),
        "--runs-dir",
        str(tmp_path / "none"),
        "--docs-dir",
        str(docs),
        m30k=tiny_multi30k,
    )
    stored = json.loads((docs / "results" / "converged.json").read_text())
    assert sorted(c["cell"] for c in stored) == ["preln:2:paper:s1", "tfixup:2:paper:s1"]
    md = (docs / "results.md").read_text()
    assert md.startswith("intro\n") and md.endswith(f"{rp.END}\nkept\n") and "old" not in md
    assert "`preln:2:paper:s1`" in md and "| Pre-LN | paper |" in md and "sacreBLEU signature" in md
    # a newer result of the same cell replaces the stored one; an older one does not
    newer = {**stored[0], "date": "2100-01-01T00:00:00+00:00", "status": "converged"}
    older = {**stored[1], "date": "2000-01-01T00:00:00+00:00", "status": "diverged"}
    merged = rp.merge({c["cell"]: c for c in stored}, [newer, older])
    assert merged[newer["cell"]]["status"] == "converged" and merged[older["cell"]]["status"] == stored[1]["status"]


# --- the GPU session: fast path, deadlines, a pack after every cell, the packing plan -------------------


def test_cuda_cells_train_on_the_fast_path(tmp_path):
    """On CUDA: SDPA everywhere, adam_foreach where the regime trains with Adam (RAdam regimes keep radam);
    the CPU and --no-fast-path keep the plain path."""
    common = rg.Cell(18, "preln", "common")  # Adam
    paper = rg.Cell(18, "admin", "paper")  # RAdam
    cuda = opts(tmp_path, device="cuda", precision="bf16")
    fast = " ".join(cmds.train_command(common, cuda))
    assert "--optimizer adam_foreach " in fast and "--attention-impl sdpa" in fast and fast.count("--optimizer") == 1
    radam = " ".join(cmds.train_command(paper, cuda))
    assert "--optimizer radam " in radam and "--attention-impl sdpa" in radam
    for plain in (opts(tmp_path, device="cuda", precision="bf16", fast_path=False), opts(tmp_path)):
        text = " ".join(cmds.train_command(common, plain))
        assert "--optimizer adam " in text and "--attention-impl" not in text


def test_translate_stops_at_the_deadline(tmp_path, monkeypatch):
    """fairseq-generate (here a stand-in that never ends) is killed at the deadline; nothing is taken
    for a finished translation, and a deadline already passed starts nothing."""
    from deepinit_tools.matrix import decode

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nsleep 60 &\nwait\n")  # a child that would hold the pipe open, as data loaders do
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))  # the interpreter every fairseq command runs in
    (tmp_path / "checkpoint_best.pt").write_bytes(b"")
    t0 = decode.time.time()
    with pytest.raises(decode.DecodeDeadline):
        decode.translate(tmp_path, tmp_path, "valid", "dev-greedy", 1, 1, deadline=t0 + 1.0)
    assert decode.time.time() - t0 < 10
    assert not (tmp_path / "generate-dev-greedy.txt").exists()
    with pytest.raises(decode.DecodeDeadline):
        decode.translate(tmp_path, tmp_path, "test", "test2016", 5, 1, deadline=t0)
    assert not (tmp_path / "generate-test2016.tmp").exists()


def test_the_pack_is_rewritten_after_every_cell(tmp_path, monkeypatch):
    """A command cut after its first cell still returns that cell's result in the pack."""
    from deepinit_tools.matrix import run

    seen: list = []

    def fake_cell(cell, o, dev, stall):
        if seen:  # the second cell: the first must already be in the pack
            seen.append([c["cell"] for c in json.loads(pack.read_text())["cells"]])
            return None  # stopped at the deadline
        out = o.runs / cell.dirname
        out.mkdir(parents=True)
        (out / "result.json").write_text(json.dumps({"cell": cell.name}))
        seen.append(cell.name)
        return {"cell": cell.name}

    for name, value in (("run_cell", fake_cell), ("prepare", lambda *a: None), ("stall_bits_of", lambda o: 7.0)):
        monkeypatch.setattr(run, name, value)
    pack = tmp_path / "out" / "p.json"
    code = run.main(["--cells", "preln:2:paper,tfixup:2:paper", "--work-dir", str(tmp_path), "--pack", str(pack)])
    assert code == 0 and seen == ["preln:2:paper:s1", ["preln:2:paper:s1"]]
    assert [c["cell"] for c in json.loads(pack.read_text())["cells"]] == ["preln:2:paper:s1"]


def rates_file(path: Path, per: dict, device_type: str = "cuda") -> Path:
    """A --measure-jobs file: ``per`` maps jobs to the per-process tokens/s of 6-layer cells."""
    doc = {"format": "deepinit-pack-rates/1", "device": "NVIDIA H100 80GB HBM3", "device_type": device_type,
           "precision": "bf16", "fast_path": True, "dim": 256, "date": "2026-11-25T00:00:00+00:00", "updates": 200,
           "measurements": [{"cell": "preln:6:common:s1", "layers": 6, "jobs": k, "per_process": [v] * k,
                             "aggregate": k * v} for k, v in per.items()]}  # fmt: skip
    path.write_text(json.dumps(doc))
    return path


def test_plan_schedules_the_cells_in_order_on_the_measured_rates(tmp_path):
    from deepinit_tools.matrix import plan

    assert plan.schedule([4, 1, 1, 1], 2) == [4, 1, 2, 3]  # in order, each to the first free slot
    # perfect sharing: 8 processes each as fast as one alone -> the 8 cells of 6 layers take one cell's time
    rates = plan.load_rates(rates_file(tmp_path / "r.json", {1: 100_000.0, 8: 100_000.0}))
    cells = [rg.Cell(6, m, "paper") for m in rg.MAIN_METHODS[:8]]
    one = plan.cell_seconds(cells[0], rates, 256, 1)
    assert one == pytest.approx(est.estimate_cell_s(cells[0], 256, est.EPOCHS_EXPECTED, tokens_per_s=100_000.0))
    text, best = plan.plan(cells, rates, 256, [1, 8], budget_min=one / 60 + 0.01, command_min=8.5)
    assert best == 8 and "measured by --measure-jobs on NVIDIA H100" in text
    assert f"{8 * one / 60:9.1f}" in text and f"{one / 60:9.1f}" in text  # wall minutes at 1 and 8 jobs
    assert "finished within" in text and all(c.name in text for c in cells)
    # an 18-layer cell: the 6-layer rate scaled by the CPU-measured depth cost, and the plan says so
    value, how = rates.rate(18, 8)
    assert value == pytest.approx(100_000 / est.depth_cost(18)) and "scaled" in how
    assert plan.best_jobs(plan.load_rates(rates_file(tmp_path / "s.json", {1: 100.0, 8: 20.0, 16: 9.0}))) == 8


def test_plan_and_jobs_auto_on_the_command_line(tmp_path):
    est = driver("converge", "--chunk", "priority", "--plan", "--budget-min", "18", m30k=tmp_path).stdout
    assert est.startswith("rates: ESTIMATE, not measured") and "best: --jobs" in est
    cpu = rates_file(tmp_path / "cpu.json", {1: 900.0, 2: 500.0}, device_type="cpu")
    out = driver("converge", "--chunk", "6l", "--plan", "--rates", str(cpu), m30k=tmp_path).stdout
    assert "CPU-MEASURED, not a GPU plan" in out and "best: --jobs 2" in out
    for args, msg in (
        (["--jobs", "auto"], "run --measure-jobs first"),
        (["--jobs", "many"], "--jobs 'many'"),
        (["--measure-jobs", "1,4"], "add --rates"),
        (["--measure-jobs", "1,x", "--rates", str(cpu)], "comma-separated list"),
        (["--plan", "--rates", str(tmp_path / "missing.json")], "cannot read it as JSON"),
    ):
        proc = driver("converge", "--chunk", "6l", *args, "--work-dir", str(tmp_path), m30k=tmp_path, check=False)
        assert proc.returncode == 1 and msg in proc.stdout and "Traceback" not in proc.stdout, (args, proc.stdout)


def test_packed_cells_start_in_order_within_the_measured_memory(tmp_path):
    """A cell starts once it fits beside the running ones (a 36-layer cell holds ~6x a 6-layer one's
    activations); the plan's schedule and converge's gate follow the same rule."""
    import threading
    import time

    from deepinit_tools.matrix import plan

    assert plan.schedule([10, 10, 10], 3, [50, 50, 50], 100) == [10, 10, 20]  # the third waits for memory
    assert plan.schedule([10, 10, 10], 3, [50, 50, 50], None) == [10, 10, 10]  # nothing measured: no gate
    assert plan.schedule([10, 10], 2, [150, 10], 100) == [10, 20]  # too big for the budget: runs alone
    doc = json.loads(rates_file(tmp_path / "r.json", {1: 1000.0}).read_text())
    doc["device_memory_mib"] = 81_559
    doc["measurements"][0]["peak_mib"] = [1_000]
    (tmp_path / "m.json").write_text(json.dumps(doc))
    rates = plan.load_rates(tmp_path / "m.json")
    assert rates.memory_mib(6) == 1_000 + plan.CONTEXT_MIB
    assert rates.memory_mib(36) == pytest.approx(6_000 + plan.CONTEXT_MIB)  # scaled in depth
    assert rates.memory_budget_mib() == pytest.approx(0.9 * 81_559)

    gate, lock, log, live = plan.MemoryGate(100.0), threading.Lock(), [], []

    def cell(i: int) -> None:
        with gate.hold(i, 50.0):
            with lock:
                log.append(i)
                live.append(i)
                most = len(live)
            time.sleep(0.05)
            with lock:
                live.remove(i)
        return most

    threads = [threading.Thread(target=lambda i=i: peaks.append(cell(i))) for i in (3, 1, 0, 2)]
    peaks: list = []
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert log == [0, 1, 2, 3] and max(peaks) == 2


def test_skip_done_leaves_out_the_cells_with_a_result_on_the_same_device(tmp_path, monkeypatch):
    from deepinit_tools.matrix import run

    ran: list = []
    monkeypatch.setattr(run, "run_cell", lambda c, o, dev, stall: ran.append(c.name))
    monkeypatch.setattr(run, "prepare", lambda *a: None)
    monkeypatch.setattr(run, "stall_bits_of", lambda o: 7.0)
    store = tmp_path / "converged.json"  # docs/results/converged.json: a list of results
    store.write_text(json.dumps([{"cell": "preln:2:paper:s1", "device_type": "cpu"},
                                 {"cell": "tfixup:2:paper:s1", "device_type": "cuda"}]))  # fmt: skip
    pack = tmp_path / "p.json"
    pack.write_text(
        json.dumps({"format": cmds.PACK_FORMAT, "cells": [{"cell": "admin:2:paper:s1", "device_type": "cpu"}]})
    )
    cells = "preln:2:paper,tfixup:2:paper,admin:2:paper,dsinit:2:paper"
    args = ["--cells", cells, "--work-dir", str(tmp_path), "--skip-done", str(store), "--skip-done", str(pack)]
    assert run.main(args) == 0 and ran == ["tfixup:2:paper:s1", "dsinit:2:paper:s1"]  # CPU results only count on CPU
    assert run.main([*args[:4], "--skip-done", str(tmp_path / "nope.json")]) == 1
