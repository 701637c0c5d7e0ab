"""benchmarks/gpu_session.py: the budget's deadlines, the stages' commands, the packed cells' records, the
files a session returns, the plan, the paste into the docs, and the whole session in its CPU rehearsal form
(``--device cpu --quick``, slow)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, write_multi30k_gz
from deepinit_tools.matrix import report as rp
from deepinit_tools.session import cells, driver, stages
from deepinit_tools.session.plan import plan

SESSION = REPO / "benchmarks" / "gpu_session.py"


# ---------------------------------------------------------------------------------------------
# the budget


def test_stages_parse_in_order_and_name_the_draws():
    assert [s.name for s in stages.parse_stages("first")] == ["smoke", "speed6", "cells18"]
    assert [s.name for s in stages.parse_stages("second")] == ["speed-deep", "compile", "profile", "cells6"]
    assert [s.name for s in stages.parse_stages("cells18,smoke,cells18")] == ["cells18", "smoke"]
    with pytest.raises(ValueError, match="unknown bogus"):
        stages.parse_stages("smoke,bogus")
    with pytest.raises(ValueError, match="at most 4"):
        stages.parse_stages("first,second")  # 7 result files and the session's 3: more than a command returns


def test_each_stage_gets_its_share_and_leaves_the_later_ones_theirs():
    smoke, speed, cells18 = stages.parse_stages("first")
    b = stages.Budget(t0=0.0, minutes=9.5)
    # a timed stage: its minutes x SLACK, unless the later stages' minutes would not fit after it
    assert b.deadline(smoke, [speed, cells18], now=0.0) == pytest.approx(60 * stages.SLACK * smoke.minutes)
    assert b.deadline(speed, [cells18], now=300.0) == pytest.approx(570 - 60 * cells18.minutes)
    # the greedy stage takes the rest; with too little left, a stage is skipped
    assert b.deadline(cells18, [], now=400.0) == 570.0
    assert b.deadline(cells18, [], now=500.0) is None
    assert b.deadline(smoke, [speed, cells18], now=300.0) is None


def test_speed_stage_commands_leave_time_for_the_loss_check(tmp_path):
    opts = argparse.Namespace(device="cuda", quick=False, carry=tmp_path / "carry", smoke_only="")
    speed = stages.STAGES["speed6"]
    import time

    cmd = stages.script_command(speed, opts, tmp_path, deadline=time.time() + 240)
    soft = float(cmd[cmd.index("--deadline-min") + 1])
    assert 2.6 < soft < 2.8  # 240 s less the 75 s the loss check needs after the rounds
    assert cmd[cmd.index("--layers") + 1] == "6" and "--no-compile" in cmd
    assert cmd[cmd.index("--json") + 1] == str(tmp_path / "gpu-6l.json")
    deep = stages.script_command(stages.STAGES["speed-deep"], opts, tmp_path, deadline=time.time() + 200)
    assert deep[deep.index("--layers") + 1 : deep.index("--layers") + 3] == ["18", "36"]
    assert "--compile-only" in stages.script_command(stages.STAGES["compile"], opts, tmp_path, time.time() + 200)


def test_plan_covers_every_stage_and_the_widths():
    text = plan(stages.parse_stages("first"), stages.Budget(0.0, 9.5), 68, 9, None)
    for name in ("smoke", "speed6", "cells18", "d 128", "d 256", "d 512", "<- default", "ESTIMATE"):
        assert name in text
    epochs = [int(line.split()[-3 if "default" in line else -1]) for line in text.splitlines() if "heads" in line
              and line.strip().startswith("d ")]  # fmt: skip
    assert len(epochs) == 3 and epochs[0] >= epochs[1] >= epochs[2] >= 1
    second = plan(stages.parse_stages("second"), stages.Budget(0.0, 9.5), 68, 9, None)
    assert "cells6" in second and "compile" in second


# ---------------------------------------------------------------------------------------------
# the packed cells' records


def _log_line(tag: str, rec: dict) -> str:
    return f"2026-11-28 05:00:00 | INFO | {tag} | {json.dumps(rec)}"


def test_epoch_curve_reads_dev_loss_bleu_and_wall_per_epoch():
    text = "\n".join([
        _log_line("valid", {"epoch": 1, "valid_loss": "9.5", "valid_nll_loss": "9.1", "valid_bleu": "0.4",
                            "valid_num_updates": "100"}),
        _log_line("train", {"epoch": 1, "train_loss": "10.2", "train_wall": "31"}),
        _log_line("valid", {"epoch": 2, "valid_loss": "8.0", "valid_nll_loss": "7.6", "valid_num_updates": "200"}),
    ])  # fmt: skip
    curve = cells.epoch_curve(text)
    assert curve[0] == {"epoch": 1, "dev_loss": 9.5, "dev_nll": 9.1, "dev_bleu": 0.4, "updates": 100,
                        "train_wall_s": 31.0}  # fmt: skip
    assert curve[1]["dev_bleu"] is None and curve[1]["train_wall_s"] is None


def test_labels_say_what_a_result_is():
    assert cells.label(5, 3.24, 9, "cut") == "5 epochs in 3.2 minutes, packed 9 at a time, cut at the deadline"
    assert cells.label(1, 1.0, 2, "converged").endswith("packed 2 at a time, converged (dev-loss patience)")
    recs = [{"epochs": 4, "minutes": 3.0, "status": "cut", "method": "postln"},
            {"epochs": 6, "minutes": 3.1, "status": "converged", "method": "preln"}]  # fmt: skip
    assert cells.summary(recs, 9) == (
        "2 cells, 4-6 epochs in 3.1 minutes, packed 9 at a time; converged (dev-loss patience): preln"
    )


def test_a_cut_cell_never_replaces_one_that_ended_by_itself():
    base = {k: 0 for k in rp.REQUIRED}
    converged = {**base, "cell": "preln:18:paper:s1", "status": "converged", "date": "2026-01-01"}
    cut = {**converged, "status": "cut", "date": "2026-02-01"}
    assert rp.merge({}, [converged, cut])["preln:18:paper:s1"]["status"] == "converged"
    assert rp.merge({}, [cut, {**converged, "date": "2026-03-01"}])["preln:18:paper:s1"]["status"] == "converged"
    assert rp.merge({}, [cut])["preln:18:paper:s1"]["status"] == "cut"


def test_drop_metrics_makes_an_eval_bleu_checkpoint_loadable_weights_only(tmp_path):
    """fairseq's --eval-bleu keeps numpy arrays in the checkpoint's metrics; without them the file loads
    with torch's weights-only unpickler and the plugin's allow-list (argparse.Namespace) only."""
    import numpy as np
    import torch

    ckpt = tmp_path / "checkpoint_best.pt"
    metrics = {"valid": {"_bleu_counts": np.array([3, 2, 1, 0])}}
    state = {"args": argparse.Namespace(a=1), "model": {"w": torch.ones(2)},
             "extra_state": {"metrics": metrics, "val_loss": 1.5}}  # fmt: skip
    torch.save(state, ckpt)
    assert any("numpy" in g for g in torch.serialization.get_unsafe_globals_in_checkpoint(str(ckpt)))
    cells.drop_metrics(ckpt)
    # nothing but argparse.Namespace (listed unless this process allow-lists it already: the plugin does)
    assert set(torch.serialization.get_unsafe_globals_in_checkpoint(str(ckpt))) <= {"argparse.Namespace"}
    before = set(torch.serialization.get_safe_globals())
    with torch.serialization.safe_globals([g for g in [argparse.Namespace] if g not in before]):
        loaded = torch.load(ckpt, weights_only=True)
    assert set(torch.serialization.get_safe_globals()) == before  # the process's allow-list as it was
    assert loaded["extra_state"] == {"val_loss": 1.5} and torch.equal(loaded["model"]["w"], torch.ones(2))


# ---------------------------------------------------------------------------------------------
# what comes back


def test_mirror_copies_only_complete_json_and_extras_stay_under_the_limit(tmp_path, monkeypatch):
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    (work / "smoke").mkdir(parents=True)
    src = work / "smoke" / "smoke.json"
    m = driver.Mirror(out)
    m.add(src, "smoke.json")
    src.write_text('{"rows": [')  # caught mid-write
    m.sync()
    assert not (out / "smoke.json").exists()
    src.write_text('{"rows": []}')
    m.sync()
    assert json.loads((out / "smoke.json").read_text()) == {"rows": []} and not list(out.glob(".*"))
    (work / "smoke" / "smoke.md").write_text("table\n")
    (work / "smoke" / "big.bin").write_bytes(bytes(range(256)) * 4000)
    stage = stages.Stage("smoke", "", 1, 1, "smoke.json", ("smoke.md", "big.bin"))
    monkeypatch.setattr(driver, "EXTRAS_LIMIT", 4000)
    dropped = driver.build_extras(work, [stage], tmp_path / "extras.tar.gz")
    assert dropped == ["smoke/big.bin"]
    import tarfile

    assert tarfile.open(tmp_path / "extras.tar.gz").getnames() == ["smoke/smoke.md"]


# ---------------------------------------------------------------------------------------------
# the rehearsal: the whole session on the CPU, then its files pasted into a copy of the docs


@pytest.fixture(scope="module")
def carry(tmp_path_factory) -> Path:
    """The rehearsal's data (``prepare``, its CPU part) from the first lines of Multi30k."""
    from deepinit_tools.session import data

    root = tmp_path_factory.mktemp("session-data")
    sizes = {"train": 300, "val": 40, "test_2016_flickr": 20, "test_2017_flickr": 20}
    raw = write_multi30k_gz(root / "raw", sizes)
    data.prepare(root / "carry", raw, work=root / "full", merges=300, device=False)
    return root / "carry"


