"""Nothing lost when a run is killed (fairseq_deepinit/resume.py).

The atomic copy in-process (and SIGKILLed in a child), then real fairseq-train runs: killed in the
middle of the checkpoint_last.pt copy and resumed, killed at random moments during saves and
resumed every time, resumed from a truncated / empty / random checkpoint_last.pt, refused when the
architecture changes; and the one-line error of every tool that reads a damaged checkpoint.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY_DIMS, USER_DIR, run_cli
from fairseq_deepinit import errors
from fairseq_deepinit.checkpoints import atomic, config_check, integrity, resume

ARCH = "postln_iwslt_de_en"


def train_cmd(data: Path, save_dir: Path, max_update: int, *extra: str, arch: str = ARCH) -> list:
    return [
        data, "--user-dir", USER_DIR, "--arch", arch, *TINY_DIMS, "--task", "translation", "-s", "src", "-t", "tgt",
        "--optimizer", "adam", "--lr", "1e-3", "--criterion", "cross_entropy", "--max-tokens", "1000",
        "--max-update", max_update, "--save-dir", save_dir, "--save-interval-updates", "2", "--no-epoch-checkpoints",
        "--disable-validation", "--log-format", "simple", "--log-interval", "1", "--seed", "1", "--cpu",
        "--num-workers", "0", *extra,
    ]  # fmt: skip


def train(data: Path, save_dir: Path, max_update: int, *extra: str, check: bool = True, **kw):
    return run_cli("train", *train_cmd(data, save_dir, max_update, *extra, **kw), check=check)


def loaded_updates(log: str) -> int | None:
    m = re.search(r"Loaded checkpoint (\S+) \(epoch \d+ @ (\d+) updates\)", log)
    return int(m.group(2)) if m else None


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit status 1, no traceback, and the last output line is the error naming ``needles``."""
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(errors.PREFIX), proc.stdout[-3000:]  # "fairseq-deepinit: error: "
    for n in needles:
        assert n in last, last
    return last


@pytest.fixture(scope="module")
def trained(synthetic_bin, tmp_path_factory) -> Path:
    """5 updates, a save every 2: checkpoint_1_2.pt, checkpoint_1_4.pt and checkpoint_last.pt (5 updates)."""
    save = tmp_path_factory.mktemp("resume") / "ckpt"
    log = train(synthetic_bin, save, 5).stdout
    assert "No existing checkpoint found" in log  # a first launch starts fresh, as in fairseq
    assert sorted(p.name for p in save.iterdir()) == ["checkpoint_1_2.pt", "checkpoint_1_4.pt", "checkpoint_last.pt"]
    return save


def copy_run(trained: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(trained, dst)
    return dst


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 3])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "random":
        path.write_bytes(random.Random(0).randbytes(len(data)))
    elif how == "missing":
        path.unlink()
    else:
        raise ValueError(how)


# --------------------------------------------------------------------------------------------
# the atomic copy
# --------------------------------------------------------------------------------------------


def test_installed_on_import():
    from fairseq import checkpoint_utils
    from fairseq.file_io import PathManager

    assert checkpoint_utils.PathManager is atomic.AtomicCopyPathManager
    assert checkpoint_utils.load_checkpoint is resume.load_checkpoint
    assert checkpoint_utils.load_checkpoint_to_cpu is resume.load_checkpoint_to_cpu
    assert PathManager.copy is not atomic.AtomicCopyPathManager.copy  # the rest of fairseq is untouched


def test_atomic_copy_replaces_and_leaves_no_temporaries(tmp_path, monkeypatch):
    src, dst = tmp_path / "checkpoint_1_2.pt", tmp_path / "checkpoint_last.pt"
    src.write_bytes(os.urandom(3 << 20))
    dst.write_bytes(b"old")
    assert atomic.AtomicCopyPathManager.copy(str(src), str(dst), overwrite=True) is True
    assert dst.read_bytes() == src.read_bytes()
    assert atomic.atomic_copy(src, dst, overwrite=False) is False  # PathManager.copy's contract
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1_2.pt", "checkpoint_last.pt"]

    # an error in the middle of the copy: the target keeps its old content, no temporary is left
    dst.write_bytes(b"old")

    def fail_halfway(inp, out, length=0):
        out.write(inp.read(1 << 20))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.shutil, "copyfileobj", fail_halfway)
    with pytest.raises(OSError, match="No space left"):
        atomic.atomic_copy(src, dst, overwrite=True)
    assert dst.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1_2.pt", "checkpoint_last.pt"]


