"""NumPy data in checkpoints (fairseq_deepinit/checkpoints/numpy_data.py): fairseq's ``--eval-bleu`` keeps its BLEU
n-gram counts as numpy arrays in the metrics state of every checkpoint.

Numeric arrays and scalars load as they were saved, through every loader of the plugin (fairseq's
``load_checkpoint_to_cpu``, the integrity check, the tools' loader, the resume broadcast), without widening
torch's process-wide allow-list; an object, structured, string or datetime dtype, a dtype whose state numpy
never writes (flags that claim Python objects), an array whose bytes do not fit its shape, ``numpy.ndarray``
called directly, and payloads beside or inside numpy data are refused with the one-line refusal that names
them, and nothing of them runs. The slow test trains with ``--eval-bleu`` and generates, diagnoses, exports
and resumes from its best checkpoint.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copyreg
import io
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.distributed import utils as distributed_utils
from test_launch import broadcast_buffer, receive

from conftest import USER_DIR, run_cli
from fairseq_deepinit import errors
from fairseq_deepinit.checkpoints import compat, integrity, numpy_data

FIXTURE = Path(__file__).with_name("fixtures") / "v010" / "postln.pt"
NUMPY_GLOBALS = ["numpy._core.multiarray._reconstruct", "numpy.dtype", "numpy.ndarray"]


class Reduces:
    """Pickles as ``func(*args)``, optionally followed by a BUILD with ``state``: a hand-written pickle."""

    def __init__(self, func, args, state=None) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


class NewObj:
    """Pickles as NEWOBJ: ``cls.__new__(cls, *args)`` without ``__init__`` (``__class__`` passes pickle's check)."""

    def __init__(self, cls, *args) -> None:
        self.cls, self.args = cls, args

    @property
    def __class__(self):
        return self.cls

    def __reduce__(self):
        return copyreg.__newobj__, (self.cls, *self.args)


def forged_dtype(flags: int) -> Reduces:
    """``np.dtype('i8')`` whose pickled state sets its internal flags: ``dtype.__setstate__`` takes them."""
    return Reduces(np.dtype, ("i8", False, True), (3, "<", None, None, None, -1, -1, flags))


def forged_array(state: tuple) -> Reduces:
    return Reduces(np._core.multiarray._reconstruct, (np.ndarray, (0,), b"b"), state)


def with_extra(tmp_path: Path, name: str, **extra) -> Path:
    """The 0.1.0 postln fixture (a real fairseq checkpoint) with ``extra`` in its extra state."""
    state = torch.load(FIXTURE)
    state["extra_state"].update(extra)
    path = tmp_path / name
    torch.save(state, path)
    return path


def bleu_meters() -> collections.OrderedDict:
    """fairseq's metrics state as ``--eval-bleu`` leaves it (AverageMeter state dicts of numpy counts)."""
    counts = {"val": np.array([16, 2, 0, 0]), "sum": np.array([30, 3, 0, 0]), "count": 2, "round": None}
    totals = {"val": np.array([649, 619, 590, 561]), "sum": np.array([1399, 1339, 1280, 1221]), "count": 2}
    return collections.OrderedDict(valid=[(0, "_bleu_counts", "AverageMeter", counts),
                                          (1, "_bleu_totals", "AverageMeter", totals)])  # fmt: skip


def numeric_values() -> dict:
    shared = np.arange(3, dtype=np.int16)
    return {
        "int64": np.array([16, 2, 0, 0]),
        "fortran": np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
        "big_endian": np.array([1.5, -2.25], dtype=">f8"),
        "bool": np.array([True, False]),
        "zero_d": np.array(3.5),
        "complex": np.array([1 + 2j], dtype=np.complex64),
        "half": np.array([0.5], dtype=np.float16),
        "scalars": (np.float64(1.5), np.int32(-7), np.True_, np.uint64(2**63)),
        "dtype": np.dtype(">u4"),
        "shared": [shared, shared],
        "in_set": {np.int8(4)},
        "in_namespace": argparse.Namespace(x=np.ones(2)),
        "as_key": {np.int64(5): "five"},
        "every_dtype": [
            np.arange(3).astype(np.dtype(c).newbyteorder(o)) for c in sorted(numpy_data.NUMERIC_CODES) for o in "<>"
        ],
    }


def assert_same(a, b) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.dtype.str == b.dtype.str and a.shape == b.shape  # str: with the byte order
        assert a.flags.f_contiguous == b.flags.f_contiguous and b.flags.writeable
        assert np.array_equal(a, b)
    elif isinstance(a, (np.generic, np.dtype)):
        assert a == b and getattr(a, "dtype", a) == getattr(b, "dtype", b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, argparse.Namespace):
        assert_same(vars(a), vars(b))
    else:
        assert a == b


def test_numeric_arrays_and_scalars_load_as_they_were_saved(tmp_path):
    values = numeric_values()
    path = tmp_path / "numeric.pt"
    torch.save({"model": {"w": torch.ones(2)}, "values": values}, path)
    before = set(torch.serialization.get_safe_globals())
    loaded = numpy_data.load(path, map_location="cpu")["values"]
    assert_same(values, loaded)
    assert loaded["shared"][0] is loaded["shared"][1]  # shared in the file, shared after
    assert set(torch.serialization.get_safe_globals()) == before  # the stand-ins were on the list for the load only
    # outside the plugin's loaders torch decides as without the plugin: numpy's globals are refused
    with pytest.raises(Exception, match=r"numpy\._core\.multiarray\._reconstruct"):
        torch.load(path)


def test_a_load_without_numpy_data_is_untouched(tmp_path):
    state = {"model": {"w": torch.ones(2)}, "x": [1, (2, 3)]}
    sentinel = object()
    assert numpy_data.loading(lambda: sentinel) is sentinel
    torch.save(state, tmp_path / "plain.pt")
    assert numpy_data.load(tmp_path / "plain.pt")["x"] == [1, (2, 3)]


def test_loads_nest_and_keep_the_stand_ins_until_the_outer_one_ends(tmp_path):
    path = tmp_path / "n.pt"
    torch.save({"a": np.arange(2)}, path)

    def outer():
        inner = numpy_data.load(path)["a"]
        again = torch.load(path)["a"]  # the outer load's stand-ins are still on the list: a record, restored after
        return inner, again

    inner, again = numpy_data.loading(outer)
    assert_same(inner, np.arange(2))
    assert_same(again, np.arange(2))


def test_an_eval_bleu_checkpoint_loads_in_every_loader_of_the_plugin(tmp_path):
    metrics = bleu_meters()
    path = with_extra(tmp_path, "checkpoint_best.pt", metrics=metrics)
    assert sorted(compat.pickled_globals(path)) == ["argparse.Namespace", *NUMPY_GLOBALS]
    assert compat.disallowed_globals(path) == []
    compat.check_checkpoint(path)
    st = integrity.inspect_checkpoint(path, deep=True)
    assert st.ok and st.num_updates is not None, st
    state = checkpoint_utils.load_checkpoint_to_cpu(str(path))  # resume's and fairseq-generate's loader
    assert_same(metrics, state["extra_state"]["metrics"])
    assert_same(metrics, integrity.torch_load_checked(path, map_location="cpu")["extra_state"]["metrics"])  # tools


def test_the_resume_broadcast_takes_numpy_data(monkeypatch, tmp_path):
    path = with_extra(tmp_path, "checkpoint_last.pt", metrics=bleu_meters())
    state = checkpoint_utils.load_checkpoint_to_cpu(str(path))  # rank 0
    got = receive(monkeypatch, broadcast_buffer(state), distributed_utils._broadcast_object_slow)  # rank 1
    # fairseq's broadcast hands dicts over as plain dicts (its _split_tensors_from_obj); the arrays arrive as saved
    assert_same(list(state["extra_state"]["metrics"].values()), list(got["extra_state"]["metrics"].values()))


def refused_cases(marker: Path) -> dict:
    """What a checkpoint may not hold, with the names of the refusal; a payload would create ``marker``."""
    touch = Reduces(os.system, (f"touch {marker}",))
    return {
        "object": (np.array([1, "x"], dtype=object), "numpy.dtype('O8')"),
        "structured": (np.zeros(2, dtype=[("a", "i8"), ("b", "f4")]), "numpy.dtype('V12')"),
        "string": (np.array(["ab"]), "numpy.dtype('U2')"),
        "datetime": (np.array(["2020-01-01"], dtype="M8[D]"), "numpy.dtype('M8')"),
        "flags": (forged_array((1, (1,), forged_dtype(1), False, b"A" * 8)),
                  "numpy.dtype('i8') with the state (3, '<', None, None, None, -1, -1, 1)"),
        "short": (forged_array((1, (4,), np.dtype("i8"), False, b"A" * 8)),
                  "a numpy array of dtype '<i8' and shape (4,) from 8 bytes"),
        "ndarray_called": (Reduces(np.ndarray, ((2,),)), "numpy.ndarray((2,),) called"),
        "dtype_by_newobj": (NewObj(np.dtype, "i8"), "numpy.dtype()"),  # the stand-in's __init__ skipped
        "empty": (np.zeros((0, 3)), "builtins.bytes"),  # torch.save writes b"" as bytes(), which torch refuses
        "payload_in_object_array": (np.array([touch], dtype=object), "posix.system"),
        "payload_beside_numbers": ([np.arange(3), touch], "posix.system"),
    }  # fmt: skip


def assert_refusal(message: str, path: Path, names: str) -> None:
    assert "\n" not in message, message
    assert f"checkpoint {path} was refused (nothing in it was run): it pickles {names}, which" in message, message
    assert "numpy arrays and scalars of numeric dtypes only" in message, message
    assert not re.search(r"weights_only`?( set to `?|=)False", message), message


@pytest.mark.parametrize("case", sorted(refused_cases(Path("m"))))
def test_other_numpy_data_and_payloads_are_refused_naming_them(tmp_path, case):
    marker = tmp_path / "payload-ran"
    value, names = refused_cases(marker)[case]
    path = with_extra(tmp_path, f"{case}.pt", metrics=value)
    before = set(torch.serialization.get_safe_globals())
    st = integrity.inspect_checkpoint(path)
    assert st.refused and st.refused_globals == [names], st
    with pytest.raises(errors.UnsafeCheckpointError) as info:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert_refusal(str(info.value), path, names)
    with pytest.raises(errors.UnsafeCheckpointError) as info:
        integrity.torch_load_checked(path, map_location="cpu")
    assert_refusal(str(info.value), path, names)
    with pytest.raises(errors.UnsafeCheckpointError) as info:
        compat.check_checkpoint(path)
    assert_refusal(str(info.value), path, names)
    assert not marker.exists()
    assert set(torch.serialization.get_safe_globals()) == before


def test_numpy_trusts_a_pickled_dtype_state():
    """Why numpy's own unpickling is not allow-listed: the pickle sets a dtype's internal flags (an int64 dtype
    that claims to hold Python objects); the stand-ins refuse that state (test above)."""
    dt = np.dtype("i8", False, True)
    dt.__setstate__(forged_dtype(1).state)
    assert dt.hasobject and dt.kind == "i"


# --------------------------------------------------------------------------------------------
# a real --eval-bleu run
# --------------------------------------------------------------------------------------------

TINY = ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
        "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
        "--encoder-layers", "2", "--decoder-layers", "2"]  # fmt: skip


