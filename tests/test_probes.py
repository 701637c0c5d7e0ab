"""Every bad-input probe (checkpoint files aside: tests/test_resume.py) ends in one line and
exit status 1, in argparse's exit 2 naming the flag, or works.

- fairseq-train (real subprocesses, two at a time, as a user runs it: the plugin's excepthook and the
  interpreter's exit are what is tested): the diagnostics criterion's options, ``--lr-scheduler tfixup``,
  ``--adam-betas``, and the stock-fairseq cases :mod:`fairseq_deepinit.intercepts` catches (task and
  architecture that do not fit, an empty split, data binarised with another dictionary); a probe
  refused by the same code at the same point as one of those (:data:`IN_PROCESS`) is built in process
  through fairseq's parser, task and registries instead;
- ``deepinit-diagnose`` and the export tools, whose ``main`` is the command-line boundary (called in
  process: its return value is the exit status, its stderr the one line);
- the value tables behind them (``--adam-betas``, the tfixup options, the task/architecture rule).

Corpora are written in process with fairseq's own ``MMapIndexedDatasetBuilder`` (the format
``fairseq-preprocess`` writes), once per module.
"""

from __future__ import annotations

import argparse
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import USER_DIR, make_dictionary, run_cli
from fairseq_deepinit import errors, intercepts
from fairseq_deepinit.admin import export as admin_export
from fairseq_deepinit.diagnostics import diagnose
from fairseq_deepinit.lm import export as lm_export
from fairseq_deepinit.training.adam_foreach import parse_adam_betas

DIMS = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2"]  # fmt: skip
# --max-update 2: a probe that is not refused stops instead of training on
TRAIN = ["--user-dir", USER_DIR, "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "512", "--cpu",
         "--num-workers", "0", "--no-epoch-checkpoints", "--log-format", "simple", "--seed", "1",
         "--max-update", "2"]  # fmt: skip
MT = [*TRAIN, "-s", "src", "-t", "tgt", "--arch", "postln_iwslt_de_en", *DIMS]
DIAG = ["--criterion", "label_smoothed_cross_entropy_diagnostics"]
LM = [*TRAIN, "--task", "language_modeling", "--tokens-per-sample", "32"]


def _write_split(prefix: Path, lines: list) -> None:
    """``prefix.bin`` / ``prefix.idx`` as fairseq-preprocess writes them (mmap format, uint16 ids)."""
    from fairseq.data import indexed_dataset

    builder = indexed_dataset.MMapIndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for ids in lines:
        builder.add_item(torch.tensor(ids, dtype=torch.int64))
    builder.finalize(str(prefix) + ".idx")


def _lm_corpus(folder: Path) -> Path:
    folder.mkdir(parents=True)
    d = make_dictionary(30)
    d.save(str(folder / "dict.txt"))
    rng = np.random.default_rng(0)
    for split, n in (("train", 300), ("valid", 100)):
        _write_split(
            folder / split, [[*rng.integers(4, len(d), rng.integers(4, 12)).tolist(), d.eos()] for _ in range(n)]
        )
    return folder


@pytest.fixture(scope="module")
def data(synthetic_bin, tmp_path_factory):
    """The shared translation corpus, three broken copies of it, and a language-model corpus."""
    root = tmp_path_factory.mktemp("probes")
    empty = root / "empty"
    empty.mkdir()
    for f in synthetic_bin.iterdir():
        if f.name.startswith(("dict.", "valid.")):
            shutil.copy(f, empty / f.name)
    for lang in ("src", "tgt"):
        _write_split(empty / f"train.src-tgt.{lang}", [])
    other_dict = root / "other_dict"
    shutil.copytree(synthetic_bin, other_dict)
    for lang in ("src", "tgt"):  # the first 10 words of the dictionary the data was binarised with
        path = other_dict / f"dict.{lang}.txt"
        path.write_text("".join(path.read_text().splitlines(keepends=True)[:10]))
    (root / "a_file").write_text("not a folder\n")
    return SimpleNamespace(root=root, mt=synthetic_bin, empty=empty, other_dict=other_dict, lm=_lm_corpus(root / "lm"))


def one_error_line(out: str, status: int, returncode: int, prefix: str = errors.PREFIX) -> str:
    """Exit ``status``, exactly one line starting with ``prefix``, no traceback, no abort; returns the line."""
    assert returncode == status, out[-3000:]
    assert "Traceback" not in out and "terminate called" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, out[-3000:]
    return lines[0]


