"""Checkpoints written by release 0.1.0 load and score as 0.1.0 scored them.

tests/fixtures/v010 holds tiny checkpoints that ``fairseq-train`` wrote with the 0.1.0 plugin
(tests/fixtures/make_v010.py says how), with what 0.1.0 computed from each: teacher-forced
log-probabilities on fixed test pairs and ``fairseq-generate``'s hypotheses. A later release may move
modules, rename internals or change option defaults (MAtt's W_v sharing did), but the options a
checkpoint stores must rebuild the same model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import fairseq_deepinit  # noqa: F401  (allow-lists the checkpoints' argparse.Namespace, registers the model)
from conftest import USER_DIR, run_cli

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "v010"
CASES = sorted(p.stem for p in FIXTURES.glob("*.pt"))

# The same float32 computation on another CPU kernel path (or with another reduction order) differs
# by round-off: ~1e-6 relative per layer for these d=16, 2+2-layer models, log-probabilities of
# magnitude <= ~10, so ~1e-5 absolute; 1e-4 leaves 10x margin, while any change in what the model
# computes (a norm, a scale, an unshared W_v) moves them by 1e-2 or more.
ATOL = 1e-4


def teacher_forced_logprobs(checkpoint: str | Path, data: str | Path, n: int) -> torch.Tensor:
    """Log-probabilities of the first ``n`` test pairs of ``data`` under ``checkpoint`` (eval mode,
    float32), as (n, T, V) with padding positions zeroed. Loads through fairseq's own loader."""
    from fairseq import checkpoint_utils

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data)}
    )
    model = models[0].eval().float()
    task.load_dataset("test")
    ds = task.dataset("test")
    samples = [ds[i] for i in range(n)]
    batch = ds.collater(samples)
    with torch.no_grad():
        out = model(**batch["net_input"])
        lp = model.get_normalized_probs(out, log_probs=True)
    pad = batch["target"].eq(task.target_dictionary.pad())
    return lp.masked_fill(pad.unsqueeze(-1), 0.0)


@pytest.fixture(scope="module")
def fixtures() -> dict:
    if not CASES:
        pytest.fail(f"no 0.1.0 fixtures in {FIXTURES}")
    return {name: json.loads((FIXTURES / f"{name}.json").read_text()) for name in CASES}


def test_fixtures_cover_the_families():
    assert set(CASES) == {"admin", "deepnorm", "dsinit_matt", "postln", "rezero", "tfixup", "twt"}


@pytest.mark.parametrize("case", CASES)
def test_logprobs_as_in_0_1_0(fixtures, case):
    want = torch.tensor(fixtures[case]["logprobs"])
    got = teacher_forced_logprobs(FIXTURES / f"{case}.pt", FIXTURES / "data-bin", want.size(0))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


def test_matt_checkpoint_keeps_its_own_value_projection():
    """0.1.0's MAtt default was a separate W_v; the stored option keeps it although sharing is now the default."""
    state = torch.load(FIXTURES / "dsinit_matt.pt")
    assert state["cfg"]["model"].matt_share_v is False
    assert any(k.endswith("self_branch.v_proj.weight") for k in state["model"])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["admin", "dsinit_matt", "twt"])
def test_generate_gives_0_1_0_hypotheses(fixtures, case):
    out = run_cli(
        "generate", FIXTURES / "data-bin", "--user-dir", USER_DIR, "--path", FIXTURES / f"{case}.pt",
        "-s", "src", "-t", "tgt", "--gen-subset", "test", "--beam", "3", "--batch-size", "8",
        "--required-batch-size-multiple", "1", "--cpu",
    ).stdout  # fmt: skip
    got = {m[1]: [m[2], m[3]] for m in re.finditer(r"^H-(\d+)\t(\S+)\t(.*)$", out, re.M)}
    want = fixtures[case]["hypotheses"]
    assert set(got) == set(want) and len(want) == 20
    for k, (score, text) in want.items():
        assert got[k][1] == text, (k, got[k], want[k])
        # scores are printed with 4 decimals: one unit of rounding plus the round-off above
        assert abs(float(got[k][0]) - float(score)) <= 1e-4 + ATOL, (k, got[k], want[k])
