"""benchmarks/quickstart_precision.py: fp32 and bf16 autocast side by side on a tiny de-en corpus.

No timing is asserted (the script prints the ratio); checked: both precisions ran the same number of
updates from the same seed, their losses are finite and close (bf16 autocast keeps fp32 weights), and the
printed table is the JSON's.
"""

from __future__ import annotations

import json
import math

import pytest

from conftest import REPO, preprocess, run_script, write_synthetic_corpus
from deepinit_tools.bench import quickstart_precision as qp

pytestmark = pytest.mark.slow  # fairseq-train runs


@pytest.fixture(scope="module")
def de_en_bin(tmp_path_factory):
    """The synthetic corpus with the quickstart's language codes (de -> en), one joined dictionary."""
    root = tmp_path_factory.mktemp("qp")
    raw = write_synthetic_corpus(root / "raw", n_train=400, n_valid=40, n_test=10)
    for split in ("train", "valid", "test"):
        (raw / f"{split}.src").rename(raw / f"{split}.de")
        (raw / f"{split}.tgt").rename(raw / f"{split}.en")
    return preprocess(raw, root / "bin", "de", "en", extra=("--joined-dictionary",))


def test_both_precisions_train_the_same_updates(de_en_bin, tmp_path):
    out = tmp_path / "r.json"
    proc = run_script(
        REPO / "benchmarks" / "quickstart_precision.py", "--data", de_en_bin, "--updates", "4", "--log-interval", "2",
        "--repeats", "1", "--layers", "1", "--dim", "16", "--ffn", "32", "--heads", "2", "--max-tokens", "200",
        "--work", tmp_path / "logs", "--json", out, "--markdown", tmp_path / "r.md",
    )  # fmt: skip
    doc = json.loads(out.read_text())
    fp32, bf16 = doc["runs"]["fp32"][0], doc["runs"]["bf16"][0]
    for run in (fp32, bf16):
        assert run["ups"] > 0 and math.isfinite(run["train_loss"]) and math.isfinite(run["dev_loss"])
    assert abs(bf16["dev_loss"] - fp32["dev_loss"]) < 0.05 * fp32["dev_loss"]
    assert "--autocast-bf16" in (tmp_path / "logs" / "bf16.0.log").read_text()
    assert "--autocast-bf16" not in (tmp_path / "logs" / "fp32.0.log").read_text()
    table = (tmp_path / "r.md").read_text()
    assert f"| fp32 | {fp32['ups']:.2f} [{fp32['ups']:.2f}-{fp32['ups']:.2f}] | 1 |" in table
    assert doc["meta"]["command"] in proc.stdout and doc["cpu_bf16"] in table


def test_a_missing_corpus_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        qp.main(["--data", str(tmp_path / "none")])
    assert stop.value.code == 1
    assert capsys.readouterr().err.startswith("error: no binarised corpus in ")