# ---------------------------------------------------------------------------------------------
# fairseq-train

MARKER = "eval_ran"
INJECTION = f"__import__('pathlib').Path('{MARKER}').touch()"

# name -> (data folder, fairseq-train arguments, what the line says: one text or several)
TRAIN_PROBES = {
    "diagnostics_interval": ("mt", [*MT, *DIAG, "--diagnostics-interval", "-1"], "--diagnostics-interval must be >= 0"),
    "diagnostics_stats": (
        "mt",
        [*MT, *DIAG, "--diagnostics-stats", "foo"],
        "--diagnostics-stats: unknown foo; give a comma-separated subset of "
        "var,norm,residual,scalenorm,grad,stream,angle,logit,counters",
    ),
    "diagnostics_inject_spec": (
        "mt",
        [*MT, *DIAG, "--diagnostics-inject-nan", "xyz"],
        "--diagnostics-inject-nan 'xyz': expected UPDATE:PARAM or UPDATE:PARAM:after",
    ),
    "diagnostics_inject_name": (
        "mt",
        [*MT, *DIAG, "--diagnostics-inject-nan", "2:encoder.layers.0.fc1.wieght"],
        "the model has no parameter 'encoder.layers.0.fc1.wieght'; did you mean encoder.layers.0.fc1.weight",
    ),
    "tfixup_period": (
        "mt",
        [*MT, "--lr-scheduler", "tfixup", "--decay-period", "0"],
        "--decay-period must be positive, got 0",
    ),
    "adam_foreach_betas_code": (
        "mt",
        [*MT, "--optimizer", "adam_foreach", "--adam-betas", INJECTION],
        "is not a pair of numbers; give beta1 and beta2 as a literal",
    ),
    "adam_betas_code": ("mt", [*MT, "--adam-betas", INJECTION], "is not a pair of numbers"),
    "adam_foreach_beta2_one": (
        "mt",
        [*MT, "--optimizer", "adam_foreach", "--adam-betas", "(0.9, 1.0)"],
        "--adam-betas '(0.9, 1.0)': each beta must be >= 0 and < 1",
    ),
    "empty_train_split": (
        "empty",
        MT,
        "the train split {data}/train.src-tgt.src.bin holds no sentences; binarise a train file with sentences "
        "(fairseq-preprocess --trainpref)",
    ),
    "another_dictionary": (
        "other_dict",
        MT,
        (
            "{data}/valid.src-tgt.src.bin holds token id ",
            "but its dictionary ({data}/dict.src.txt) has only 14 entries: "
            "the split was binarised with another dictionary",
        ),
    ),
    "lm_arch_under_translation": (
        "mt",
        [*TRAIN, "-s", "src", "-t", "tgt", "--arch", "deepnorm_lm_tiny"],
        "--arch deepnorm_lm_tiny is a decoder-only language model, which --task translation (source and target "
        "sentences) cannot train; use --task language_modeling",
    ),
    "translation_arch_under_lm": (
        "lm",
        [*LM, "--arch", "deepnorm_iwslt_de_en", *DIMS],
        "--arch deepnorm_iwslt_de_en is an encoder-decoder (translation) model, which --task language_modeling "
        "(one token stream) cannot train; use --task translation on a parallel corpus, or a decoder-only "
        "architecture such as --arch deepnorm_lm",
    ),
}


# probes refused by the same code, at the same point of fairseq-train, as another probe that runs as
# fairseq-train (the criterion's options: diagnostics_stats; --adam-betas: adam_betas_code): their line
# is checked in process, through fairseq's parser, task and registries (test_probe_in_process); the
# excepthook and the interpreter's exit are the same for every refusal
IN_PROCESS = {
    "diagnostics_interval": "criterion",
    "diagnostics_inject_spec": "criterion",
    "adam_foreach_betas_code": "optimizer",
    "adam_foreach_beta2_one": "optimizer",
}
AS_FAIRSEQ_TRAIN = [name for name in TRAIN_PROBES if name not in IN_PROCESS]


