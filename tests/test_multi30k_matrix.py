"""The Multi30k stability-matrix driver (``scripts/multi30k_matrix.py``, ``docs/results.md``):
log parsing, the converging/stalled/diverged/source-blind rules, the unigram threshold by hand, every cell's
fairseq command parsed with the plugin, and the whole pipeline (prepare, train, a forced divergence,
BLEU, report) on the first lines of the real Multi30k."""

from __future__ import annotations

import copy
import gzip
import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MULTI30K, REPO, read_multi30k

SCRIPT = REPO / "scripts" / "multi30k_matrix.py"
from deepinit_tools.matrix import cells, common, early_report  # noqa: E402


def valid_line(update: int, loss: float, nll: float) -> str:
    rec = {"epoch": 1, "valid_loss": str(loss), "valid_nll_loss": str(nll), "valid_num_updates": str(update)}
    return f"2026-11-23 04:30:00 | INFO | valid | {json.dumps(rec)}"


def train_line(update: int, loss: float, **extra: float) -> str:
    rec = {"epoch": 1, "loss": str(loss), "num_updates": str(update), "wps": "1000", "gnorm": "1.5", **extra}
    return f"2026-11-23 04:30:00 | INFO | train_inner | {json.dumps(rec)}"


def test_parse_log_reads_curves_layers_and_failures():
    text = "\n".join(
        [
            "2026-11-23 | INFO | fairseq_cli.train | model deepinit",
            train_line(10, 9.0, **{"diag_gnorm/encoder.layers.0": 0.5, "diag_gnorm/encoder.layers.1": 2.0}),
            valid_line(10, 8.5, 8.1),
            valid_line(10, 8.5, 8.1),  # fairseq validates again when an epoch ends on the interval
            train_line(20, 7.0),
            valid_line(20, 7.5, 7.2),
            "fairseq_deepinit.diagnostics.criterion.DivergenceError: divergence guard: training stopped at update 23",
        ]
    )
    parsed = cells.parse_log(text)
    assert parsed["valid"] == [(10, 8.5, 8.1), (20, 7.5, 7.2)]
    assert [int(r["num_updates"]) for r in parsed["train"]] == [10, 20]
    assert parsed["error"] == "divergence guard: training stopped at update 23"
    assert cells.gnorm_profile(parsed["train"]) == {"update": 10, "encoder.layers.0": 0.5, "encoder.layers.1": 2.0}
    assert "top/bottom 4" in early_report._layer_summary(cells.gnorm_profile(parsed["train"]))


@pytest.mark.parametrize(
    "valid, error, rc, status, best, reached",
    [
        ([(10, 8.0, 7.5), (20, 6.0, 5.5), (30, 5.0, 4.5)], None, 0, "converging", 4.5, 20),
        ([(10, 8.0, 7.0), (20, 7.0, 6.2), (40, 7.0, 6.15)], None, 0, "stalled", 6.15, None),  # plateau
        ([(10, 8.0, 7.5), (20, 7.9, 7.95)], None, 0, "stalled", 7.5, None),  # never below 7.5 bits
        ([(10, 8.0, 7.5), (20, float("nan"), float("nan"))], None, 0, "diverged", 7.5, None),
        ([(10, 8.0, 6.0)], "gradients are Nan/Inf", 1, "diverged", 6.0, None),
        ([(10, 8.0, 6.0)], None, 1, "failed", 6.0, None),
        ([], None, 0, "stalled", None, None),
    ],
)
def test_classify(valid, error, rc, status, best, reached):
    r = cells.classify({"valid": valid, "train": [], "error": error}, rc, stall_bits=7.5, target_bits=5.5)
    assert (r["status"], r["best_dev_nll"], r["updates_to_target"]) == (status, best, reached)


@pytest.mark.parametrize("distinct, status", [(49, "source-blind"), (50, "converging"), (1000, "converging")])
def test_a_model_with_the_same_translation_for_every_input_is_source_blind(distinct, status):
    parsed = {"valid": [(10, 8.0, 7.5), (20, 6.0, 5.5)], "train": [], "error": None}
    probe = {"distinct": distinct, "sentences": 1000, "bleu": 3.0}
    assert cells.classify(parsed, 0, 7.9, None, probe=probe)["status"] == status  # 5% of 1000 = 50


def test_unigram_bits_by_hand(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "dict.en.txt").write_text("a 6\nb 2\nmadeupword0000 0\n")
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "train.en").write_text("x\ny\n")  # 2 sentences: </s> counted twice
    (tmp_path / "valid.en").write_text("a b\n")
    # p(a) = 6/10, p(b) = 2/10, p(</s>) = 2/10 over the tokens a, b, </s>
    expected = -(math.log2(0.6) + math.log2(0.2) + math.log2(0.2)) / 3
    assert cells.unigram_bits(tmp_path / "bin", tmp_path / "valid.en") == pytest.approx(expected, rel=1e-12)


