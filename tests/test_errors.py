"""Bad input ends fairseq-train with one line, ``fairseq-deepinit: error: <message>``, and exit status 1:
no traceback, no "terminate called without an active exception" abort, nothing left behind or changed.

Unit tests for the pieces (:mod:`fairseq_deepinit.errors`, the profile checks of
:mod:`fairseq_deepinit.admin`), then the real CLI (``python -m fairseq_cli.train``, not the forked
runner: the excepthook and the interpreter's exit are what is tested) on each probe.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import USER_DIR, build_model, run_cli, tiny_batch
from fairseq_deepinit import admin, errors
from fairseq_deepinit.admin import profile_file
from fairseq_deepinit.errors import AutocastConfigError, DivergenceError, UnsafeCheckpointError

# ---------------------------------------------------------------------------------------------
# fairseq_deepinit.errors


class _SubclassElsewhere(errors.DeepInitConfigError):
    """A subclass defined outside the plugin is still a plugin error (its base is one)."""


@pytest.mark.parametrize(
    "exc",
    [
        errors.DeepInitConfigError("x"),
        errors.AdminConfigError("x"),
        errors.AdminNotProfiledError("x"),
        AutocastConfigError("x"),
        DivergenceError("x"),
        UnsafeCheckpointError("x"),
        errors.AdminExportError("x"),
        errors.CheckpointFileError("x"),
        errors.ConfigChangeError("x"),
        errors.CheckpointSaveError("x"),
        errors.DeepInitError("x"),
        _SubclassElsewhere("x"),
    ],
)
def test_plugin_errors_are_recognised(exc):
    assert errors.is_plugin_error(exc)


PLUGIN_ERROR_CLASSES = sorted(
    (c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, BaseException)),
    key=lambda c: c.__name__,
)


@pytest.mark.parametrize("cls", PLUGIN_ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_plugin_error_is_an_ordinary_exception_under_one_base(cls):
    """A library caller catches each with ``except Exception`` (CheckpointFileError and ConfigChangeError were
    SystemExit, which ended a program that called fairseq's loader on a damaged file)."""
    assert issubclass(cls, errors.DeepInitError) and issubclass(cls, Exception)
    assert not issubclass(cls, SystemExit)
    try:
        raise cls("what to change")
    except Exception as e:  # noqa: BLE001  (the point of the test)
        assert str(e) == "what to change" and errors.format_error(e) == errors.PREFIX + "what to change"


def test_the_kind_of_failure_is_kept():
    """Each keeps the built-in class that says what failed, for callers that catch those."""
    import pickle

    assert issubclass(errors.DeepInitConfigError, ValueError) and issubclass(errors.AdminConfigError, ValueError)
    assert issubclass(errors.DivergenceError, RuntimeError) and issubclass(errors.CheckpointFileError, RuntimeError)
    assert issubclass(errors.UnsafeCheckpointError, pickle.UnpicklingError)  # what torch raises for the same file
    assert issubclass(errors.CheckpointSaveError, OSError)
    assert issubclass(errors.ConfigChangeError, errors.CheckpointFileError)


@pytest.mark.parametrize(
    "exc", [ValueError("x"), RuntimeError("x"), FloatingPointError("x"), KeyboardInterrupt(), SystemExit(2)]
)
def test_other_errors_are_not(exc):
    assert not errors.is_plugin_error(exc)


def test_a_multi_line_message_is_joined_not_cut():
    exc = DivergenceError("divergence guard: stopped at update 5.\nFirst layer: encoder.layers.1.\n\nNo checkpoint.")
    assert errors.format_error(exc) == (
        "fairseq-deepinit: error: divergence guard: stopped at update 5. First layer: encoder.layers.1. No checkpoint."
    )


def _raised(exc: BaseException):
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001  (the hook receives whatever was raised)
        return type(e), e, e.__traceback__


def test_excepthook_prints_one_line_for_plugin_errors_only(capsys, monkeypatch):
    seen = []
    hook = errors._excepthook(lambda *info: seen.append(info[1]))
    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)
    hook(*_raised(errors.AdminConfigError("omega is bad; re-profile")))
    assert capsys.readouterr().err == "fairseq-deepinit: error: omega is bad; re-profile\n" and not seen
    other = RuntimeError("fairseq's own")
    hook(*_raised(other))
    assert seen == [other] and capsys.readouterr().err == ""  # fairseq's traceback, untouched
    monkeypatch.setenv(errors.TRACEBACK_ENV, "1")  # debugging: the traceback for plugin errors too
    plugin = errors.AdminConfigError("x")
    hook(*_raised(plugin))
    assert seen == [other, plugin]