COPY_CHILD = """
import sys
from fairseq_deepinit.checkpoints.atomic import atomic_copy
atomic_copy(sys.argv[1], sys.argv[2], overwrite=True)
"""


def test_atomic_copy_killed_midway_keeps_the_old_file(tmp_path):
    """SIGKILL a process in the middle of atomic_copy: the target is untouched, the stale temporary is cleaned."""
    fifo, dst = tmp_path / "checkpoint_1_4.pt", tmp_path / "checkpoint_last.pt"
    os.mkfifo(fifo)
    dst.write_bytes(b"previous checkpoint")
    child = subprocess.Popen([sys.executable, "-c", COPY_CHILD, str(fifo), str(dst)], cwd=Path(USER_DIR).parent)
    try:
        with open(fifo, "wb") as w:  # blocks until the child opens the source
            w.write(os.urandom(2 << 20))  # half of the "checkpoint"; the child is now waiting for more
            w.flush()
            deadline = time.time() + 60
            while not atomic.stale_temporaries(tmp_path) and time.time() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)
            child.send_signal(signal.SIGKILL)
            child.wait()
    finally:
        child.kill()
    assert child.returncode == -signal.SIGKILL
    assert dst.read_bytes() == b"previous checkpoint"
    stale = atomic.stale_temporaries(tmp_path)
    assert len(stale) == 1 and os.path.getsize(stale[0]) > 0  # the kill landed mid-copy
    assert atomic.remove_stale_temporaries(tmp_path) == stale
    assert atomic.stale_temporaries(tmp_path) == []


def test_inspect_checkpoint_tells_damage_from_refusal(trained, tmp_path):
    last = trained / "checkpoint_last.pt"
    st = integrity.inspect_checkpoint(last, deep=True)
    assert st.ok and st.num_updates == 5 and st.model_args.arch == ARCH
    for how, reason in (("truncated", "is truncated"), ("empty", "is empty"), ("random", "is not a torch checkpoint")):
        bad = tmp_path / f"{how}.pt"
        shutil.copy(last, bad)
        damage(bad, how)
        st = integrity.inspect_checkpoint(bad)
        assert st.damaged and st.reason.startswith(reason), st
    assert integrity.inspect_checkpoint(tmp_path / "nope.pt").missing

    # an unexpected pickled class is torch's weights_only refusal, not damage: fairseq's error stays
    state = torch.load(last)
    state["extra_state"]["payload"] = Smuggled()
    tampered = tmp_path / "tampered.pt"
    torch.save(state, tampered)
    st = integrity.inspect_checkpoint(tampered)
    assert st.refused and not st.damaged
    from fairseq import checkpoint_utils

    with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
        checkpoint_utils.load_checkpoint_to_cpu(str(tampered))
    with pytest.raises(errors.CheckpointFileError, match=re.escape(str(tmp_path / "truncated.pt"))):
        checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "truncated.pt"))


class Smuggled:
    """A class nobody allow-lists."""


# --------------------------------------------------------------------------------------------
# killed runs
# --------------------------------------------------------------------------------------------


def test_kill_during_checkpoint_last_copy_then_resume(synthetic_bin, tmp_path):
    """SIGKILL fairseq-train while it copies checkpoint_1_2.pt to checkpoint_last.pt; the next run resumes.

    The test hook slows the copy down (0.5 s per MiB) so that the kill lands inside it every time.
    Stock fairseq would leave a partial checkpoint_last.pt (here: the temporary file) and, with no
    checkpoint_last.pt, silently start again from update 0.
    """
    save = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", atomic.TEST_HOOK_SLOW_COPY_ENV: "0.5"}
    cmd = [sys.executable, "-m", "fairseq_cli.train", *map(str, train_cmd(synthetic_bin, save, 50))]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if any(".checkpoint_last.pt." in p for p in atomic.stale_temporaries(save)):
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    names = sorted(p.name for p in save.iterdir())
    assert "checkpoint_1_2.pt" in names and "checkpoint_last.pt" not in names, names
    assert any(n.startswith(".checkpoint_last.pt.") for n in names), names  # killed inside the copy

    log = train(synthetic_bin, save, 6).stdout
    assert re.search(r"resuming from \S+checkpoint_1_2\.pt \(2 updates\).*checkpoint_last\.pt does not exist", log)
    assert loaded_updates(log) == 2
    assert "removed 1 temporary file(s) of an interrupted checkpoint save" in log
    assert integrity.inspect_checkpoint(save / "checkpoint_last.pt").num_updates == 6
    assert atomic.stale_temporaries(save) == []


