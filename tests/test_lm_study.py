"""scripts/lm_depth_study.py without the network: corpus reading from a tiny synthetic Bible database,
the split, the log parser and the report table."""

from __future__ import annotations

import argparse
import sqlite3
from pathlib import Path

from deepinit_tools import lm_depth_study as study  # noqa: E402


def _db(path, rows):
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE bible (id INTEGER, bbName TEXT, bNumber INT, cNumber INT, vNumber INT, vText TEXT)")
    con.executemany("INSERT INTO bible VALUES (?, ?, ?, ?, ?, ?)", rows)
    con.commit()
    con.close()
    return path


def test_english_verses_in_canonical_order_with_punctuation_split(tmp_path):
    rows = [
        (1, "k", 1, 1, 2, "And God said, Let there be light:"),
        (2, "k", 1, 1, 1, "In the beginning God created the heaven."),
        (3, "s", 1, 1, 1, "Im Anfang schuf Gott"),
        (4, "k", 1, 2, 1, "  "),
    ]
    verses = study.english_verses(_db(tmp_path / "b.db", rows))
    assert verses == ["In the beginning God created the heaven .", "And God said , Let there be light :"]


def test_split_is_prepare_bibles():
    parts = study.split_verses([f"v{i}" for i in range(200)])
    assert parts["test"] == ["v0", "v50", "v100", "v150"] and parts["valid"] == ["v25", "v125"]
    assert len(parts["train"]) == 194


GRADS = "diag_gnorm/decoder.layers.0=0.5, diag_gnorm/decoder.layers.1=0.25"
LOG = f"""\
2026-01-01 | INFO | train_inner | epoch 001:     25 / 9 loss=9.5, ppl=700, num_updates=25, {GRADS}, wall=3
2026-01-01 | INFO | train_inner | epoch 001:     50 / 9 loss=8.25, ppl=300, num_updates=50, wall=5
2026-01-01 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 8.1 | ppl 274 | num_updates 50
"""


def test_parse_train_log_and_report(tmp_path):
    r = study.parse_train_log(LOG)
    assert r["curve"] == [(25, 9.5), (50, 8.25)] and r["updates"] == 50 and r["valid_loss"] == 8.1
    assert r["grad_norms"] == {25: {"decoder.layers.0": 0.5, "decoder.layers.1": 0.25}} and not r["diverged"]
    assert study.parse_train_log(LOG + "divergence guard: training stopped at update 7")["diverged"]
    results = [{**r, "scheme": "postln", "depth": 6, "train_rc": 0, "seconds": 12.0, "test_ppl": 123.45}]
    results.append(
        {**r, "scheme": "preln", "depth": 6, "train_rc": 1, "seconds": 3.0, "test_ppl": None, "diverged": True}
    )
    table = study.report(results, tmp_path, argparse.Namespace(name="lm_depth")).read_text()
    assert "| postln | 123.5 | not run | not run |" in table and "| preln | diverged |" in table
    assert "| twt |" not in table  # a scheme without a cell in the work folder has no row
    assert (tmp_path / "lm_depth_6l.png").exists()


def _argv(scheme):
    a = study.build_parser().parse_args(["run"])
    return study.train_command(Path("data-bin"), scheme, 48, Path("ckpt"), a)


def test_depth_mup_schemes_replace_the_studys_adam():
    for scheme in ("completep", "depth_mup"):
        cmd = _argv(scheme)
        assert cmd.count("--optimizer") == 1 and cmd.count("adam_foreach") == 1 and "adam" not in cmd
        assert cmd[cmd.index("--optimizer") + 1] == "adam_foreach"
        assert cmd[cmd.index("--adam-betas") + 1] == "(0.9, 0.98)"
    cmd = _argv("preln")
    assert cmd.count("--optimizer") == 1 and cmd[cmd.index("--optimizer") + 1] == "adam"


def test_every_scheme_is_a_registered_architecture_and_task():
    from fairseq.models import ARCH_MODEL_REGISTRY
    from fairseq.optim import OPTIMIZER_REGISTRY
    from fairseq.tasks import TASK_REGISTRY

    import fairseq_deepinit  # noqa: F401  (registers the plugin's architectures, tasks and optimizers)

    for scheme in study.SCHEMES:
        cmd = _argv(scheme)
        assert cmd[cmd.index("--arch") + 1] in ARCH_MODEL_REGISTRY, scheme
        assert cmd[cmd.index("--task") + 1] in TASK_REGISTRY, scheme
        assert cmd[cmd.index("--optimizer") + 1] in OPTIMIZER_REGISTRY, scheme