def _wrapped(plugin: BaseException, outer: BaseException):
    """``outer`` raised while handling ``plugin``, as fairseq's ``except Exception: raise Exception(...)`` does."""
    try:
        try:
            raise plugin
        except Exception:  # noqa: BLE001
            raise outer  # noqa: B904  (fairseq's own pattern: the plugin error becomes the context)
    except BaseException as e:  # noqa: BLE001
        return type(e), e, e.__traceback__


def test_a_plugin_error_wrapped_by_fairseq_is_still_one_line(capsys, monkeypatch):
    """trainer.load_checkpoint: ``except Exception: raise Exception("Cannot load model parameters ...")``."""
    seen = []
    hook = errors._excepthook(lambda *info: seen.append(info[1]))
    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)
    plugin = errors.CheckpointFileError("checkpoint x is truncated")
    info = _wrapped(plugin, Exception("Cannot load model parameters from checkpoint x"))
    assert errors.plugin_error_in(info[1]) is plugin
    hook(*info)
    assert capsys.readouterr().err == "fairseq-deepinit: error: checkpoint x is truncated\n" and not seen
    interrupted = _wrapped(errors.DeepInitConfigError("x"), KeyboardInterrupt())
    hook(*interrupted)  # Ctrl-C is never reported as the error it interrupted
    assert seen == [interrupted[1]] and capsys.readouterr().err == ""
    assert errors.plugin_error_in(RuntimeError("fairseq's own")) is None


def test_training_that_diverged_in_fairseqs_trainer_is_one_line(capsys, monkeypatch):
    """fairseq's ``FloatingPointError("gradients are Nan/Inf")``, re-raised after its NanDetector re-run: one line
    that says what to change; any other FloatingPointError keeps its traceback."""
    seen = []
    hook = errors._excepthook(lambda *info: seen.append(info[1]))
    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)
    hook(*_raised(FloatingPointError("gradients are Nan/Inf")))
    err = capsys.readouterr().err
    assert err.startswith("fairseq-deepinit: error: training diverged: gradients are Nan/Inf (fairseq's trainer;")
    assert err.count("\n") == 1 and "Lower --lr" in err and "crash.pt" in err and not seen
    scaler = FloatingPointError("Minimum loss scale reached (0.0001). Your loss is probably exploding. Try ...")
    assert errors.divergence_in(scaler).startswith("training diverged: Minimum loss scale reached (0.0001).")
    workers = FloatingPointError("Fatal error: gradients are inconsistent between workers. Try --ddp-backend=legacy_"
                                 "ddp.\n" + "-" * 80 + "\nrank   0 = 1.0\n" + "-" * 80)  # fmt: skip
    assert errors.divergence_in(workers) == errors.divergence_in(workers).split("\n")[0]
    wrapped = _wrapped(FloatingPointError("gradients are Nan/Inf"), RuntimeError("while saving crash.pt"))
    assert errors.divergence_in(wrapped[1]) is not None
    numpy_own = FloatingPointError("overflow encountered in multiply")
    hook(*_raised(numpy_own))
    assert seen == [numpy_own] and capsys.readouterr().err == ""