@pytest.fixture(scope="module")
def train_runs(data):
    """Every probe of :data:`AS_FAIRSEQ_TRAIN` as its own fairseq-train, and one Admin LM that trains (for the
    export)."""

    def train(name, folder, args):
        cwd = data.root / name
        cwd.mkdir()
        proc = run_cli("train", getattr(data, folder), *args, "--save-dir", cwd / "ckpt", check=False, cwd=cwd)
        return SimpleNamespace(proc=proc, cwd=cwd, data=getattr(data, folder))

    jobs = {name: TRAIN_PROBES[name][:2] for name in AS_FAIRSEQ_TRAIN}
    admin_lm = [*LM, "--task", "language_modeling_admin", "--arch", "admin_lm_tiny", "--max-update", "1"]
    jobs["admin_lm"] = ("lm", admin_lm)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(train, name, *job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", AS_FAIRSEQ_TRAIN)
def test_fairseq_train_probe(train_runs, name):
    run = train_runs[name]
    line = one_error_line(run.proc.stdout, 1, run.proc.returncode)
    expected = TRAIN_PROBES[name][2]
    for text in (expected,) if isinstance(expected, str) else expected:
        assert text.format(data=run.data) in line, line
    # refused before the first update: no crash.pt (fairseq writes one for errors inside its train step)
    assert "Start iterating over samples" not in run.proc.stdout
    assert not (run.cwd / "ckpt" / "crash.pt").exists()
    assert not (run.cwd / MARKER).exists()  # --adam-betas is never evaluated as code


@pytest.mark.parametrize("name", list(IN_PROCESS))
def test_probe_in_process(data, tmp_path, monkeypatch, name):
    """fairseq-train's parsing, task, and then the criterion or optimizer it builds from them, in process:
    the same one-line error as the probe's fairseq-train would print, and no code run from --adam-betas."""
    from fairseq import optim, options, tasks

    folder, argv, expected = TRAIN_PROBES[name]
    monkeypatch.chdir(tmp_path)
    args = options.parse_args_and_arch(options.get_training_parser(), [str(getattr(data, folder)), *argv])
    task = tasks.setup_task(args)
    with pytest.raises(errors.DeepInitError) as info:
        if IN_PROCESS[name] == "criterion":
            task.build_criterion(args)
        else:
            optim.build_optimizer(args, [torch.nn.Parameter(torch.zeros(2))])
    line = errors.format_error(info.value)  # what the excepthook prints
    assert expected in line, line
    assert not (tmp_path / MARKER).exists()


def test_admin_lm_trains_for_the_exports(train_runs):
    assert train_runs["admin_lm"].proc.returncode == 0, train_runs["admin_lm"].proc.stdout[-3000:]


# ---------------------------------------------------------------------------------------------
# value tables


@pytest.mark.parametrize(
    "value, betas",
    [("(0.9, 0.98)", (0.9, 0.98)), ("0.9,0.999", (0.9, 0.999)), ("[0, 0]", (0.0, 0.0)), (" (0.5,0.5) ", (0.5, 0.5)),
     ([0.9, 0.98], (0.9, 0.98)), ((0.9, 0.98), (0.9, 0.98))],
)  # fmt: skip
def test_adam_betas_accepted(value, betas):
    assert parse_adam_betas(value) == betas


@pytest.mark.parametrize(
    "value, problem",
    [
        ("(0.9)", "is not a pair of numbers"),
        ("foo", "is not a pair of numbers"),
        ("(nan, 0.9)", "is not a pair of numbers"),  # a name, not a literal
        ("(0.9, 0.98, 0.9)", "is not a pair of numbers"),
        ("(True, 0.9)", "is not a pair of numbers"),
        ("('0.9', 0.9)", "is not a pair of numbers"),
        ("(1j, 0.9)", "is not a pair of numbers"),
        (INJECTION, "is not a pair of numbers"),
        ("(1e999, 0.9)", "each beta must be >= 0 and < 1"),  # inf
        ("(1.0, 0.999)", "each beta must be >= 0 and < 1"),  # 1 - beta1^t = 0: a division by zero
        ("(0.9, 1.0)", "each beta must be >= 0 and < 1"),  # sqrt(1 - beta2^t) = 0: step size 0, never trains
        ("(1.5, 0.9)", "each beta must be >= 0 and < 1"),
        ("(-0.1, 0.9)", "each beta must be >= 0 and < 1"),
        ("(0.9, -0.5)", "each beta must be >= 0 and < 1"),
    ],
)
def test_adam_betas_refused(value, problem, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(errors.DeepInitConfigError, match="--adam-betas .*" + problem) as info:
        parse_adam_betas(value)
    assert "\n" not in str(info.value) and not (tmp_path / MARKER).exists()


def test_torch_adam_refuses_the_same_betas():
    """The range is torch's own (``torch.optim.Adam``), so nothing torch trains with is refused."""
    p = [torch.nn.Parameter(torch.zeros(1))]
    for bad in ((1.0, 0.999), (0.9, 1.0), (-0.1, 0.9), (1.5, 0.9)):
        with pytest.raises(ValueError, match="Invalid beta parameter"):
            torch.optim.Adam(p, betas=bad)
    torch.optim.Adam(p, betas=(0.0, 0.0))


@pytest.mark.parametrize("optimizer", ["adam", "adam_foreach"])
def test_both_adams_build_from_a_checked_literal(optimizer):
    from fairseq import optim
    from fairseq.optim.adam import FairseqAdamConfig

    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = optim.OPTIMIZER_REGISTRY[optimizer](FairseqAdamConfig(lr=[1e-3], adam_betas="(0.8, 0.9)"), params)
    assert tuple(opt.optimizer.param_groups[0]["betas"]) == (0.8, 0.9)
    with pytest.raises(errors.DeepInitConfigError, match="--adam-betas"):
        optim.OPTIMIZER_REGISTRY[optimizer](FairseqAdamConfig(lr=[1e-3], adam_betas="(0.9, 1.0)"), params)


@pytest.mark.parametrize(
    "flags, lr, message",
    [
        (("--decay-period", "0"), "5e-4", "--decay-period must be positive, got 0"),
        (("--decay-period", "-3"), "5e-4", "--decay-period must be positive, got -3"),
        ((), "5e-4,1e-4", "--lr-scheduler tfixup takes one --lr value, not a list"),
        ((), "0", "--lr must be a finite number > 0 (the rate at update 0), got 0"),
        ((), "(-1e-3)", "--lr must be a finite number > 0 (the rate at update 0), got -0.001"),
        ((), "1e999", "--lr must be a finite number > 0 (the rate at update 0), got inf"),
    ],
)
def test_tfixup_options_refused(flags, lr, message):
    from test_schedule import build_scheduler

    with pytest.raises(errors.DeepInitConfigError) as info:
        build_scheduler("--lr-scheduler", "tfixup", *flags, lr=lr)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "task, arch, suggestion",
    [
        ("translation", "deepinit_lm_tiny", "deepinit_tiny"),
        ("translation_admin", "admin_lm", "admin_iwslt_de_en"),
        ("translation_deepinit", "deepnorm_torchscale_lm_24l", "deepnorm_torchscale_iwslt_de_en"),
        ("language_modeling", "twt_wmt_en_de_big", "twt_lm"),
        ("language_modeling_admin", "admin_iwslt_de_en", "admin_lm"),
        ("language_modeling", "tfixup_iwslt_de_en_200l", "tfixup_lm"),
    ],
)
def test_task_and_architecture_that_do_not_fit(task, arch, suggestion):
    with pytest.raises(errors.DeepInitConfigError) as info:
        intercepts.check_task_and_arch(argparse.Namespace(task=task, arch=arch))
    assert f"--arch {arch} is a" in str(info.value) and str(info.value).endswith(f"--arch {suggestion}")


@pytest.mark.parametrize(
    "task, arch",
    [
        ("translation", "postln_iwslt_de_en"),
        ("translation_admin", "admin_iwslt_de_en"),
        ("language_modeling", "deepnorm_lm_tiny"),
        ("language_modeling_admin", "admin_lm_tiny"),
        ("translation", "transformer_lm"),  # stock fairseq architectures: left to fairseq (docs/usage.md)
        ("multilingual_translation", "deepinit_lm"),  # tasks of neither kind: left to fairseq
    ],
)
def test_task_and_architecture_left_alone(task, arch):
    intercepts.check_task_and_arch(argparse.Namespace(task=task, arch=arch))


def test_a_truncated_split_is_refused(data, tmp_path):
    """Shorter than its index says (an interrupted copy): refused, not read past its end."""
    for f in data.mt.iterdir():
        shutil.copy(f, tmp_path / f.name)
    prefix = tmp_path / "valid.src-tgt.tgt"
    with open(str(prefix) + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(str(prefix) + ".bin") - 2)
    with pytest.raises(errors.DataConfigError, match=r"valid.src-tgt.tgt.bin has \d+ bytes where its index"):
        intercepts.check_split_file(str(prefix))
    intercepts.check_split_file(str(tmp_path / "valid.src-tgt.src"), make_dictionary(40))  # intact: fine


# ---------------------------------------------------------------------------------------------
# deepinit-diagnose


def _diagnose(capsys, *argv):
    """``deepinit-diagnose argv``: (exit status, stderr)."""
    try:
        status = diagnose.main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        status = e.code
    return status, capsys.readouterr().err


MT_DIAG = ["-s", "src", "-t", "tgt", "--arch", "postln_iwslt_de_en", *DIMS, "--measure", "grad", "--max-tokens", "256"]

# name -> (data folder, arguments, exit status, what the line says)
DIAGNOSE_PROBES = {
    "output_dir_is_a_file": (
        "mt",
        [*MT_DIAG, "--output-dir", "{root}/a_file"],
        1,
        "--output-dir {root}/a_file is a file",
    ),
    "output_dir_under_a_file": (
        "mt",
        [*MT_DIAG, "--output-dir", "{root}/a_file/run"],
        1,
        "--output-dir {root}/a_file/run cannot be created: {root}/a_file is a file",
    ),
    "no_such_subset": (
        "mt",
        [*MT_DIAG, "--subset", "nosuch", "--output-dir", "{tmp}"],
        1,
        "--subset nosuch: no such split in {data} (Dataset not found: nosuch ({data})); the splits there: test, train, "
        "valid",
    ),
    "max_tokens_1": (
        "mt",
        [*MT_DIAG, "--max-tokens", "1", "--output-dir", "{tmp}"],
        1,
        "no batch in subset 'train' of {data}: the shortest of its 2000 sentences has 4 tokens, more than "
        "--max-tokens 1; raise --max-tokens",
    ),
    "lm_arch_under_translation": (
        "lm",
        ["--arch", "deepnorm_lm_tiny", "--output-dir", "{tmp}"],
        1,
        "--arch deepnorm_lm_tiny is a decoder-only language model, which --task translation",
    ),
    "empty_split": (
        "empty",
        [*MT_DIAG, "--output-dir", "{tmp}"],
        1,
        "the train split {data}/train.src-tgt.src.bin holds",
    ),
    "measure_unknown": (
        "mt",
        [*MT_DIAG, "--measure", "grad,bogus", "--output-dir", "{tmp}"],
        1,
        "unknown --measure bogus",
    ),
    "max_tokens_0": (
        "mt",
        [*MT_DIAG, "--max-tokens", "0", "--output-dir", "{tmp}"],
        2,
        "argument --max-tokens: must be >= 1, got 0",
    ),
    "perturb_scale_nan": (
        "mt",
        [*MT_DIAG, "--perturb-scale", "nan", "--output-dir", "{tmp}"],
        2,
        "argument --perturb-scale: must be a finite number > 0, got nan",
    ),
    "perturb_scale_0": (
        "mt",
        [*MT_DIAG, "--perturb-scale", "0", "--output-dir", "{tmp}"],
        2,
        "argument --perturb-scale: must be a finite number > 0, got 0",
    ),
    "adam_lr_nan": (
        "mt",
        [*MT_DIAG, "--adam-lr", "nan", "--output-dir", "{tmp}"],
        2,
        "argument --adam-lr: must be a finite number > 0, got nan",
    ),
    "adam_lr_0": (
        "mt",
        [*MT_DIAG, "--adam-lr", "0", "--output-dir", "{tmp}"],
        2,
        "argument --adam-lr: must be a finite number > 0, got 0",
    ),
    "depths_one": (
        "mt",
        [*MT_DIAG, "--measure", "change", "--depths", "4", "--output-dir", "{tmp}"],
        1,
        "--depths needs at least two different depths >= 1 to fit a slope, got '4'",
    ),
    "repeats_0": (
        "mt",
        [*MT_DIAG, "--repeats", "0", "--output-dir", "{tmp}"],
        2,
        "argument --repeats: must be >= 1, got 0",
    ),
}


@pytest.mark.parametrize("name", list(DIAGNOSE_PROBES))
def test_diagnose_probe(data, tmp_path, capsys, name):
    folder, argv, status, message = DIAGNOSE_PROBES[name]
    fill = dict(root=data.root, tmp=tmp_path / "out", data=getattr(data, folder))
    code, err = _diagnose(capsys, getattr(data, folder), *(a.format(**fill) for a in argv))
    line = one_error_line(err, status, code, prefix="deepinit-diagnose: error: ")
    assert message.format(**fill) in line, line
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_diagnose_measures_a_language_model(data, tmp_path, capsys):
    """A decoder-only model: every measurement, the output-change sweep over --decoder-layers included."""
    import json

    out = tmp_path / "lm"
    code, err = _diagnose(capsys, data.lm, "--task", "language_modeling", "--arch", "deepnorm_lm_tiny",
                          "--tokens-per-sample", "32", "--max-tokens", "256", "--depths", "1,2", "--repeats", "1",
                          "--output-dir", out)  # fmt: skip
    assert code == 0, err
    result = json.loads((out / "diagnostics.json").read_text())
    assert result["grad_norm"]["encoder"] == [] and len(result["grad_norm"]["decoder"]) == 2
    oc = result["output_change"]
    assert set(oc["random"]["fit"]) == set(oc["adam"]["fit"]) == {"decoder"}
    assert all(v > 0 for v in oc["random"]["decoder"] + oc["adam"]["decoder"])
    assert list(result["depth"]["angle"]) == ["decoder"] and len(result["layer_removal"]["decoder"]) == 2
    assert sorted(p.name for p in out.iterdir()) == [
        "angular_distance.png", "diagnostics.json", "grad_norm.png", "gradient_flow.png", "layer_removal.png",
        "max_attention_logit.png", "norm_input.png", "output_change.png", "residual_stream.png",
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# deepinit-export-admin, deepinit-export-admin-lm


def _export(capsys, tool, *argv):
    code = {"admin": admin_export, "lm": lm_export}[tool].main([str(a) for a in argv])
    return code, capsys.readouterr().err


def test_export_probes(train_runs, tmp_path, capsys):
    ckpt = train_runs["admin_lm"].cwd / "ckpt" / "checkpoint_last.pt"
    before = ckpt.read_bytes()
    (tmp_path / "folder").mkdir()
    (tmp_path / "a_file").write_text("x")
    # the model arguments of a translation model are all the LM export reads before refusing it
    mt = tmp_path / "mt.pt"
    torch.save({"cfg": {"model": argparse.Namespace(encoder_layers=2, residual_scale="admin")}, "model": {}}, mt)
    probes = [  # (tool, input, output, what the line says)
        (
            "lm",
            ckpt,
            tmp_path / "folder",
            f"the output {tmp_path / 'folder'} is a folder; give the exported checkpoint's",
        ),
        (
            "lm",
            ckpt,
            tmp_path / "a_file" / "out.pt",
            f"cannot be written: {tmp_path / 'a_file'} is a file, not a folder",
        ),
        ("lm", ckpt, ckpt, f"the output {ckpt} is the input checkpoint; the export would replace it"),
        ("admin", ckpt, ckpt, f"the output {ckpt} is the input checkpoint; the export would replace it"),
        ("lm", ckpt, ckpt.parent / "." / ckpt.name, "is the input checkpoint"),
        ("admin", ckpt, tmp_path / "out.pt", f"{ckpt} is a deepinit language model; use deepinit-export-admin-lm"),
        ("lm", mt, tmp_path / "out.pt", f"{mt} is not a deepinit language model; use deepinit-export-admin"),
    ]
    for tool, source, output, message in probes:
        code, err = _export(capsys, tool, source, output)
        prog = "deepinit-export-admin-lm" if tool == "lm" else "deepinit-export-admin"
        line = one_error_line(err, 1, code, prefix=f"{prog}: error: ")
        assert message in line, line
    assert ckpt.read_bytes() == before  # the training checkpoint is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "folder", "mt.pt"]
    assert not any((tmp_path / "folder").iterdir())
    # a missing parent folder is created, and the export works
    out = tmp_path / "new" / "deeper" / "lm.pt"
    assert _export(capsys, "lm", ckpt, out)[0] == 0
    assert torch.load(out, map_location="cpu", weights_only=True)["cfg"]["model"]["_name"] == "transformer_lm"
    assert os.listdir(out.parent) == ["lm.pt"]  # no temporary file left