def eval_bleu_train(data: Path, save: Path, max_update: int, check: bool = True):
    return run_cli(
        "train", data, "--user-dir", USER_DIR, "--arch", "postln_iwslt_de_en", *TINY, "--task", "translation",
        "-s", "src", "-t", "tgt", "--optimizer", "adam", "--lr", "1e-3", "--criterion", "cross_entropy",
        "--max-tokens", "2000", "--max-update", str(max_update), "--save-interval-updates", "2",
        "--no-epoch-checkpoints", "--save-dir", save, "--eval-bleu", "--eval-bleu-args",
        '{"beam": 1, "max_len_a": 1.2, "max_len_b": 10}', "--best-checkpoint-metric", "bleu",
        "--maximize-best-checkpoint-metric", "--log-format", "simple", "--seed", "1", "--cpu", "--num-workers", "0",
        check=check,
    )  # fmt: skip


def generate(data: Path, path: Path, check: bool = True):
    return run_cli(
        "generate", data, "--user-dir", USER_DIR, "--path", path, "-s", "src", "-t", "tgt", "--cpu", "--gen-subset",
        "valid", "--beam", "1", "--required-batch-size-multiple", "1", check=check,
    )  # fmt: skip


@pytest.mark.slow
def test_eval_bleu_run_generates_diagnoses_exports_and_resumes_from_its_best_checkpoint(synthetic_bin, tmp_path):
    from fairseq_deepinit.diagnostics import diagnose
    from fairseq_deepinit.export import cli as export_cli

    save = tmp_path / "ckpt"
    log = eval_bleu_train(synthetic_bin, save, 4).stdout
    assert re.search(r"valid on 'valid' subset .*\| bleu [\d.]+ ", log), log[-2000:]
    best = save / "checkpoint_best.pt"
    # what --eval-bleu adds to the checkpoint: exactly numpy's array globals (torch's static scan)
    assert sorted(compat.pickled_globals(best)) == ["argparse.Namespace", *NUMPY_GLOBALS]
    metrics = checkpoint_utils.load_checkpoint_to_cpu(str(best))["extra_state"]["metrics"]
    counts = [m for m in metrics["valid"] if m[1] == "_bleu_counts"][0][3]
    assert type(counts["sum"]) is np.ndarray and counts["sum"].dtype == np.int64 and counts["sum"].shape == (4,)

    out = generate(synthetic_bin, best).stdout
    assert re.search(r"Generate valid with beam=1: BLEU4 = [\d.]+", out), out[-2000:]

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = diagnose.main([str(synthetic_bin), "--checkpoint", str(best), "--output-dir", str(tmp_path / "diag"),
                              "--measure", "grad", "--num-batches", "1"])  # fmt: skip
    assert code in (0, None) and (tmp_path / "diag" / "diagnostics.json").exists()
    stock = tmp_path / "stock.pt"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert export_cli.main([str(best), str(stock), "--to", "fairseq"]) == 0  # checked against the model
    assert not set(NUMPY_GLOBALS) & set(compat.pickled_globals(stock))  # the export writes no metrics

    log = eval_bleu_train(synthetic_bin, save, 6).stdout
    assert re.search(r"Loaded checkpoint \S+checkpoint_last\.pt \(epoch \d+ @ 4 updates\)", log), log[-2000:]
    assert "num_updates 6" in log

    # the same file with an object array in its metrics: one line, nothing loaded
    tampered = tmp_path / "tampered.pt"
    state = torch.load(best, weights_only=False)  # the test's own file
    state["extra_state"]["metrics"]["valid"][0] = np.array([1, "x"], dtype=object)
    torch.save(state, tampered)
    proc = generate(synthetic_bin, tampered, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stdout, proc.stdout[-2000:]
    assert_refusal(proc.stdout.strip().splitlines()[-1].removeprefix(errors.PREFIX), tampered, "numpy.dtype('O8')")
    shutil.rmtree(save)
