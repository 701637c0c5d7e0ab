"""``benchmarks/mhc_precision.py``: mHC's fp32 mapping against the same mapping in bf16 under bf16 autocast.

At a toy shape the script prints both cases for one update and for the mapping alone (the bf16 case the reference,
its ratios 1) and the accuracy table. The accuracy figures are the reason for the choice and are asserted with
bounds from the float path: the fp32 mapping within ~2^-23 of float64 (20 Sinkhorn steps of a few fp32 roundings
on values <= 2: under 1e-5), the bf16 one off by more than bf16's own rounding of a value near 1/n (2^-9 / 4 ~ 5e-4)
and its columns short of doubly stochastic by as much; ``mapping_dtype`` None is the default fp32 mapping.
"""

from __future__ import annotations

import pytest
import torch

from conftest import REPO, run_script


def _tables(stdout: str) -> list:
    rows = [line.split("|")[1:-1] for line in stdout.splitlines() if line.startswith("| ") and "---" not in line]
    return [[c.strip() for c in r] for r in rows]


@pytest.mark.slow
def test_script_prints_both_cases_and_the_accuracy_of_each():
    proc = run_script(REPO / "benchmarks" / "mhc_precision.py", "--kind", "lm", "--shape", "1x16x32x2", "--batch",
                      "2x4", "--rounds", "1", "--updates", "1")  # fmt: skip
    rows = _tables(proc.stdout)
    cost = [r for r in rows if r[0] in ("one update", "one mapping, fwd+bwd")]
    assert [(r[0], r[1]) for r in cost] == [(w, c) for w in ("one update", "one mapping, fwd+bwd")
                                            for c in ("fp32 mapping", "bf16 mapping")]  # fmt: skip
    assert all(r[3] == "1.000 [1.000-1.000]" for r in cost if r[1] == "bf16 mapping")
    accuracy = [r for r in rows if r[2] in ("fp32", "bf16")]
    assert [r[0] for r in accuracy] == ["0.01", "0.01", "0.1", "0.1", "1", "1"]
    for r in accuracy:
        dev, col = max(float(v) for v in r[3:6]), float(r[7])
        if r[2] == "fp32":
            assert dev < 1e-5 and col < 1e-5, r
        else:
            assert dev > 5e-4 and col > 5e-4, r


def test_mapping_dtype_none_is_the_fp32_mapping_under_autocast():
    from fairseq_deepinit.modules.hyper import ManifoldHyperConnection

    torch.manual_seed(0)
    conn = ManifoldHyperConnection(4, 16, gating_init=0.5)
    x = torch.randn(5, 4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        default = conn.mappings(x)
        conn.mapping_dtype = torch.float32
        fp32 = conn.mappings(x)
        conn.mapping_dtype = torch.bfloat16
        bf16 = conn.mappings(x)
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(default, fp32, strict=True))
    assert all(t.dtype == torch.bfloat16 for t in bf16)
