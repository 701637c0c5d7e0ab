"""What an export refuses to write or to call exact, each in one line with exit status 1 and nothing written:

- an existing output without ``--force``; with it, never the checkpoint being exported, a ``checkpoint*.pt`` of
  its run's folder (existing or not) or a folder holding it (``deepinit-export``, ``deepinit-export-admin``,
  ``deepinit-export-admin-lm``);
- an empty output name, a ``--tolerance`` that is not a finite number >= 0: before the checkpoint is read;
- a checkpoint with a NaN or infinite weight (naming it); a state dict with a missing, unexpected or reshaped key;
- a check whose values are not finite (CTranslate2 float32 and quantized, stock fairseq): a NaN is a failure,
  not a difference of 0.

And the temporaries of an export killed before its rename are removed by the next export to that output.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess

import pytest
import torch
from export_cases import build_case, write_checkpoint

from fairseq_deepinit.admin import export as admin_export
from fairseq_deepinit.errors import ExportError
from fairseq_deepinit.export import cli, output, scoring, source, to_fairseq
from fairseq_deepinit.lm import export as lm_export

pytest.importorskip("ctranslate2")

PRELN = ("preln", (), False)
TOOLS = {
    "deepinit-export": cli.main,
    "deepinit-export-admin": admin_export.main,
    "deepinit-export-admin-lm": lm_export.main,
}
TO = {"deepinit-export": ["--to", "fairseq"], "deepinit-export-admin": [], "deepinit-export-admin-lm": []}


def run(capsys, tool: str, *argv) -> tuple:
    """``(exit status, stderr lines)`` of ``tool argv`` (its ``main``, the command-line boundary)."""
    code = TOOLS[tool]([str(a) for a in argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def refused(capsys, tool: str, *argv) -> str:
    code, err = run(capsys, tool, *argv)
    assert code == 1 and len(err) == 1 and err[0].startswith(f"{tool}: error: "), err
    return err[0]


@pytest.fixture
def run_dir(tmp_path):
    """``(checkpoint_last.pt, checkpoint_best.pt, data, model, args)``: a run's save folder with two checkpoints."""
    model, args = build_case(PRELN)
    last, data = write_checkpoint(model, args, tmp_path / "ckpt", name="checkpoint_last.pt")
    best = last.parent / "checkpoint_best.pt"
    shutil.copy(last, best)
    return last, best, data, model, args


def listing(folder) -> dict:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("tool", TOOLS)
def test_no_export_replaces_a_checkpoint_of_its_run_even_with_force(tool, run_dir, capsys):
    last, best, _data, _model, _args = run_dir
    before = listing(last.parent.parent)
    for out in (best, last.parent / "checkpoint7.pt", last.parent / "checkpoint_2_300.pt"):
        for force in ([], ["--force"]):
            line = refused(capsys, tool, last, out, *TO[tool], *force)
            assert f"the output {out} is a checkpoint name of the run {last} comes from" in line
    assert "is the input checkpoint" in refused(capsys, tool, last, last, *TO[tool], "--force")
    assert listing(last.parent.parent) == before


def test_no_ctranslate2_export_replaces_the_folder_of_its_checkpoint(run_dir, capsys):
    last, _best, data, _model, _args = run_dir
    (last.parent / "model.bin").write_bytes(b"a CTranslate2 model beside the checkpoints")
    before = listing(last.parent.parent)
    for out in (last.parent, last.parent.parent):
        line = refused(capsys, "deepinit-export", last, out, "--to", "ctranslate2", "--data", data, "--force")
        assert f"the output {out} is a folder that holds the input checkpoint" in line
    assert listing(last.parent.parent) == before