def test_trainer_load_checkpoint_lets_plugin_errors_through(monkeypatch):
    """The wrapper of Trainer.load_checkpoint re-raises the plugin error that fairseq's handler wrapped; other
    failures keep fairseq's exception."""
    from fairseq.trainer import Trainer

    from fairseq_deepinit.checkpoints import model_load

    assert getattr(Trainer.load_checkpoint, "_deepinit_patch", False)  # patches.py wraps it with the function below
    plugin = errors.DeepInitConfigError("the checkpoint's options do not fit")

    def fairseq_load(self, filename, *args, **kwargs):  # the shape of trainer.py, lines 525-599
        try:
            raise kwargs.pop("inner")
        except Exception:  # noqa: BLE001
            raise Exception(f"Cannot load model parameters from checkpoint {filename}")  # noqa: B904

    with pytest.raises(errors.DeepInitConfigError) as info:
        model_load.trainer_load_checkpoint(fairseq_load, None, "c.pt", inner=plugin)
    assert info.value is plugin
    with pytest.raises(Exception, match="Cannot load model parameters from checkpoint c.pt"):
        model_load.trainer_load_checkpoint(fairseq_load, None, "c.pt", inner=KeyError("encoder.layers.0.weight"))


def test_importing_the_plugin_installs_the_hooks_once():
    assert getattr(sys.excepthook, "deepinit", False)
    before = sys.excepthook
    errors.install()
    assert sys.excepthook is before


def test_stop_batch_prefetching_ends_fairseq_prefetch_threads():
    """The abort's root cause: a BackgroundConsumer still collating when the interpreter exits."""
    from fairseq.data.iterators import BackgroundConsumer, BufferedIterator

    class Slow:
        """A batch source whose 'collation' takes a while, as --num-workers 0 collates in the thread."""

        def __len__(self) -> int:
            return 1000

        def __iter__(self):
            for i in range(1000):
                time.sleep(0.02)
                yield i

    blocked = BufferedIterator(2, list(range(1000)))  # fills its queue at once, then waits on put
    busy = BufferedIterator(2, Slow())  # mid-batch most of the time
    assert next(blocked) == 0 and next(busy) == 0
    threads = [t for t in threading.enumerate() if isinstance(t, BackgroundConsumer)]
    assert len([t for t in threads if t.is_alive()]) >= 2
    assert errors.stop_batch_prefetching(timeout=10) >= 2
    assert not any(t.is_alive() for t in threads)


# ---------------------------------------------------------------------------------------------
# profile files


@pytest.mark.parametrize("w", [1e-4, 0.5, 1, 1.0, 37.2, 1e4])
def test_omega_in_range_is_accepted(w):
    assert profile_file.check_omega("p.json", "encoder.layers.0.ffn", w) == float(w)


@pytest.mark.parametrize("w", [1e300, 2e4, 9e-5, 0.0, -1.0, float("inf"), float("nan"), "1.0", None, True])
def test_omega_outside_range_or_not_a_number_is_refused(w):
    with pytest.raises(errors.AdminConfigError) as info:
        profile_file.check_omega("p.json", "encoder.layers.1.ffn", w)
    msg = str(info.value)
    assert msg.startswith("Admin profile p.json: omega of encoder.layers.1.ffn is ") and "\n" not in msg
    assert "re-profile with --admin-profile-only" in msg


NAMES = ["encoder.layers.0.self_attn", "encoder.layers.0.ffn", "decoder.layers.0.self_attn", "decoder.layers.0.ffn"]


@pytest.mark.parametrize(
    "names, problem",
    [
        (NAMES[:2] + NAMES[3:], "missing decoder.layers.0.self_attn."),
        (NAMES + ["decoder.layers.9.ffn"], "unexpected decoder.layers.9.ffn."),
        (
            NAMES[:1] + ["encoder.layers.0.fnn"] + NAMES[2:],
            "missing encoder.layers.0.ffn; unexpected encoder.layers.0.fnn.",
        ),
        (NAMES + NAMES[:1], "repeated encoder.layers.0.self_attn."),
        (NAMES[1::-1] + NAMES[2:], "the same sub-layers in another order"),
    ],
)
def test_profile_rows_name_exactly_what_differs(names, problem):
    with pytest.raises(errors.AdminConfigError) as info:
        admin.check_profile_rows("p.json", names, NAMES)
    msg = str(info.value)
    assert msg.startswith("Admin profile p.json does not match this model's sub-layers: ") and problem in msg
    if "missing" in problem and "unexpected" not in problem:  # only the missing row is named, not the others
        assert all(n not in msg for n in NAMES if n not in problem)
    admin.check_profile_rows("p.json", list(NAMES), NAMES)  # the same rows: fine