def test_specs_and_cell_names_refuse_bad_input():
    assert cells.budget_of("6:600:50,18:250:25", 18) == (250, 25)
    assert cells.target_of("6:5.0,18:6.5", 18) == 6.5 and cells.target_of("6:5.0", 36) is None
    with pytest.raises(common.MatrixError, match="no entry for depth 36"):
        cells.budget_of("6:600:50", 36)
    with pytest.raises(common.MatrixError, match="DEPTH:UPDATES:VALID_EVERY"):
        cells.budget_of("6:600", 6)
    with pytest.raises(common.MatrixError, match="DEPTH:BITS"):
        cells.target_of("six:5", 6)
    for bad, msg in (
        ("postln:6", "METHOD:DEPTH:REGIME"),
        ("bert:6:warmup", "unknown method"),
        ("postln:6:x", "regime"),
    ):
        with pytest.raises(common.MatrixError, match=msg):
            common.parse_cell(bad)


def test_select_for_bleu_takes_shallowest_and_deepest_converged():
    def r(m, d, reg, status, nll):
        return {"cell": f"{m}:{d}:{reg}", "method": m, "depth": d, "regime": reg, "status": status, "best_dev_nll": nll}

    cells = [
        r("postln", 6, "warmup", "converging", 5.0),
        r("postln", 6, "nowarmup", "converging", 4.8),
        r("postln", 18, "warmup", "diverged", 6.0),
        r("admin", 6, "warmup", "converging", 5.0),
        r("admin", 18, "warmup", "converging", 5.5),
        r("admin", 18, "nowarmup", "converging", 5.9),
        r("admin", 36, "nowarmup", "stalled", 7.9),
    ]
    assert early_report.select_for_bleu({c["cell"]: c for c in cells}) == [
        "postln:6:nowarmup",
        "admin:6:warmup",
        "admin:18:warmup",
    ]


