"""The third probe round's bad input (tests/test_probes.py and tests/test_bad_input.py have the first two): one line
and exit status 1, or it works.

In process (the rule each check applies): options given without the kind of hyper-connections they belong to
(``--no-hc-dynamic``, ``--mhc-*``), ``--hc-streams`` and ``--z-loss-multiplier`` beyond their bounds, ``--sampling``
with ``--nbest`` other than ``--beam``, ``--amp`` / ``--fp16`` without CUDA, torch's state-dict error as one clause,
the z-loss criterion pair at resume, a lock path that is a folder, a FIFO or a symbolic link.

As a user runs them (subprocesses, two at a time, from one 2-update checkpoint): fairseq-generate ``--path`` with a
tensor reshaped, ``--sampling --beam 2``; fairseq-train resuming a checkpoint with a key too many, under another
criterion, with a symbolic link at the lock path; and what works: the z-loss term switched on at resume, a
finished run in a read-only save dir (exit 0, nothing changed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from conftest import USER_DIR, build_model, not_one_line, run_cli
from fairseq_deepinit import errors, input_checks
from fairseq_deepinit.checkpoints import model_load, run_lock
from fairseq_deepinit.training import launch, loss_terms

# --- in process -------------------------------------------------------------------------------------------------

LAYERS = ("--encoder-layers", "1", "--decoder-layers", "1")


@pytest.mark.parametrize(
    "cli, message",
    [
        (("--no-hc-dynamic",), "--no-hc-dynamic only applies to --hyper-connections hc, not none; drop it or use "
         "--hyper-connections hc"),
        (("--mhc-sinkhorn-iters", "5"), "--mhc-sinkhorn-iters only applies to --hyper-connections mhc, not none; "
         "drop it or use --hyper-connections mhc"),
        (("--no-matt-share-v",), "--no-matt-share-v only applies to --decoder-layer-type matt, not standard"),
        (("--hyper-connections", "hc", "--hc-streams", "1000"), "--hc-streams must be an integer from 1 to 8, got "
         "1000: every residual activation is kept n times"),
        (("--hyper-connections", "mhc", "--hc-streams", "9"), "--hc-streams must be an integer from 1 to 8, got 9"),
        (("--hyper-connections", "hc", "--mhc-eps", "1e-5"), "--mhc-eps only applies to --hyper-connections mhc, not "
         "hc; drop it or use --hyper-connections mhc"),
    ],
)  # fmt: skip
def test_options_without_their_kind_and_beyond_their_bounds(cli, message):
    with pytest.raises(errors.DeepInitConfigError) as info:
        build_model("preln_iwslt_de_en", *LAYERS, *cli)
    assert message in errors.format_error(info.value)


def test_what_the_advice_names_works():
    build_model("preln_iwslt_de_en", *LAYERS, "--hyper-connections", "hc", "--no-hc-dynamic", "--hc-streams", "8")
    build_model("preln_iwslt_de_en", *LAYERS, "--hyper-connections", "mhc", "--mhc-sinkhorn-iters", "5")
    build_model("matt_iwslt_de_en", *LAYERS, "--no-matt-share-v")


def test_sampling_needs_nbest_equal_to_beam():
    with pytest.raises(errors.DeepInitConfigError) as info:
        input_checks.check_sampling(SimpleNamespace(sampling=True, beam=2, nbest=1))
    assert str(info.value) == (
        "--sampling with --beam 2 draws 2 independent samples per sentence, and fairseq prints all of them (--nbest "
        "must equal --beam; got --nbest 1): give --nbest 2 --beam 2, or --nbest 1 --beam 1"
    )
    input_checks.check_sampling(SimpleNamespace(sampling=True, beam=3, nbest=3))
    input_checks.check_sampling(SimpleNamespace(sampling=False, beam=5, nbest=1))


def _precision_cfg(**common):
    flags = dict(fp16=False, memory_efficient_fp16=False, fp16_no_flatten_grads=False, amp=False, cpu=True, tpu=False)
    return SimpleNamespace(common=SimpleNamespace(**{**flags, **common}), task=SimpleNamespace())


def test_half_precision_without_cuda_advises_what_runs_on_the_cpu():
    for flags, says in (
        (dict(amp=True), "--amp on --cpu: fairseq's --amp is CUDA fp16 autocast, which on the CPU trains in plain "
         "fp32. Drop --amp, or use --task translation_deepinit --autocast-bf16"),
        (dict(fp16=True), "--fp16 on --cpu: fairseq's FP16Optimizer keeps its flat fp32 master weights"),
    ):  # fmt: skip
        with pytest.raises(errors.DeepInitConfigError) as info:
            launch.check_precision(_precision_cfg(**flags))
        assert says in str(info.value)
        assert "use --amp" not in str(info.value)  # fairseq's --amp trains in fp32 on the CPU: never advised
    launch.check_precision(_precision_cfg(fp16=True, fp16_no_flatten_grads=True))  # the advice that works
    launch.check_precision(_precision_cfg())


def _load_error(state: dict) -> Exception:
    """torch's error for ``state`` in a Linear(2, 3), inside fairseq's Trainer.load_checkpoint wrapping."""
    try:
        try:
            torch.nn.Linear(2, 3).load_state_dict(state, strict=True)
        except Exception:
            raise Exception("Cannot load model parameters from checkpoint c.pt")  # noqa: B904  (fairseq's, as it is)
    except Exception as e:
        return e
    raise AssertionError("loaded")


def test_torchs_state_dict_error_as_one_clause():
    good = torch.nn.Linear(2, 3).state_dict()
    assert model_load.weights_mismatch(_load_error({"weight": good["weight"]})) == "missing from it: bias"
    extra = _load_error({**good, "scale": torch.ones(1)})
    assert model_load.weights_mismatch(extra) == "not in the model: scale"
    shaped = _load_error({**good, "weight": torch.zeros(5, 5)})
    assert model_load.weights_mismatch(shaped) == "reshaped: weight [5, 5] in the file, [3, 2] in the model"
    assert model_load.weights_mismatch(KeyError("weight")) is None
    assert model_load.dictionary_sizes(shaped) is None  # not an embedding


def test_embeddings_of_another_dictionary_name_the_data():
    """A data folder binarised with another dictionary gives the model embeddings of another number of rows."""
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(56, 4)
    model.output_projection = torch.nn.Linear(4, 56, bias=False)
    state = {"embed_tokens.weight": torch.zeros(48, 4), "output_projection.weight": torch.zeros(48, 4)}
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        assert model_load.dictionary_sizes(e) == (48, 56)
        fairseq = RuntimeError("wrapped")
        fairseq.__context__ = e
        assert model_load.dictionary_sizes(fairseq) == (48, 56)
    state["output_projection.weight"] = torch.zeros(56, 5)  # another width: not a dictionary
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict(state)
    assert model_load.dictionary_sizes(info.value) is None


def test_the_z_loss_criterion_pair_resumes():
    from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

    def history(saved):
        return [{"criterion_name": saved, "optimizer_name": "FairseqAdam", "num_updates": 2}]

    task = SimpleNamespace(target_dictionary=SimpleNamespace(pad=lambda: 1))
    plain = LabelSmoothedCrossEntropyCriterion(task, False, 0.0)
    term = loss_terms.LabelSmoothedCrossEntropyZLossCriterion(task, False, 0.0)
    for saved, criterion in (("LabelSmoothedCrossEntropyCriterion", term),
                             ("LabelSmoothedCrossEntropyZLossCriterion", plain)):  # fmt: skip
        accepted = loss_terms.accepted_history(history(saved), criterion)
        assert accepted[-1]["criterion_name"] == type(criterion).__name__
        assert accepted[-1]["resumed_from_criterion"] == saved
    # another pair: fairseq's check, made one line at the trainer
    assert loss_terms.accepted_history(history("CrossEntropyCriterion"), term) is None
    assert loss_terms.accepted_history(history("LabelSmoothedCrossEntropyCriterion"), plain) is None


@pytest.fixture
def fresh_locks(monkeypatch):
    monkeypatch.setattr(run_lock, "_held", {})
    yield
    run_lock.release_all()


def test_the_lock_is_a_regular_file_and_never_a_link(tmp_path, fresh_locks):
    target = tmp_path / "target.txt"
    target.write_text("precious\n")
    cases = {"link": lambda p: p.symlink_to(target), "dangling": lambda p: p.symlink_to(tmp_path / "nosuch"),
             "folder": lambda p: p.mkdir(), "fifo": lambda p: os.mkfifo(p)}  # fmt: skip
    says = {"link": f"is a symbolic link (to {target}), and the lock is never written through a link",
            "dangling": f"is a symbolic link (to {tmp_path / 'nosuch'})", "folder": "is a folder",
            "fifo": "is not a regular file"}  # fmt: skip
    for name, make in cases.items():
        save = tmp_path / name
        save.mkdir()
        make(save / run_lock.LOCK_NAME)
        with pytest.raises(errors.CheckpointSaveError) as info:
            run_lock.acquire(str(save))
        assert str(info.value).startswith(
            f"--save-dir {save}: {save / run_lock.LOCK_NAME}, the file where a run records that it holds the "
            f"folder, {says[name]}"
        ) and str(info.value).endswith(". Move it out of the save folder and run again, or pass another --save-dir")
    assert target.read_text() == "precious\n" and not (tmp_path / "nosuch").exists()


# --- as a user runs them ----------------------------------------------------------------------------------------

DIMS = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
        "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2", "--share-all-embeddings"]  # fmt: skip
TRAIN = ["--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt", "--optimizer", "adam", "--lr",
         "1e-3", "--cpu", "--num-workers", "0", "--log-format", "simple", "--seed", "1", "--no-epoch-checkpoints",
         "--max-tokens", "500", "--disable-validation", "--max-update", "2", "--arch", "preln_iwslt_de_en",
         *DIMS]  # fmt: skip
GEN = ["--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt", "--cpu", "--max-tokens", "500"]
KEY = "encoder.layers.0.fc1.weight"


@pytest.fixture(scope="module")
def trained(synthetic_bin, tmp_path_factory):
    """One 2-update checkpoint (label_smoothed_cross_entropy) and its damaged copies: a tensor reshaped (a file
    for --path), a key too many (a save dir to resume)."""
    root = tmp_path_factory.mktemp("bad_input_more")
    run_cli("train", synthetic_bin, *TRAIN, "--criterion", "label_smoothed_cross_entropy", "--save-dir", root / "ok",
            forked=True)  # fmt: skip
    state = torch.load(root / "ok" / "checkpoint_last.pt", weights_only=False)
    model = state["model"]
    for name, changed in (("reshaped", {**model, KEY: torch.zeros(5, 5)}),
                          ("extra", {**model, "extra.weight": torch.zeros(3)})):  # fmt: skip
        (root / name).mkdir()
        torch.save({**state, "model": changed}, root / name / "checkpoint_last.pt")
    return root


def _copy(root, name):
    """A copy of the good save dir to resume in (without the lock file a forked run leaves)."""
    shutil.copytree(root / "ok", root / name, ignore=shutil.ignore_patterns(run_lock.LOCK_NAME))
    return root / name


def probes(root, data) -> dict:
    """name -> (tool, arguments, what the one line says). A case refused by the same code at the same point as
    one here or in tests/test_bad_input.py is checked in process (a key missing: the reshaped tensor's; --amp:
    --fp16's check_precision; --hc-streams: the resolution, as Mix-LN's; a folder at the lock path: the link's)."""
    target = root / "target.txt"
    target.write_text("precious\n")
    link = _copy(root, "link")
    (link / run_lock.LOCK_NAME).symlink_to(target)
    return {
        "generate_reshaped": ("generate", [data, *GEN, "--path", root / "reshaped" / "checkpoint_last.pt"],
                              f"holds weights that do not fit the model its own options build (reshaped: {KEY} "
                              "[5, 5] in the file, [32, 16] in the model): the file was changed after fairseq-train "
                              "wrote it"),
        "sampling_beam_2": ("generate", [data, *GEN, "--path", root / "ok" / "checkpoint_last.pt", "--sampling",
                            "--beam", "2"], "--sampling with --beam 2 draws 2 independent samples per sentence"),
        "resume_extra_key": ("train", [data, *TRAIN, "--max-update", "3", "--save-dir", root / "extra"],
                             "holds weights that do not fit the model this run builds (not in the model: "
                             "extra.weight)"),
        "resume_other_criterion": ("train", [data, *TRAIN, "--criterion", "cross_entropy", "--max-update", "3",
                                   "--save-dir", _copy(root, "other_criterion")],
                                   "was trained with --criterion label_smoothed_cross_entropy and this run uses "
                                   "--criterion cross_entropy, whose state fairseq does not carry over"),
        "lock_link": ("train", [data, *TRAIN, "--max-update", "3", "--save-dir", link], "is a symbolic link"),
    }  # fmt: skip


def _read_only(save, cmd: list) -> list | None:
    """``cmd`` run with ``save`` read-only: a read-only bind mount in a user namespace (root writes through file
    modes), or the folder's mode for another user; None where neither is possible."""
    if shutil.which("unshare") and subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0:
        mount = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
        return ["unshare", "-rm", "sh", "-c", mount, str(save), *cmd]
    if os.geteuid() != 0:
        save.chmod(0o555)
        return cmd
    return None


@pytest.mark.slow
def test_each_probe_is_one_line_and_what_works_works(trained, synthetic_bin):
    root, data = trained, synthetic_bin
    cases = probes(root, data)
    z_on = _copy(root, "z_on")
    finished = _copy(root, "finished")
    before = {p.name: p.read_bytes() for p in finished.iterdir()}
    ro_cmd = _read_only(finished, [sys.executable, "-m", "fairseq_cli.train", str(data), *map(str, TRAIN),
                                   "--save-dir", str(finished)])  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {n: pool.submit(run_cli, tool, *args, check=False, cwd=root) for n, (tool, args, _) in cases.items()}
        z = pool.submit(run_cli, "train", data, *TRAIN, "--criterion", loss_terms.CRITERION_NAME, "--z-loss",
                        "--max-update", "3", "--save-dir", z_on, check=False, cwd=root)  # fmt: skip
        ro = ro_cmd and pool.submit(subprocess.run, ro_cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, timeout=600)  # fmt: skip
        results = {n: f.result() for n, f in runs.items()}
        z, ro = z.result(), ro and ro.result()
    finished.chmod(0o755)
    failed = not_one_line(results, {name: case[2] for name, case in cases.items()})
    assert not failed, "\n\n".join(failed)
    assert (root / "target.txt").read_text() == "precious\n"  # the link's target is untouched
    # the z-loss term switched on at resume: it trains on from the checkpoint's optimizer state
    assert z.returncode == 0, z.stdout[-3000:]
    assert "LabelSmoothedCrossEntropyZLossCriterion: its loss terms store nothing" in z.stdout
    assert "num_updates 3" in z.stdout and "z_loss" in z.stdout
    if ro is None:
        pytest.skip("no read-only save dir can be made here (root without user namespaces)")
    assert ro.returncode == 0 and "training is already finished" in ro.stdout, ro.stdout[-3000:]
    assert errors.PREFIX not in ro.stdout and "Traceback" not in ro.stdout
    assert {p.name: p.read_bytes() for p in finished.iterdir()} == before