def test_profile_destination_checks(tmp_path):
    (tmp_path / "folder").mkdir()
    with pytest.raises(errors.AdminConfigError, match="is a folder; give the profile's file name"):
        admin.check_profile_destination(str(tmp_path / "folder"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(errors.AdminConfigError, match=r"cannot be written: .*file is a file, not a folder"):
        admin.check_profile_destination(str(tmp_path / "file" / "sub" / "p.json"))
    admin.check_profile_destination(str(tmp_path / "new" / "deeper" / "p.json"))  # the folder is created...
    assert os.listdir(tmp_path / "new" / "deeper") == []  # ...and the probe file removed
    assert sorted(os.listdir(tmp_path)) == ["file", "folder", "new"]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_profile_destination(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(errors.AdminConfigError, match="cannot be written .*Permission denied"):
            admin.check_profile_destination(str(ro / "p.json"))
    finally:
        ro.chmod(0o755)


def test_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    path.write_text("old profile\n")

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(profile_file.os, "replace", fail)
    with pytest.raises(errors.AdminConfigError, match="cannot write the Admin profile to .*No space left on device"):
        admin.save_profile({"format": admin.PROFILE_FORMAT}, str(path))
    assert os.listdir(tmp_path) == ["p.json"] and path.read_text() == "old profile\n"  # nothing lost or left
    monkeypatch.undo()
    admin.save_profile({"format": admin.PROFILE_FORMAT}, str(path))
    assert os.listdir(tmp_path) == ["p.json"] and json.loads(path.read_text())["format"] == admin.PROFILE_FORMAT
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as a plain open() writes it (not mkstemp's 0600)


# ---------------------------------------------------------------------------------------------
# the real CLI, one subprocess per probe (two at a time)

DIMS = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2"]  # fmt: skip
# --num-workers 0 as the quickstart, the matrix and the tests use it: batches are collated in fairseq's
# prefetching thread itself, the set-up that aborted
# --max-update 2: a probe that is not refused (the old code) stops instead of training on
COMMON = ["--user-dir", USER_DIR, "-s", "src", "-t", "tgt", *DIMS, "--optimizer", "adam", "--lr", "1e-3",
          "--max-tokens", "600", "--cpu", "--num-workers", "0", "--no-epoch-checkpoints", "--log-format", "simple",
          "--seed", "1", "--max-update", "2"]  # fmt: skip
ADMIN = [*COMMON, "--task", "translation_admin", "--arch", "admin_iwslt_de_en"]


def _write_profiles(root: Path) -> None:
    """A real profile of the CLI's model (same depth and dims), and two broken copies of it."""
    model, _ = build_model("admin_iwslt_de_en", *DIMS)
    model.train()
    good = admin.profile_model(model, tiny_batch())
    huge = json.loads(json.dumps(good))
    huge["sublayers"][3]["omega"] = 1e300
    missing = json.loads(json.dumps(good))
    del missing["sublayers"][4]  # decoder.layers.0.self_attn
    for name, profile in (("huge", huge), ("missing", missing)):
        (root / f"{name}.json").write_text(json.dumps(profile))


def _files(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def probes(synthetic_bin, tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    _write_profiles(root)
    (root / "folder").mkdir()
    (root / "a_file").write_text("not a folder\n")
    resumed = root / "resumed"

    def train(save: str, *extra):
        return run_cli("train", synthetic_bin, *extra, "--save-dir", root / save, check=False, cwd=root, timeout=300)

    def profile_only_after_resume():
        run_cli("train", synthetic_bin, *ADMIN, "--save-dir", resumed, cwd=root)
        before = _files(resumed)
        proc = train("resumed", *ADMIN, "--admin-profile-only", "--admin-profile-path", root / "p_resumed.json")
        return SimpleNamespace(proc=proc, before=before, after=_files(resumed))

    jobs = {
        "translation_task": lambda: train("s_task", *COMMON, "--task", "translation", "--arch", "admin_iwslt_de_en"),
        "profile_into_folder": lambda: train(
            "s_folder", *ADMIN, "--admin-profile-only", "--admin-profile-path", root / "folder"
        ),
        "profile_under_file": lambda: train(
            "s_file", *ADMIN, "--admin-profile-only", "--admin-profile-path", root / "a_file" / "p.json"
        ),
        "norm_eps_inf": lambda: train("s_inf", *COMMON, "--arch", "postln_iwslt_de_en", "--norm-eps", "inf"),
        "norm_eps_nan": lambda: train("s_nan", *COMMON, "--arch", "postln_iwslt_de_en", "--norm-eps", "nan"),
        "omega_huge": lambda: train("s_huge", *ADMIN, "--admin-profile-path", root / "huge.json"),
        "row_missing": lambda: train("s_missing", *ADMIN, "--admin-profile-path", root / "missing.json"),
        "resumed": profile_only_after_resume,
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        out = SimpleNamespace(**{name: f.result() for name, f in futures.items()}, root=root)
    out.listing = sorted(p.name for p in root.iterdir())
    return out


def one_error_line(proc) -> str:
    """The run failed with status 1 and exactly one ``fairseq-deepinit: error:`` line, no traceback, no abort."""
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out and "terminate called" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith(errors.PREFIX)]
    assert len(lines) == 1, out[-3000:]
    return lines[0]


def test_admin_arch_under_the_translation_task(probes):
    line = one_error_line(probes.translation_task)
    assert "Admin's omega was never profiled" in line and "--task translation_admin" in line
    # raised by the first forward, before any update: nothing saved, no crash.pt
    assert "num_updates" not in probes.translation_task.stdout
    assert not (probes.root / "s_task").exists() or not list((probes.root / "s_task").iterdir())


def test_profile_only_into_a_save_dir_with_a_profiled_checkpoint(probes):
    r = probes.resumed
    line = one_error_line(r.proc)
    assert "--admin-profile-only: this run resumed from a checkpoint whose omega is already set" in line
    assert "Use an empty --save-dir" in line
    assert r.after == r.before and "crash.pt" not in r.after  # the save dir is left exactly as it was
    assert "p_resumed.json" not in probes.listing
    assert "Start iterating over samples" not in r.proc.stdout  # refused before the first batch


def test_profile_path_that_is_a_folder(probes):
    line = one_error_line(probes.profile_into_folder)
    assert f"--admin-profile-path {probes.root / 'folder'} is a folder; give the profile's file name" in line
    assert os.listdir(probes.root / "folder") == []
    assert "begin dry-run validation" not in probes.profile_into_folder.stdout  # at start-up, before any data


def test_profile_path_that_cannot_be_written(probes):
    line = one_error_line(probes.profile_under_file)
    assert f"{probes.root / 'a_file'} is a file, not a folder" in line
    assert "begin dry-run validation" not in probes.profile_under_file.stdout


def test_no_temporary_file_is_left_by_any_probe(probes):
    # what the probes' folder held before plus the save dirs fairseq creates at start-up, nothing else
    made = {"huge.json", "missing.json", "folder", "a_file", "resumed"}
    assert [n for n in probes.listing if n not in made and not n.startswith("s_")] == []


@pytest.mark.parametrize("which, value", [("norm_eps_inf", "inf"), ("norm_eps_nan", "nan")])
def test_norm_eps_must_be_finite(probes, which, value):
    line = one_error_line(getattr(probes, which))
    assert line == (
        f"fairseq-deepinit: error: --norm-eps must be a finite number greater than 0 (default 1e-5), got {value}; "
        "drop --norm-eps or give e.g. --norm-eps 1e-6"
    )


def test_profile_with_an_overflowing_omega(probes):
    line = one_error_line(probes.omega_huge)
    assert f"Admin profile {probes.root / 'huge.json'}: omega of encoder.layers.1.ffn is 1e+300, outside" in line


def test_profile_missing_one_row_names_it(probes):
    line = one_error_line(probes.row_missing)
    assert line == (
        f"fairseq-deepinit: error: Admin profile {probes.root / 'missing.json'} does not match this model's "
        "sub-layers: missing decoder.layers.0.self_attn. Re-profile this model with --admin-profile-only."
    )