@pytest.mark.parametrize("tool", TOOLS)
def test_an_existing_output_is_replaced_only_with_force(tool, run_dir, tmp_path, capsys):
    last = run_dir[0]
    out = tmp_path / "stock.pt"
    out.write_text("mine")
    line = refused(capsys, tool, last, out, *TO[tool])
    assert line.endswith(f"the output {out} exists; give --force to replace it, or another file name")
    assert out.read_text() == "mine"
    if tool == "deepinit-export":  # the Admin commands refuse this Pre-LN model after the destination's checks
        assert run(capsys, tool, last, out, *TO[tool], "--force")[0] == 0
        assert torch.load(out, weights_only=True)["cfg"]["model"]["_name"] == "transformer"


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize(
    "out,argv,message",
    [
        ("out", ["--tolerance", "nan"], "--tolerance nan: give a finite number >= 0"),
        ("out", ["--tolerance", "-1"], "--tolerance -1.0: give a finite number >= 0"),
        ("out", ["--tolerance", "inf"], "--tolerance inf: give a finite number >= 0"),
        ("", [], "the output name is empty"),
    ],
)
def test_arguments_are_refused_before_the_checkpoint_is_read(tool, out, argv, message, run_dir, capsys, monkeypatch):
    def never(*_args, **_kwargs):
        raise AssertionError("the checkpoint was read before the arguments were checked")

    monkeypatch.setattr(source, "load_checkpoint", never)
    monkeypatch.chdir(run_dir[0].parent.parent)
    assert message in refused(capsys, tool, run_dir[0], out, *TO[tool], *argv)
    if tool == "deepinit-export":
        assert message in refused(capsys, tool, run_dir[0], out, "--to", "ctranslate2", *argv)
    assert not os.path.exists("out")


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_temporaries_of_killed_exports_are_removed_by_the_next_export(run_dir, tmp_path, capsys):
    last, _best, data, _model, _args = run_dir
    dead, alive = dead_pid(), os.getppid()
    stock, ct2 = tmp_path / "stock.pt", tmp_path / "ct2"
    stale_file = output.temporary(str(stock), dead)
    open(stale_file, "w").write("half a checkpoint")
    live_file = output.temporary(str(stock), alive)  # another export, still running: left alone
    open(live_file, "w").write("being written")
    stale_dir = output.temporary(str(ct2), dead)
    os.makedirs(stale_dir)
    open(os.path.join(stale_dir, "model.bin"), "w").write("half a model")
    other_host = os.path.join(tmp_path, f".stock.pt.elsewhere.{dead}.tmp")  # another host's: left alone
    open(other_host, "w").write("theirs")
    assert run(capsys, "deepinit-export", last, stock, "--to", "fairseq")[0] == 0
    assert run(capsys, "deepinit-export", last, ct2, "--to", "ctranslate2", "--data", data)[0] == 0
    hidden = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert hidden == sorted(os.path.basename(p) for p in (live_file, other_host))


def test_a_previous_export_moved_aside_by_a_killed_export_is_put_back(run_dir, tmp_path, capsys):
    last, _best, data, _model, _args = run_dir
    ct2 = tmp_path / "ct2"
    assert run(capsys, "deepinit-export", last, ct2, "--to", "ctranslate2", "--data", data, "--no-check")[0] == 0
    model = (ct2 / "model.bin").read_bytes()
    dead = dead_pid()
    os.replace(ct2, output.temporary(str(ct2), dead) + ".old")  # killed between its two renames
    os.makedirs(output.temporary(str(ct2), dead))
    line = refused(capsys, "deepinit-export", last, ct2, "--to", "ctranslate2", "--data", data)
    assert line.endswith("exists (a CTranslate2 model); give --force to replace it")
    assert (ct2 / "model.bin").read_bytes() == model
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_checkpoint_with_non_finite_weights_is_refused_naming_the_tensor(value, tmp_path, capsys):
    model, args = build_case(PRELN)
    with torch.no_grad():
        model.decoder.layers[1].fc1.weight[0, 0] = value
    ckpt, data = write_checkpoint(model, args, tmp_path / "run")
    for out, argv in ((tmp_path / "out.pt", ["--to", "fairseq"]), (tmp_path / "ct2", ["--to", "ctranslate2"])):
        line = refused(capsys, "deepinit-export", ckpt, out, *argv)
        assert "the weight decoder.layers.1.fc1.weight holds 1 non-finite values (NaN or inf)" in line
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def edited(sd: dict, how: str) -> dict:
    sd = dict(sd)
    if how == "missing":
        del sd["decoder.layers.1.fc2.bias"]
    elif how == "unexpected":
        sd["decoder.layers.1.extra.weight"] = torch.zeros(3)
    elif how == "reshaped":
        sd["encoder.layers.0.fc1.weight"] = torch.zeros(65, 32)
    elif how == "no embedding":
        del sd["encoder.embed_tokens.weight"]
    return sd