def test_every_cell_parses_with_the_plugin(tmp_path):
    """``matrix --dry-run`` of the whole default matrix: every command is a fairseq-train command
    line that fairseq parses with the plugin and that passes the model's own validation."""
    from fairseq import options

    import fairseq_deepinit  # noqa: F401
    from fairseq_deepinit.options import resolve_and_validate

    out = subprocess.run(
        [sys.executable, str(SCRIPT), "matrix", "--dry-run", "--work-dir", str(tmp_path), "--depths", "6,18,36,100"],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout.splitlines()
    assert len(out) == len(common.METHODS) * 4 * 2
    for line in out:
        argv = shlex.split(line)
        assert argv[1:3] == ["-m", "fairseq_cli.train"] and "--bf16" not in argv
        args = options.parse_args_and_arch(options.get_training_parser(), argv[3:])
        resolve_and_validate(copy.deepcopy(args))
        depth = args.encoder_layers
        assert (
            args.decoder_layers == depth
            and args.max_update == cells.budget_of("6:600:50,18:250:25,36:150:25,100:40:20", depth)[0]
        )
        # depth-muP's per-group lr / eps multipliers are applied by adam_foreach only (fairseq's adam is refused);
        # a method that names its optimizer (Muon) gets it, with the set-up's betas for its AdamW part
        flags = common.METHODS[Path(args.save_dir).name.split("-")[0]][1]
        named = flags[flags.index("--optimizer") + 1] if "--optimizer" in flags else None
        assert args.optimizer == (named or ("adam_foreach" if getattr(args, "depth_mup", False) else "adam"))
        assert args.adam_betas == "(0.9, 0.98)"
        if "nowarmup" in args.save_dir:
            assert args.lr_scheduler == "tfixup" and args.lr == [2e-3]
        else:
            assert args.lr_scheduler == "inverse_sqrt" and args.warmup_updates == 100 and args.lr == [1e-3]


@pytest.fixture(scope="module")
def tiny_multi30k(tmp_path_factory) -> Path:
    """The first lines of every Multi30k split, gzip, in Multi30k's own file names."""
    if not (MULTI30K / "train.de.gz").exists():
        pytest.skip(f"Multi30k not found at {MULTI30K} (set MULTI30K_DIR)")
    root = tmp_path_factory.mktemp("m30k")
    sizes = {"train": 400, "val": 40, "test_2016_flickr": 24, "test_2017_flickr": 20}
    for split, n in sizes.items():
        for lang in ("de", "en"):
            with gzip.open(root / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("\n".join(read_multi30k(split, lang, n)) + "\n")
    return root


def driver(*args: str, m30k: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "MULTI30K_DIR": str(m30k), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert not check or proc.returncode == 0, proc.stdout[-3000:]
    return proc


def test_pipeline_on_real_multi30k_lines(tiny_multi30k, tmp_path):
    """prepare -> one converging cell and one with a NaN injected at update 4 -> BLEU -> report."""
    common = ["--work-dir", str(tmp_path), "--bpe-merges", "300", "--budget", "2:6:3", "--dim", "32", "--ffn", "64"]
    common += ["--heads", "2", "--max-tokens", "1024", "--target-bits", "2:100"]
    # thresholds a 6-update model passes (the rules themselves are tested above)
    common += ["--stall-bits", "100", "--plateau-bits", "-100", "--blind-fraction", "0"]
    trained = driver("matrix", "--cells", "postln:2:warmup", *common, m30k=tiny_multi30k).stdout
    assert "[postln-2-warmup dev-greedy] 40/40 sentences (100%)" in trained  # the probe's progress
    driver(
        "matrix", "--cells", "postln:2:nowarmup", *common, "--extra-args",
        "--diagnostics-inject-nan 4:encoder.layers.0.fc1.weight", m30k=tiny_multi30k,
    )  # fmt: skip
    for split, n in (("train", 400), ("valid", 40), ("test", 24), ("test1", 20)):
        assert len((tmp_path / "raw" / f"{split}.en").read_text().splitlines()) == n
    ok = json.loads((tmp_path / "runs" / "postln-2-warmup" / "result.json").read_text())
    assert ok["returncode"] == 0 and ok["settings"]["updates"] == 6
    probe = json.loads((tmp_path / "runs" / "postln-2-warmup" / "probe.json").read_text())
    assert probe["sentences"] == 40 and 1 <= probe["distinct"] <= 40 and probe["bleu"] >= 0
    assert (
        ok["command"].startswith("fairseq-train ")
        and "--max-update 6" in ok["command"]
        and "--encoder-layers 2" in ok["command"]
    )

    bleu = driver("bleu", "--cells", "select", *common, "--beam", "2", m30k=tiny_multi30k).stdout
    assert "postln:2:warmup" in bleu and "postln:2:nowarmup" not in bleu  # only converged cells are translated
    assert "[postln-2-warmup test2017] 20/20 sentences (100%)" in bleu  # progress while translating
    gen = (tmp_path / "runs" / "postln-2-warmup" / "generate-test2017.txt").read_text()
    assert sum(line.startswith("D-") for line in gen.splitlines()) == 20  # every test2017 sentence

    text = driver("report", *common, m30k=tiny_multi30k).stdout
    lines = text.splitlines()
    row = next(ln for ln in lines if ln.startswith("| Post-LN |"))
    cells = [c.strip() for c in row.split("|")[2:4]]
    assert cells[0].startswith("ok ") and "@3" in cells[0]  # target 100 bits: reached at the first validation
    assert cells[1].startswith("**diverged** at 3")  # the last logged update before the NaN at update 4
    assert (
        "| Post-LN | 2 | warmup | converging | " in text
        and "Dev BLEU of each cell" in text
        and "sacreBLEU signature: `nrefs:1|case:mixed|eff:no|tok:13a" in text
    )
    failing = next(ln for ln in lines if ln.startswith("- `postln:2:nowarmup` (diverged)"))
    assert "update 4" in failing and "encoder.layers.0" in failing


def test_report_replaces_only_its_block(tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text(f"intro\n{early_report.BEGIN}\nold table\n{early_report.END}\nclaims\n")
    early_report.write_between_markers(doc, "new table\n")
    assert doc.read_text() == f"intro\n{early_report.BEGIN}\nnew table\n{early_report.END}\nclaims\n"
    doc.write_text("no markers\n")
    with pytest.raises(common.MatrixError, match="needs exactly one"):
        early_report.write_between_markers(doc, "x\n")
    assert doc.read_text() == "no markers\n"  # nothing lost


def test_missing_data_says_what_to_do(tmp_path):
    proc = driver("prepare", "--work-dir", str(tmp_path), m30k=tmp_path / "nowhere", check=False)
    assert proc.returncode == 1 and "has no train.de.gz" in proc.stdout and "Traceback" not in proc.stdout
    proc = driver("report", "--work-dir", str(tmp_path), m30k=tmp_path, check=False)
    assert proc.returncode == 1 and "run `matrix` first" in proc.stdout
