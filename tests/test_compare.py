"""``deepinit-compare`` (fairseq_deepinit/compare, docs/compare.md): the ranking, the statuses read from
fairseq-train logs, the resume rules, the user's arguments and the commands built from them, the one-line
refusals, and a 2-method comparison end to end on the first lines of the real Multi30k."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MULTI30K, preprocess, read_multi30k
from fairseq_deepinit.compare import candidates as cands
from fairseq_deepinit.compare import cli, command, report, runner
from fairseq_deepinit.compare.verdict import gnorm_at, parse_log


def valid_line(update: int, loss: float, nll: float) -> str:
    rec = {"epoch": 1, "valid_loss": str(loss), "valid_nll_loss": str(nll), "valid_num_updates": str(update)}
    return f"2026-12-02 10:00:00 | INFO | valid | {json.dumps(rec)}"


def train_line(update: int, loss: float = 9.0, ups: float = 2.0, **extra: float) -> str:
    rec = {"epoch": 1, "loss": str(loss), "num_updates": str(update), "ups": str(ups), **extra}
    return f"2026-12-02 10:00:00 | INFO | train_inner | {json.dumps(rec)}"


def fake_translation_bin(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in ("dict.de.txt", "dict.en.txt", "train.de-en.de.idx", "train.de-en.en.idx"):
        (root / name).write_text("")
    return root


def setting(tmp_path: Path, argv=("--lr", "0.002", "--max-update", "40000", "--cpu")) -> command.Setting:
    data = fake_translation_bin(tmp_path / "bin")
    user, task = command.check_user_args(list(argv), lambda t, s, g: cands.detect_task(data, t, s, g))
    return command.Setting(data, 18, 150, 25, "iwslt_de_en", task, user, tmp_path / "out")


def rec(method: str, status: str, valid, finished: bool = True) -> dict:
    return {"method": method, "status": status, "valid": valid, "finished": finished}


# ---------------------------------------------------------------------------------------------
# ranking


def test_ranking_puts_diverged_and_failed_last_and_compares_losses_at_equal_updates():
    records = [
        rec("failed", "failed", []),
        rec("div", "diverged", [[25, 8.0, 7.9], [50, math.nan, math.nan]]),
        rec("slow", "ok", [[25, 8.0, 7.9], [50, 7.0, 6.9], [75, 6.0, 5.9]]),
        # stopped by the budget at update 50: everyone is compared at update 50
        rec("fast", "ok", [[25, 7.5, 7.4], [50, 6.5, 6.4]], finished=False),
        rec("stall", "stalled", [[25, 8.1, 8.0], [50, 8.05, 7.95], [75, 8.0, 7.9]]),
    ]
    ranked = report.rank(records)
    assert [r["method"] for r in ranked] == ["fast", "slow", "stall", "div", "failed"]
    assert ranked[0]["horizon"] == 50
    assert [r["loss_at_horizon"] for r in ranked] == [6.5, 7.0, 8.05, 8.0, None]
    assert [r["rank"] for r in ranked] == [1, 2, 3, 4, 5]


def test_a_candidate_without_validation_ranks_last_of_its_group():
    ranked = report.rank([rec("none", "stalled", []), rec("a", "ok", [[10, 9.0, 8.0]])])
    assert [r["method"] for r in ranked] == ["a", "none"]


# ---------------------------------------------------------------------------------------------
# statuses and records from logs


@pytest.mark.parametrize(
    "lines, rc, status, reason",
    [
        ([train_line(1), valid_line(25, 8.0, 7.0), valid_line(50, 6.0, 5.0)], 0, "ok", ""),
        ([train_line(1), valid_line(25, 9.0, 8.5), valid_line(50, 8.8, 8.2)], 0, "stalled", "never below"),
        ([valid_line(25, 8.0, 7.0), valid_line(50, 7.0, 6.0), valid_line(100, 7.0, 5.95)], 0, "stalled", "0.1 bits"),
        (
            [valid_line(25, 8.0, 7.0), "fairseq-deepinit: error: divergence guard: training stopped at update 31"],
            1,
            "diverged",
            "divergence guard: training stopped at update 31",
        ),
        ([valid_line(25, 8.0, 7.0), valid_line(50, math.nan, math.nan)], 0, "diverged", "non-finite validation"),
        (["fairseq-deepinit: error: --optimizer adam: use adam_foreach"], 1, "failed", "use adam_foreach"),
        (["FloatingPointError: Minimum loss scale reached (0.0001)."], 1, "diverged", "Minimum loss scale"),
        (["Traceback ...", "RuntimeError: out of memory"], 1, "failed", "RuntimeError: out of memory"),
    ],
)
def test_record_reads_status_and_reason_from_the_log(tmp_path, lines, rc, status, reason):
    s = setting(tmp_path)
    (s.out / "preln").mkdir(parents=True)
    (s.out / "preln" / "train.log").write_text("\n".join(lines) + "\n")
    attempts = [{"wall_s": 10.0, "returncode": rc, "peak_rss_mib": 300.0, "resumed": False}]
    r = runner.record("preln", s, 7.9, attempts, finished=True)
    assert r["status"] == status
    assert reason in r["reason"] and (reason or not r["reason"])


def test_record_keeps_gradient_profiles_speed_memory_and_commands(tmp_path):
    s = setting(tmp_path)
    (s.out / "admin").mkdir(parents=True)
    g = {"diag_gnorm/encoder.layers.0": 0.5, "diag_gnorm/encoder.layers.1": 2.0}
    lines = [train_line(1, ups=0.0, **g), train_line(2, ups=3.0), train_line(25, ups=1.0, **g), valid_line(25, 8, 7)]
    lines += [train_line(26, ups=2.0, **{"diag_gnorm/encoder.layers.0": 0.1})]
    (s.out / "admin" / "train.log").write_text("\n".join(lines) + "\n")
    attempts = [
        {"wall_s": 5.0, "returncode": None, "peak_rss_mib": 300.0, "resumed": False},
        {"wall_s": 6.0, "returncode": 0, "peak_rss_mib": 350.5, "resumed": True},
    ]
    r = runner.record("admin", s, 7.9, attempts, finished=True)
    assert r["gnorm_init"] == {"update": 1, "encoder.layers.0": 0.5, "encoder.layers.1": 2.0}
    assert r["gnorm_early"]["update"] == 25 and r["gnorm_last"] == {"update": 26, "encoder.layers.0": 0.1}
    assert (r["updates"], r["updates_per_s"], r["peak_rss_mib"], r["wall_s"]) == (26, 2.0, 350.5, 11.0)
    assert "--task translation_admin" in r["command"] and "--max-update 150" in r["command"]
    assert "--max-update 40000" in r["continue_command"] and "--max-update 150" not in r["continue_command"]
    assert r["continue_command"].endswith(f"--save-dir {s.out / 'admin'}")
    assert report.gradient_line(r["gnorm_init"], "encoder") == "0.5 / 2 (4)"


def test_a_resumed_run_validates_its_restart_update_once():
    text = "\n".join([valid_line(25, 8.0, 7.0), valid_line(50, 7.5, 6.5), valid_line(50, 7.6, 6.6)])
    assert parse_log(text)["valid"] == [(25, 8.0, 7.0), (50, 7.5, 6.5)]
    assert gnorm_at([], 1) == {}


def test_a_finished_candidate_is_not_rerun(tmp_path, capsys):
    s = setting(tmp_path)
    (s.out / "postln").mkdir(parents=True)
    done = {"method": "postln", "status": "stalled"}
    (s.out / "postln" / "result.json").write_text(json.dumps(done))
    assert runner.train("postln", s, 7.9, deadline=None) == done  # starts no process (the fast tier refuses it)
    assert "not rerun" in capsys.readouterr().err


def test_past_the_budget_an_unfinished_candidate_is_reported_and_left_to_resume(tmp_path):
    s = setting(tmp_path)
    (s.out / "preln").mkdir(parents=True)
    (s.out / "preln" / "train.log").write_text(train_line(10) + "\n" + valid_line(10, 8.0, 7.0) + "\n")
    (s.out / "preln" / "attempts.json").write_text(json.dumps([{"wall_s": 5, "returncode": None}]))
    r = runner.train("preln", s, 7.9, deadline=0.0)
    assert (r["finished"], r["updates"]) == (False, 10)
    assert not (s.out / "preln" / "result.json").exists()


def test_progress_line():
    text = "\n".join([train_line(10, 8.5, 1.5), valid_line(10, 8.0, 7.25), train_line(12, 8.25, 1.25)])
    assert (
        runner.progress_line("hc", text, 150) == "hc: update 12/150, train loss 8.25, valid nll 7.250 @10, 1.25 upd/s"
    )
    assert runner.progress_line("hc", "starting", 150) is None


# ---------------------------------------------------------------------------------------------
# the user's arguments, the task, the commands


def test_user_arguments_keep_everything_but_the_comparisons_own(tmp_path):
    argv = ["--lr=0.002", "--max-update", "40000", "--log-interval", "100", "--criterion", "cross_entropy", "--cpu"]
    data = fake_translation_bin(tmp_path / "bin")
    user, task = command.check_user_args(argv, lambda t, s, g: cands.detect_task(data, t, s, g))
    assert user.base == ("--lr", "0.002", "--cpu") and user.cpu
    assert user.full == ("--max-update", "40000", "--log-interval", "100")
    assert user.criterion == "cross_entropy_diagnostics"
    assert (task.kind, task.source, task.target) == ("translation", "de", "en")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--arch", "preln_iwslt_de_en"], "drop --arch"),
        (["--encoder-layers", "6"], "--depth"),
        (["--no-divergence-guard"], "divergence guard"),
        (["--criterion", "nat_loss"], "--criterion nat_loss"),
        (["--task", "speech_to_text"], "--task speech_to_text"),
    ],
)
def test_refused_user_arguments(tmp_path, argv, says):
    data = fake_translation_bin(tmp_path / "bin")
    with pytest.raises(cands.DeepInitConfigError, match=says):
        command.check_user_args(argv, lambda t, s, g: cands.detect_task(data, t, s, g))


def test_the_task_comes_from_the_data_bin(tmp_path):
    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "dict.txt").write_text("")
    assert cands.detect_task(lm, None, None, None).kind == "language_modeling"
    two = fake_translation_bin(tmp_path / "two")
    (two / "train.en-de.en.idx").write_text("")
    with pytest.raises(cands.DeepInitConfigError, match="--source-lang"):
        cands.detect_task(two, None, None, None)
    assert cands.detect_task(two, None, "en", "de").target == "de"
    with pytest.raises(cands.DeepInitConfigError, match="neither dict.txt"):
        cands.detect_task(tmp_path, None, None, None)


def test_language_model_commands_set_one_stack_and_the_admin_lm_task(tmp_path):
    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "dict.txt").write_text("")
    user, task = command.check_user_args(["--cpu"], lambda t, s, g: cands.detect_task(lm, t, s, g))
    s = command.Setting(lm, 24, 100, 10, "lm_tiny", task, user, tmp_path / "out")
    admin = command.train_command("admin", s)
    assert ["--arch", "admin_lm_tiny", "--task", "language_modeling_admin"] == admin[admin.index("--arch") :][:4]
    assert "--encoder-layers" not in admin and admin[admin.index("--decoder-layers") + 1] == "24"
    preln = command.train_command("preln", s)
    assert preln[preln.index("--task") + 1] == "language_modeling"
    assert preln[preln.index("--criterion") + 1] == "cross_entropy_diagnostics"


def test_a_candidates_task_is_the_one_its_records_require(monkeypatch):
    """Admin trains under its profiling task because its record says so; closed-form omega under the user's."""
    import dataclasses

    from fairseq_deepinit import methods
    from fairseq_deepinit.family_args import family_spec

    mt, lm = cands.Task(cands.TRANSLATION, "de", "en"), cands.Task(cands.LM, None, None)
    assert cands.required_task("admin", mt, "iwslt_de_en") == "translation_admin"
    assert cands.required_task("admin", lm, "lm_tiny") == "language_modeling_admin"
    assert cands.required_task("admin_closed", mt, "iwslt_de_en") is None
    assert cands.required_task("preln", mt, "iwslt_de_en") is None
    closed = cands.Candidate("Admin", "admin", ("--admin-formula", "closed-form"))
    monkeypatch.setitem(cands.CANDIDATES, "admin", closed)
    assert cands.required_task("admin", mt, "iwslt_de_en") is None
    # two records that require different tasks: one line
    other = dataclasses.replace(methods.METHODS["z_loss"], training_task=lambda p, spec: "translation_deepinit")
    monkeypatch.setitem(methods.METHODS, "z_loss", other)
    with pytest.raises(cands.DeepInitConfigError, match="translation_admin, translation_deepinit"):
        methods.training_task(family_spec("admin", ("--z-loss",)))