@pytest.mark.parametrize(
    "how,message",
    [
        ("missing", "missing decoder.layers.1.fc2.bias"),
        ("unexpected", "unexpected decoder.layers.1.extra.weight"),
        ("reshaped", "reshaped encoder.layers.0.fc1.weight ([65, 32] in the checkpoint, [64, 32] in the model)"),
        ("no embedding", "missing encoder.embed_tokens.weight"),
    ],
)
def test_a_state_dict_that_does_not_fit_its_model_is_one_line(how, message, tmp_path, capsys):
    model, args = build_case(PRELN)
    ckpt, data = write_checkpoint(model, args, tmp_path / "run")
    state = torch.load(ckpt, weights_only=False)
    state["model"] = edited(state["model"], how)
    torch.save(state, ckpt)
    for argv in (["--to", "fairseq"], ["--to", "ctranslate2", "--data", data]):
        line = refused(capsys, "deepinit-export", ckpt, tmp_path / "out", *argv)
        assert "the checkpoint's weights do not fit the model its arguments describe (--arch preln_iwslt_de_en)" in line
        assert message in line and line.endswith(
            "export the checkpoint as fairseq-train wrote it (an edited or damaged file cannot be exported)"
        )
    assert not (tmp_path / "out").exists()


def test_the_comparison_counts_nan_as_a_failure():
    ok = [torch.tensor([-1.0, -2.0])]
    assert math.isnan(scoring.max_difference(ok, [torch.tensor([-1.0, math.nan])]))
    assert scoring.compare_log_probs(ok, [torch.tensor([-1.0, -2.5])], math.inf, "X") == 0.5
    for bad in (torch.tensor([-1.0, math.nan]), torch.tensor([math.nan, math.nan]), torch.tensor([-1.0, -math.inf])):
        with pytest.raises(ExportError, match="X's log-probabilities of the check hold [12] non-finite values"):
            scoring.compare_log_probs(ok, [bad], math.inf, "X")
    with pytest.raises(ExportError, match="the plugin model's log-probabilities of the check hold 1 non-finite"):
        scoring.compare_log_probs([torch.tensor([math.nan, -1.0])], ok, math.inf, "X")


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_ctranslate2_scores_that_are_nan_are_not_exact(quantization, run_dir, tmp_path, capsys, monkeypatch):
    last, _best, data, _model, _args = run_dir
    real, calls = scoring.ct2_scores, []

    def nan_scores(*args):  # the float32 check first; a quantized model's report second
        calls.append(1)
        scores = real(*args)
        return [s.fill_(math.nan) for s in scores] if len(calls) == (2 if quantization else 1) else scores

    monkeypatch.setattr(scoring, "ct2_scores", nan_scores)
    q = ["--quantization", quantization] if quantization else []
    line = refused(capsys, "deepinit-export", last, tmp_path / "ct2", "--to", "ctranslate2", "--data", data, *q)
    want = f"CTranslate2{' (default)' if quantization else ''}'s log-probabilities of the check hold"
    assert want in line and "non-finite values (NaN or inf)" in line
    assert not (tmp_path / "ct2").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_stock_fairseq_log_probs_that_are_nan_are_not_exact(run_dir, tmp_path, capsys, monkeypatch):
    real = to_fairseq.log_probs

    def nan_for_stock(model, batch):
        lp = real(model, batch)
        return lp if type(model).__module__.startswith("fairseq_deepinit") else lp.fill_(math.nan)

    monkeypatch.setattr(to_fairseq, "log_probs", nan_for_stock)
    line = refused(capsys, "deepinit-export", run_dir[0], tmp_path / "stock.pt", "--to", "fairseq")
    assert "the exported model's log-probabilities of the check hold" in line and "non-finite" in line
    assert not (tmp_path / "stock.pt").exists()