def kill_state(save: Path) -> str:
    """Where a kill interrupted the save, read from what it left in ``save``."""
    if any(".deepinit-tmp" in p for p in atomic.stale_temporaries(save)):
        return "in a copy"
    if atomic.stale_temporaries(save):
        return "in fairseq's torch.save"
    last = integrity.inspect_checkpoint(save / "checkpoint_last.pt")
    steps = [integrity.inspect_checkpoint(p).num_updates or 0 for p in save.glob("checkpoint_*_*.pt")]
    if not last.ok or (steps and max(steps) > last.num_updates):
        return "between the save and its copy"
    return "outside a save"


def test_random_kills_during_saves_always_resume(synthetic_bin, tmp_path):
    """Kill fairseq-train at random moments during its saves (one every update), resume after each kill.

    No test hook: wider FFNs give a 10 MB checkpoint so that the save takes a while, and the kill
    comes 0-150 ms after a random "Preparing to save checkpoint" line. Every resume must load a
    checkpoint (never start again from 0, never fail) and never go back before the previous resume.
    ``RESUME_KILLS`` sets the number of kills (default 6).
    """
    rng = random.Random(12)
    save = tmp_path / "ckpt"
    kills, states, loaded = int(os.environ.get("RESUME_KILLS", "6")), [], []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    wide = ("--encoder-ffn-embed-dim", "2048", "--decoder-ffn-embed-dim", "2048")
    extra = (*wide, "--save-interval-updates", "1", "--keep-interval-updates", "3")
    cmd = [sys.executable, "-m", "fairseq_cli.train", *map(str, train_cmd(synthetic_bin, save, 10_000, *extra))]
    for i in range(kills):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines, target, saves = [], rng.randint(1, 3), 0
        try:
            for line in proc.stdout:
                lines.append(line)
                if "Preparing to save checkpoint" in line:
                    saves += 1
                    if saves == target:
                        time.sleep(rng.uniform(0.0, 0.15))
                        proc.send_signal(signal.SIGKILL)
                        break
        finally:
            proc.kill()
            proc.wait()
            proc.stdout.close()
        log = "".join(lines)
        assert "Traceback" not in log and "error:" not in log, log[-3000:]
        if i > 0:
            n = loaded_updates(log)
            assert n is not None, log[-3000:]  # resumed, never a fresh start
            assert n >= (loaded[-1] if loaded else 0)
            loaded.append(n)
        states.append(kill_state(save))
    log = train(synthetic_bin, save, (loaded[-1] if loaded else 0) + 2, *wide).stdout
    assert loaded_updates(log) is not None and atomic.stale_temporaries(save) == []
    counts = {s: states.count(s) for s in sorted(set(states))}
    print(f"{kills} kills, where they landed: {counts}; updates loaded by the resumes: {loaded}")


# --------------------------------------------------------------------------------------------
# damaged checkpoint_last.pt: fall back to the newest intact checkpoint
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["truncated", "empty", "random"])
def test_resume_falls_back_from_damaged_last(trained, synthetic_bin, tmp_path, how):
    save = copy_run(trained, tmp_path)
    damage(save / "checkpoint_last.pt", how)
    if how == "random":
        # the older file is the newest on disk and fails too: the choice is by saved updates, not mtime
        os.utime(save / "checkpoint_1_2.pt")
        damage(save / "checkpoint_1_4.pt", "truncated")
    log = train(synthetic_bin, save, 6).stdout
    want = "checkpoint_1_2.pt (2 updates)" if how == "random" else "checkpoint_1_4.pt (4 updates)"
    lines = [ln for ln in log.splitlines() if "resuming from" in ln]
    assert len(lines) == 1 and want in lines[0] and "checkpoint_last.pt is " in lines[0], log[-3000:]
    if how == "random":
        assert "skipped checkpoint_1_4.pt, which is truncated" in lines[0]
    assert loaded_updates(log) == int(want.split("(")[1].split()[0])
    assert integrity.inspect_checkpoint(save / "checkpoint_last.pt").num_updates == 6