def test_bad_input_is_one_line_and_status_1(tmp_path, capsys):
    data = fake_translation_bin(tmp_path / "bin")
    out = tmp_path / "out"
    cases = {
        "not found": [str(tmp_path / "missing"), "--depth", "6", "--out", str(out)],
        "unknown method 'postnorm' in --methods; choose from postln, preln, admin,": [
            str(data),
            "--depth",
            "6",
            "--methods",
            "postnorm",
            "--out",
            str(out),
        ],
        "--depth 0": [str(data), "--depth", "0", "--out", str(out)],
        "--valid-every 200": [str(data), "--depth", "6", "--valid-every", "200", "--out", str(out)],
        "drop --arch": [str(data), "--depth", "6", "--out", str(out), "--", "--arch", "x"],
    }
    for says, argv in cases.items():
        assert cli.main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("deepinit-compare: error: ") and says in err[0], (says, err)
    out.mkdir()
    config = cli.configuration(cli.build_parser().parse_args([str(data), "--depth", "12", "--out", str(out)]),
                               [], cands.detect_task(data, None, None, None), "iwslt_de_en")  # fmt: skip
    config["valid_every"] = 2
    (out / cli.CONFIG).write_text(json.dumps(config))
    assert cli.main([str(data), "--depth", "6", "--out", str(out), "--", "--cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another depth, valid_every, fairseq_args" in err[0], err


# ---------------------------------------------------------------------------------------------
# end to end


def tiny_multi30k_bin(root: Path) -> Path:
    if not (MULTI30K / "train.de.gz").exists():
        pytest.skip(f"Multi30k not found at {MULTI30K} (set MULTI30K_DIR)")
    raw = root / "raw"
    raw.mkdir(parents=True)
    for split, out, n in (("train", "train", 400), ("val", "valid", 40)):
        for lang in ("de", "en"):
            (raw / f"{out}.{lang}").write_text("\n".join(read_multi30k(split, lang, n)) + "\n", encoding="utf-8")
    return preprocess(raw, root / "bin", "de", "en", test=False, extra=("--thresholdtgt", "2", "--thresholdsrc", "2"))


def unigram_by_hand(raw: Path, bin_dir: Path) -> float:
    """The stall threshold from the raw text: train counts of the dictionary's words, unknown words
    counted once, one end of sentence per line (an independent count of fairseq_deepinit.compare.unigram)."""
    known = {line.split()[0] for line in (bin_dir / "dict.en.txt").read_text().splitlines()}
    counts: dict = {}
    train = (raw / "train.en").read_text().splitlines()
    for line in train:
        for w in line.split():
            if w in known:
                counts[w] = counts.get(w, 0) + 1
    counts["</s>"] = len(train)
    total = sum(counts.values())
    toks = [t for line in (raw / "valid.en").read_text().splitlines() for t in [*line.split(), "</s>"]]
    return -sum(math.log2(counts.get(t, 1) / total) for t in toks) / len(toks)


@pytest.mark.slow
def test_two_methods_end_to_end_then_resumed(tmp_path):
    data = tiny_multi30k_bin(tmp_path)
    out = tmp_path / "cmp"
    exe = Path(sys.executable).parent / "deepinit-compare"
    argv = [str(exe), str(data), "--depth", "2", "--methods", "postln,preln", "--max-update", "6"]
    argv += ["--valid-every", "3", "--threads", "1", "--out", str(out), "--"]
    argv += ["--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64"]
    argv += ["--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
    argv += ["--optimizer", "adam", "--lr", "0.002", "--lr-scheduler", "tfixup", "--max-tokens", "1024"]
    argv += ["--cpu", "--num-workers", "0", "--max-update", "500"]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [m["rank"] for m in summary["methods"]] == [1, 2]
    assert {m["method"] for m in summary["methods"]} == {"postln", "preln"}
    for m in summary["methods"]:
        assert m["status"] in ("ok", "stalled") and m["finished"] and m["updates"] == 6
        assert math.isfinite(m["best_valid_loss"]) and [v[0] for v in m["valid"]] == [3, 6]
        assert m["gnorm_init"]["update"] == 1 and len([k for k in m["gnorm_init"] if ".layers." in k]) == 4
        assert m["peak_rss_mib"] > 50 and m["updates_per_s"] > 0
        assert "--max-update 500" in m["continue_command"]
    losses = [m["loss_at_horizon"] for m in summary["methods"]]
    assert losses == sorted(losses)
    assert summary["stall_bits"] == pytest.approx(unigram_by_hand(tmp_path / "raw", data), abs=1e-4)
    text = (out / "report.md").read_text()
    assert all(m["continue_command"] in text for m in summary["methods"])
    assert (out / "valid_loss.png").stat().st_size > 1000 and (out / "grad_norm.png").stat().st_size > 1000
    assert "postln: training" in first.stderr and "#1 " in first.stderr

    again = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("finished before") == 2 and ": training" not in again.stderr
    assert json.loads((out / "summary.json").read_text())["methods"] == summary["methods"]