@pytest.mark.slow
def test_quick_session_returns_every_file_and_pastes_into_the_docs(carry, tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, str(SESSION), "--device", "cpu", "--quick", "--budget-min", "4", "--out-dir", str(out),
           "--work-dir", str(work), "--carry", str(carry), "--smoke-only", "stock", "--methods", "preln",
           "--decode-s", "60"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["cells-18l.json", "extras.tar.gz", "gpu-6l.json", "session.json", "session.log", "smoke.json"]
    assert len(names) <= driver.MAX_FILES and all(p.is_file() for p in out.iterdir())
    session = json.loads((out / "session.json").read_text())
    assert session["finished"] and [r["name"] for r in session["stages"]] == ["smoke", "speed6", "cells18"]
    assert all(r["status"] == "ok" for r in session["stages"]), session["stages"]
    assert session["stages"][-1]["deadline_s"] <= 4 * 60
    smoke = json.loads((out / "smoke.json").read_text())
    assert smoke["passed"] == 2 and smoke["finished"]
    assert json.loads((out / "gpu-6l.json").read_text())["rows"]
    pack = json.loads((out / "cells-18l.json").read_text())
    (cell,) = pack["cells"]
    # 300 training pairs: the cell may stop by patience (then converge's status rules judge it) or be cut
    assert cell["cell"] == "preln:2:paper:s1"
    assert cell["status"] in ("cut", "converged", "capped", "stalled", "source-blind"), cell["status"]
    assert re.fullmatch(r"\d+ epochs? in [\d.]+ minutes, packed 1 at a time(, cut at the deadline|, converged "
                        r"\(dev-loss patience\))?", cell["label"])  # fmt: skip
    assert cell["dev_curve"] and all(e["dev_bleu"] is not None for e in cell["dev_curve"])
    assert cell["test2016_bleu"] is not None and cell["test2017_bleu"] is not None
    assert "--eval-bleu" in cell["command"] and "--no-save-optimizer-state" in cell["command"]
    # the paste: refused as a CPU result, then into a copy of the docs with --allow-cpu
    docs = tmp_path / "docs"
    for name in ("benchmarks.md", "results.md"):
        (docs / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "docs" / name, docs / name)
    paste = [sys.executable, str(SESSION), "paste", str(out), "--docs-dir", str(docs)]
    refused = subprocess.run(paste, capture_output=True, text=True, cwd=REPO)
    assert refused.returncode == 1 and "ran on the CPU" in refused.stderr and len(refused.stderr.splitlines()) == 1
    pasted = subprocess.run([*paste, "--allow-cpu"], capture_output=True, text=True, cwd=REPO)
    assert pasted.returncode == 0, pasted.stderr
    gpu = json.loads((docs / "benchmarks" / "gpu.json").read_text())
    assert set(gpu) == {"smoke", "matrix", "sessions"} and "gpu-6l" in gpu["matrix"]
    converged = json.loads((docs / "results" / "converged.json").read_text())
    assert [c["cell"] for c in converged] == ["preln:2:paper:s1"] and converged[0]["dev_curve"]
    bench, results = (docs / "benchmarks.md").read_text(), (docs / "results.md").read_text()
    assert "**CUDA smoke test**: 2 of 2 passed" in bench and "**Speed rows, `gpu-6l.json`**" in bench
    assert cell["label"] in results and "dev loss / greedy dev BLEU per epoch" in results