def test_no_intact_checkpoint_is_a_one_line_error(trained, synthetic_bin, tmp_path):
    save = copy_run(trained, tmp_path)
    for name in ("checkpoint_last.pt", "checkpoint_1_2.pt", "checkpoint_1_4.pt"):
        damage(save / name, "truncated")
    last = assert_one_line_error(train(synthetic_bin, save, 6, check=False), str(save / "checkpoint_last.pt"))
    assert "no other checkpoint in" in last and "is intact" in last and "checkpoint_1_4.pt is truncated" in last
    for name in ("checkpoint_1_2.pt", "checkpoint_1_4.pt"):
        (save / name).unlink()
    last = assert_one_line_error(train(synthetic_bin, save, 6, check=False), "holds no other checkpoint")
    assert "Delete it to start training from scratch" in last


def test_damaged_explicit_restore_file_is_a_one_line_error(trained, synthetic_bin, tmp_path):
    bad = tmp_path / "given.pt"
    shutil.copy(trained / "checkpoint_1_4.pt", bad)
    damage(bad, "empty")
    proc = train(synthetic_bin, tmp_path / "new", 6, "--restore-file", str(bad), check=False)
    assert_one_line_error(proc, str(bad), "is empty")


# --------------------------------------------------------------------------------------------
# damaged checkpoints passed to the other tools
# --------------------------------------------------------------------------------------------


def test_generate_with_damaged_path_is_a_one_line_error(trained, synthetic_bin, tmp_path):
    bad = tmp_path / "checkpoint_best.pt"
    shutil.copy(trained / "checkpoint_last.pt", bad)
    damage(bad, "truncated")
    proc = run_cli(
        "generate", synthetic_bin, "--user-dir", USER_DIR, "--path", bad, "-s", "src", "-t", "tgt", "--cpu",
        "--gen-subset", "test", check=False,
    )  # fmt: skip
    assert_one_line_error(proc, str(bad), "is truncated", "intact checkpoint")


TOOL_MODULES = {"export_admin": "fairseq_deepinit.admin.export", "diagnose": "fairseq_deepinit.diagnostics.diagnose"}


@pytest.mark.parametrize("tool", sorted(TOOL_MODULES))
def test_plugin_tools_with_damaged_checkpoint(synthetic_bin, tmp_path, tool):
    bad = tmp_path / "checkpoint_last.pt"
    bad.write_bytes(random.Random(1).randbytes(4096))
    args = [str(bad), str(tmp_path / "plain.pt")] if tool == "export_admin" else [
        str(synthetic_bin), "--checkpoint", str(bad), "--output-dir", str(tmp_path / "diag")]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", TOOL_MODULES[tool], *args],
        cwd=Path(USER_DIR).parent,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert_one_line_error(proc, str(bad), "is not a torch checkpoint")


# --------------------------------------------------------------------------------------------
# a different model configuration on resume
# --------------------------------------------------------------------------------------------


def test_arch_change_on_resume_is_refused_then_allowed(trained, synthetic_bin, tmp_path):
    save = copy_run(trained, tmp_path)
    proc = train(synthetic_bin, save, 6, arch="deepnorm_iwslt_de_en", check=False)
    last = assert_one_line_error(proc, str(save / "checkpoint_last.pt"), "--allow-config-change")
    for diff in (f"--arch {ARCH} -> deepnorm_iwslt_de_en", "--init-scheme xavier -> deepnorm", "--residual-scale none"):
        assert diff in last, last
    assert loaded_updates(proc.stdout) is None and "num_updates" not in proc.stdout  # stopped before training

    log = train(synthetic_bin, save, 6, "--allow-config-change", arch="deepnorm_iwslt_de_en").stdout
    assert re.search(r"WARNING .*--arch \S+ -> deepnorm_iwslt_de_en.*continuing because of --allow-config-change", log)
    assert loaded_updates(log) == 5


def test_config_differences_cover_every_axis():
    from conftest import build_model

    _, base = build_model(ARCH, *TINY_DIMS)
    same = config_check.config_differences(base, build_model(ARCH, *TINY_DIMS)[1])
    assert same == []
    cases = {
        ("--encoder-normalize-before",): "encoder_normalize_before",
        ("--norm-type", "rmsnorm"): "norm_type",
        ("--decoder-layers", "3"): "decoder_layers",
        ("--encoder-embed-dim", "32"): "encoder_embed_dim",
        ("--decoder-layer-type", "matt"): "decoder_layer_type",
        ("--init-scheme", "lipschitz"): "init_scheme",
    }
    for flags, option in cases.items():
        other = build_model(ARCH, *TINY_DIMS, *flags)[1]
        names = [d[0] for d in config_check.config_differences(base, other)]
        assert option in names, (flags, names)
