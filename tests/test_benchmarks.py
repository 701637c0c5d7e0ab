"""benchmarks/throughput.py: a smoke run on real Multi30k batches, and its report logic.

No timing is asserted here (speed targets are ratios the script prints, measured side by side);
the tests check that every configuration is the model it claims to be, that all were timed on the
same tokens, and that the printed table agrees with the JSON.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest

from conftest import MULTI30K, REPO

SCRIPT = REPO / "benchmarks" / "throughput.py"


def load_script():
    spec = importlib.util.spec_from_file_location("benchmarks_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


tp = load_script()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    if not (MULTI30K / "train.de.gz").exists():
        pytest.skip(f"Multi30k not found at {MULTI30K} (set MULTI30K_DIR)")
    out = tmp_path_factory.mktemp("bench")
    cmd = [
        sys.executable, str(SCRIPT), "--quick", "--multi30k", str(MULTI30K), "--work-dir", str(out / "data"),
        "--json", str(out / "result.json"), "--markdown", str(out / "result.md"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads((out / "result.json").read_text()), (out / "result.md").read_text(), proc.stdout


def test_quick_run_builds_the_claimed_models_on_the_same_tokens(quick_run):
    result, _, _ = quick_run
    (shape,) = result["shapes"]
    rows = result["shapes"][shape]
    # the quick configurations plus the references they are compared against, added automatically
    assert list(rows) == ["stock", "stock-preln", "postln", "preln", "preln-scalenorm"]
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
    lines = tp.verdicts(res)
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
    with pytest.raises(SystemExit):
        tp.parse_args(["--fp16"])
    with pytest.raises(SystemExit):
        tp.parse_args(["--steps", "0"])
    assert tp.Shape.parse("18x128x512x4").flags()[:2] == ["--encoder-layers", "18"]
    with pytest.raises(Exception, match="heads must divide"):
        tp.Shape.parse("6x100x400x3")


# --- the speed fixes keep the math ------------------------------------------------------------


def test_scalenorm_hand_written_backward_is_autograd_of_eq3():
    """ScaleNorm's custom backward equals autograd through g * x / max(||x||, eps) (TwT eq. 3),
    on a transposed input with a zero row and a row whose norm is clamped at eps."""
    import torch

    from fairseq_deepinit.modules.norms import ScaleNorm, _ScaleNormFunction

    eps = 1e-5
    torch.manual_seed(0)
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    x[0, 0] = 0.0
    x[1, 2] *= 1e-7  # ||x|| < eps: the scale is the constant g / eps there
    x = x.transpose(0, 1).requires_grad_()
    g = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, g: _ScaleNormFunction.apply(x, g, eps), (x, g))

    dy = torch.randn(3, 4, 6, dtype=torch.float64)
    want_y = g * x / x.norm(dim=-1, keepdim=True).clamp(min=eps)
    want = torch.autograd.grad(want_y, (x, g), dy)
    y = _ScaleNormFunction.apply(x, g, eps)
    got = torch.autograd.grad(y, (x, g), dy)
    torch.testing.assert_close(y, want_y, rtol=1e-14, atol=0)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=0)
    assert torch.equal(got[0][2, 1], torch.full((6,), 2.5 / eps, dtype=torch.float64) * dy[2, 1])  # clamped row
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
        (ConstantResidual(1.7), residual * 1.7 + branch),
        (rezero, residual + 0.3 * branch),
    ):
        out = module(branch, residual)
        assert out.is_contiguous(), type(module).__name__
        assert torch.equal(out, want), type(module).__name__
