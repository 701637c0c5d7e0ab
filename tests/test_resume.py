"""Nothing lost when a run is killed or a save fails (fairseq_deepinit/checkpoints/).

The atomic copy in-process (and SIGKILLed in a child), then real fairseq-train runs: killed in the
middle of the checkpoint_last.pt copy and resumed (from the newest intact checkpoint, whichever file
it is), killed at random moments during saves and resumed every time, resumed from a truncated /
empty / random checkpoint_last.pt, saving onto a file system that fills up (a small tmpfs) or past
the file size limit, refused when the architecture changes or a given checkpoint does not exist;
hostile checkpoints of every payload kind refused with one line that names the global; and the
one-line error of every tool that reads a damaged or hostile checkpoint, while a library caller
catches the same errors with ``except Exception``.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import io
import os
import pickle
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
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


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str, prefix: str = errors.PREFIX) -> str:
    """Exit status 1, no traceback, exactly one error line, the last one, naming ``needles``; ``prefix``:
    ``fairseq-deepinit: error: `` (fairseq's commands) or the plugin's own command's (docs/usage.md)."""
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(prefix), proc.stdout[-3000:]
    assert [ln for ln in proc.stdout.splitlines() if ": error: " in ln] == [last], proc.stdout[-3000:]
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
    for name in ("load_checkpoint", "load_checkpoint_to_cpu"):  # wrapped by patches.py around fairseq's own
        patched = getattr(checkpoint_utils, name)
        assert (
            getattr(patched, "_deepinit_patch", False) and patched.__wrapped__.__module__ == checkpoint_utils.__name__
        )
        assert callable(getattr(resume, name))
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


@pytest.mark.slow
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

    name = f"{Smuggled.__module__}.Smuggled"
    assert st.refused_globals == [name] and name in st.reason
    # the plugin's one line, also a pickle.UnpicklingError like torch's own refusal
    with pytest.raises(pickle.UnpicklingError, match=rf"{re.escape(str(tampered))} was refused .*pickles {name}"):
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


def test_kill_during_the_copy_of_a_later_save_resumes_from_the_newer_file(synthetic_bin, tmp_path):
    """The issue's case: killed while the save of update 4 is copied to checkpoint_last.pt (which holds 2).

    checkpoint_1_4.pt (and checkpoint_best.pt, copied before checkpoint_last.pt) hold 4 updates and
    are intact; the resume must load 4 updates, not the older checkpoint_last.pt, and say why.
    """
    save = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", atomic.TEST_HOOK_SLOW_COPY_ENV: "0.3"}
    args = [a for a in map(str, train_cmd(synthetic_bin, save, 50)) if a != "--disable-validation"]
    cmd = [sys.executable, "-m", "fairseq_cli.train", *args, "--validate-interval-updates", "2"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            copying_last = any(".checkpoint_last.pt." in p for p in atomic.stale_temporaries(save))
            if copying_last and (save / "checkpoint_1_4.pt").exists():
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    updates = {p.name: integrity.inspect_checkpoint(p).num_updates for p in save.glob("*.pt")}
    assert updates["checkpoint_last.pt"] == 2 and updates["checkpoint_1_4.pt"] == 4, updates
    assert updates["checkpoint_best.pt"] in (2, 4), updates  # 4 when update 4 validated better

    log = train(synthetic_bin, save, 6).stdout
    lines = [ln for ln in log.splitlines() if "resuming from" in ln]
    assert len(lines) == 1, log[-3000:]
    assert re.search(
        r"WARNING .*resuming from \S+/checkpoint_(1_4|best)\.pt \(4 updates\), the newest intact checkpoint, "
        r"because \S+/checkpoint_last\.pt holds only 2 updates",
        lines[0],
    ), lines[0]
    assert loaded_updates(log) == 4
    assert integrity.inspect_checkpoint(save / "checkpoint_last.pt").num_updates == 6


def test_the_newest_intact_file_wins_whatever_its_name(trained, tmp_path):
    """The choice itself: most saved updates first, whatever the file (here an epoch checkpoint's name); a tie
    goes to checkpoint_last.pt, the file fairseq itself loads; damaged files are skipped."""
    save = copy_run(trained, tmp_path)
    shutil.copy(save / "checkpoint_1_2.pt", save / "checkpoint_last.pt")  # last: 2 updates, checkpoint_1_4: 4
    shutil.copy(save / "checkpoint_1_4.pt", save / "checkpoint7.pt")  # another name, also 4, written last
    last = str(save / "checkpoint_last.pt")

    def newest() -> tuple:
        found = [integrity.inspect_checkpoint(p) for p in integrity.checkpoint_candidates(save)]
        chosen, rejected = integrity.newest_intact(found, prefer=last)
        return os.path.basename(chosen.path), chosen.num_updates, sorted(os.path.basename(s.path) for s in rejected)

    assert newest() == ("checkpoint7.pt", 4, [])  # of the two with 4 updates, the newest file
    damage(save / "checkpoint7.pt", "truncated")
    assert newest() == ("checkpoint_1_4.pt", 4, ["checkpoint7.pt"])
    shutil.copy(save / "checkpoint_1_4.pt", save / "checkpoint_last.pt")
    os.utime(save / "checkpoint_1_4.pt")  # newer on disk, the same updates: checkpoint_last.pt still wins
    assert newest() == ("checkpoint_last.pt", 4, ["checkpoint7.pt"])


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
    # past the newest checkpoint (the last killed run may have saved beyond what it loaded): a run whose
    # checkpoint already holds --max-update updates is finished and loads nothing (checkpoints/run_lock.py)
    newest = max(integrity.inspect_checkpoint(p).num_updates or 0 for p in integrity.checkpoint_candidates(save))
    log = train(synthetic_bin, save, newest + 2, *wide).stdout
    assert loaded_updates(log) is not None and atomic.stale_temporaries(save) == []
    counts = {s: states.count(s) for s in sorted(set(states))}
    print(f"{kills} kills, where they landed: {counts}; updates loaded by the resumes: {loaded}")


# --------------------------------------------------------------------------------------------
# saves that fail: one line, no temporary file, the previous checkpoints kept
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def small_file_system(folder: Path, size: int):
    """A tmpfs of ``size`` bytes mounted at ``folder`` (needs CAP_SYS_ADMIN: root here), unmounted after."""
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); test_file_size_limit covers a failed save")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def leftovers(save: Path) -> list:
    """Temporary files of any save (fairseq's ``.pt.tmp``, the atomic copy's) and fairseq's ``dummy``."""
    return [p.name for p in save.iterdir() if p.name.endswith((".tmp", atomic.TMP_SUFFIX)) or p.name == "dummy"]


@pytest.mark.parametrize("where", ["write", "copy"])
def test_full_disk_is_one_line_and_keeps_the_previous_checkpoints(trained, synthetic_bin, tmp_path, where):
    """A tmpfs that fills up during the save of update 4: in fairseq's torch.save of checkpoint_1_4.pt
    ("write": room for the first save's two files and half a third), or in its copy to checkpoint_last.pt
    ("copy": room for three files and half a fourth, the copy's temporary file). Before: five chained
    OSError tracebacks, fairseq's checkpoint_1_4.pt.tmp left behind."""
    size = (trained / "checkpoint_last.pt").stat().st_size  # the same model and options as these runs
    files = {"write": 2, "copy": 3}[where]
    with small_file_system(tmp_path / "fs", files * size + size // 2) as save:
        proc = train(synthetic_bin, save, 6, check=False)
        last = assert_one_line_error(proc, "No space left on device (ENOSPC)", "free space there or pass another")
        failed = "checkpoint_1_4.pt" if where == "write" else "checkpoint_last.pt"
        assert f"cannot write checkpoint {save / failed}: " in last
        newest = "checkpoint_last.pt (2 updates)" if where == "write" else "checkpoint_1_4.pt (4 updates)"
        assert f"resumes from the newest, {newest}" in last
        assert "Saved checkpoint" in proc.stdout  # the save of update 2 went through
        assert leftovers(save) == [], sorted(os.listdir(save))
        kept = {p.name: integrity.inspect_checkpoint(p, deep=True) for p in save.iterdir()}
        assert all(st.ok for st in kept.values()), kept
        want = {"checkpoint_1_2.pt": 2, "checkpoint_last.pt": 2}
        if where == "copy":
            want["checkpoint_1_4.pt"] = 4
        assert {n: st.num_updates for n, st in kept.items()} == want
        if where == "copy":  # room again: the resume takes the newer checkpoint_1_4.pt, not checkpoint_last.pt
            subprocess.run(["mount", "-o", f"remount,size={8 * size}", str(save)], check=True)
            log = train(synthetic_bin, save, 6).stdout
            assert "checkpoint_last.pt holds only 2 updates" in log and loaded_updates(log) == 4
            assert integrity.inspect_checkpoint(save / "checkpoint_last.pt").num_updates == 6


def _limit_file_size(limit: int):
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: writes get EFBIG

    return preexec


def test_file_size_limit_is_one_line_and_leaves_nothing(trained, synthetic_bin, tmp_path):
    """``ulimit -f`` below a checkpoint's size (no privilege needed): the first save fails with EFBIG."""
    save = tmp_path / "ckpt"
    limit = (trained / "checkpoint_last.pt").stat().st_size // 2
    cmd = [sys.executable, "-m", "fairseq_cli.train", *map(str, train_cmd(synthetic_bin, save, 4))]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
        preexec_fn=_limit_file_size(limit),
    )  # fmt: skip
    last = assert_one_line_error(proc, f"cannot write checkpoint {save / 'checkpoint_1_2.pt'}: File too large (EFBIG)")
    assert "(ulimit -f): raise that limit" in last and "starts from scratch" in last
    assert os.listdir(save) == []


def test_unwritable_save_dir_is_one_line(synthetic_bin, tmp_path):
    (tmp_path / "a_file").write_text("not a folder\n")
    save = tmp_path / "a_file" / "ckpt"
    proc = train(synthetic_bin, save, 2, check=False)
    assert_one_line_error(proc, f"--save-dir {save} cannot be written (Not a directory", "Pass a --save-dir")
    assert "Start iterating over samples" not in proc.stdout  # at start-up, before any training


# --------------------------------------------------------------------------------------------
# checkpoints named on the command line that do not exist
# --------------------------------------------------------------------------------------------


def test_missing_given_checkpoints_are_one_line(synthetic_bin, tmp_path):
    """A --restore-file, --continue-once or --finetune-from-model that does not exist stops the run (fairseq
    trained from scratch with exit status 0, or, for the last, ended in a ValueError traceback); the default
    checkpoint_last.pt may be missing (a first launch, tested by ``trained``)."""
    nope = tmp_path / "nope.pt"
    runs = {flag: (flag, str(nope)) for flag in ("--restore-file", "--continue-once", "--finetune-from-model")}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            flag: pool.submit(train, synthetic_bin, tmp_path / flag.strip("-"), 2, *extra, check=False)
            for flag, extra in runs.items()
        }
        for flag, future in futures.items():
            proc = future.result()
            assert_one_line_error(proc, f"{flag} {nope} does not exist")
            assert "num_updates" not in proc.stdout, flag  # nothing trained
            assert not list((tmp_path / flag.strip("-")).glob("*.pt")), flag


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


TOOL_MODULES = {
    "export_admin": "fairseq_deepinit.admin.export",  # deepinit-export-admin
    "export_admin_lm": "fairseq_deepinit.lm.export",  # deepinit-export-admin-lm
    "diagnose": "fairseq_deepinit.diagnostics.diagnose",  # deepinit-diagnose
}


def error_prefix(cmd: str) -> str:
    """The one-line error's start: the plugin's own commands name themselves, fairseq's the plugin."""
    return f"deepinit-{cmd.replace('_', '-')}: error: " if cmd in TOOL_MODULES else errors.PREFIX


def run_tool(tool: str, *args: str) -> subprocess.CompletedProcess:
    """The plugin's console script ``tool`` through its ``main``, the command-line boundary the entry
    point calls (``sys.exit(main())``): its return value is the exit status, what it prints to stdout
    and stderr the output (in process, as tests/test_probes.py calls the tools: no interpreter start)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = importlib.import_module(TOOL_MODULES[tool]).main(list(args))
        except SystemExit as e:  # argparse's own errors
            code = e.code
    return subprocess.CompletedProcess([tool, *args], code, stdout=out.getvalue())


@pytest.fixture(scope="module")
def unreadable_runs(trained, synthetic_bin, tmp_path_factory) -> dict:
    """Every command on a damaged and on a hostile checkpoint, two at a time: {(command, kind): (path, proc)}."""
    root = tmp_path_factory.mktemp("unreadable")
    marker = root / "payload-ran"
    files = {"hostile": hostile(trained, root / "hostile.pt", payloads(marker)["posix.system"])}
    files["damaged"] = root / "damaged.pt"
    files["damaged"].write_bytes(random.Random(1).randbytes(4096))

    def command(cmd: str, kind: str) -> subprocess.CompletedProcess:
        path = str(files[kind])
        out = root / f"{cmd}-{kind}"
        if cmd == "train":
            out.mkdir()
            shutil.copy(path, out / "checkpoint_last.pt")
            return train(synthetic_bin, out, 6, check=False)
        if cmd == "generate":
            return run_cli(
                "generate", synthetic_bin, "--user-dir", USER_DIR, "--path", path, "-s", "src", "-t", "tgt", "--cpu",
                "--gen-subset", "test", check=False,
            )  # fmt: skip
        if cmd == "diagnose":
            return run_tool(cmd, str(synthetic_bin), "--checkpoint", path, "--output-dir", str(out))
        return run_tool(cmd, path, str(out) + ".pt")

    # fairseq's commands as subprocesses, two at a time; the plugin's tools in process meanwhile
    # (damaged files for fairseq's: test_no_intact_checkpoint_is_a_one_line_error and
    # test_generate_with_damaged_path_is_a_one_line_error)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {(c, "hostile"): pool.submit(command, c, "hostile") for c in ("train", "generate")}
        runs = {(c, k): (files[k], command(c, k)) for c in TOOL_MODULES for k in ("hostile", "damaged")}
        runs.update({job: (files[job[1]], f.result()) for job, f in futures.items()})
    assert not marker.exists()
    return runs


@pytest.mark.parametrize("cmd", ["train", "generate", *sorted(TOOL_MODULES)])
def test_hostile_checkpoint_is_one_line_everywhere(unreadable_runs, cmd):
    path, proc = unreadable_runs[(cmd, "hostile")]
    if cmd == "train":
        path = Path(proc.args[proc.args.index("--save-dir") + 1]) / "checkpoint_last.pt"
    line = assert_one_line_error(proc, prefix=error_prefix(cmd))
    assert_refusal(line[len(error_prefix(cmd)) :], path, "posix.system")
    if cmd == "train":
        assert "Move it out of --save-dir" in line
    assert "weights_only" not in proc.stdout.replace("torch.load(weights_only=True)", "")  # no hint of torch's
    assert "Loaded checkpoint" not in proc.stdout


@pytest.mark.parametrize("cmd", sorted(TOOL_MODULES))
def test_plugin_tools_with_damaged_checkpoint(unreadable_runs, cmd):
    path, proc = unreadable_runs[(cmd, "damaged")]
    needles = (f"checkpoint {path} is not a torch checkpoint", "Use an intact checkpoint")
    assert_one_line_error(proc, *needles, prefix=error_prefix(cmd))


# --------------------------------------------------------------------------------------------
# hostile checkpoints: refused, one line naming the global, nothing run
# --------------------------------------------------------------------------------------------


class Payload:
    """Pickles as a call of ``func(*args)``: what a hostile checkpoint smuggles in (``__reduce__``)."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def payloads(marker: Path) -> dict:
    """Each payload kind, keyed by the global it pickles; any of them, run, would create ``marker``."""
    return {
        "posix.system": Payload(os.system, f"touch {marker}"),
        "subprocess.Popen": Payload(subprocess.Popen, ["touch", str(marker)]),
        "subprocess.check_output": Payload(subprocess.check_output, ["touch", str(marker)]),
        "builtins.exec": Payload(builtins.exec, f"open({str(marker)!r}, 'w').close()"),
        "builtins.eval": Payload(builtins.eval, f"open({str(marker)!r}, 'w').close()"),
        "importlib.import_module": Payload(importlib.import_module, "this_module_does_not_exist"),
    }


def hostile(trained: Path, dst: Path, payload, legacy: bool = False) -> Path:
    """A real fairseq checkpoint with ``payload`` in its extra state, in torch's zip or legacy format."""
    state = torch.load(trained / "checkpoint_last.pt")
    state["extra_state"]["payload"] = payload
    torch.save(state, dst, _use_new_zipfile_serialization=not legacy)
    return dst


# torch's hint ("Re-running `torch.load` with `weights_only` set to `False` ...") and the old wording
ASKS_TO_TURN_THE_CHECK_OFF = re.compile(r"weights_only`?( set to `?|=)False|damaged", re.IGNORECASE)


def assert_refusal(message: str, path: Path, names: str) -> None:
    assert "\n" not in message, message
    assert f"checkpoint {path} was refused (nothing in it was run): it pickles {names}, which" in message, message
    assert not ASKS_TO_TURN_THE_CHECK_OFF.search(message), message


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
@pytest.mark.parametrize("name", sorted(payloads(Path("m"))))
def test_hostile_checkpoint_is_refused_naming_the_global(trained, tmp_path, name, fmt):
    """Every payload kind in both formats: inspection, fairseq's loader and the tools' loader refuse it with one
    line naming the global (torch 2.13 words posix.system "unsupported GLOBAL ... whose module posix is blocked",
    drops the module of builtins and reads subprocess as Python 2's "commands"), and nothing ran."""
    from fairseq import checkpoint_utils

    marker = tmp_path / "payload-ran"
    path = hostile(trained, tmp_path / f"{fmt}.pt", payloads(marker)[name], legacy=fmt == "legacy")
    assert ("zip" if zipfile.is_zipfile(path) else "legacy") == fmt
    st = integrity.inspect_checkpoint(path)
    assert st.refused and not st.damaged and st.refused_globals == [name], st
    caught = None
    try:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    except Exception as e:  # a library caller catches it: no SystemExit
        caught = e
    assert isinstance(caught, errors.UnsafeCheckpointError) and isinstance(caught, errors.DeepInitError)
    assert caught.__cause__ is None and caught.__suppress_context__  # torch's hint is not chained in
    assert_refusal(str(caught), path, name)
    with pytest.raises(errors.UnsafeCheckpointError) as info:
        integrity.torch_load_checked(path, map_location="cpu")  # deepinit-export-admin(-lm)'s loader
    assert_refusal(str(info.value), path, name)
    assert not marker.exists()


def test_every_refused_global_is_named(trained, tmp_path):
    """torch stops at the first; a static scan of the zip's pickle names the others too (nothing executed)."""
    from fairseq_deepinit.checkpoints import compat

    marker = tmp_path / "payload-ran"
    kinds = payloads(marker)
    path = hostile(trained, tmp_path / "two.pt", [kinds["posix.system"], kinds["subprocess.Popen"]])
    assert integrity.inspect_checkpoint(path).refused_globals == ["posix.system", "subprocess.Popen"]
    with pytest.raises(errors.UnsafeCheckpointError) as info:
        integrity.raise_if_unreadable(path)
    assert_refusal(str(info.value), path, "posix.system, subprocess.Popen")
    with pytest.raises(errors.UnsafeCheckpointError) as info:  # the static check gives the same line
        compat.check_checkpoint(path)
    assert_refusal(str(info.value), path, "posix.system, subprocess.Popen")
    assert not marker.exists()


def test_library_caller_catches_plugin_errors(trained, tmp_path):
    """fairseq's loader on a damaged file, from Python: an ordinary exception (a SystemExit before, which ended
    the calling program); the class says what went wrong and the message is the command line's."""
    from fairseq import checkpoint_utils

    bad = tmp_path / "checkpoint_last.pt"
    shutil.copy(trained / "checkpoint_last.pt", bad)
    damage(bad, "truncated")
    for exc_type in (errors.CheckpointFileError, errors.DeepInitError, RuntimeError, Exception):
        with pytest.raises(exc_type, match=rf"checkpoint {re.escape(str(bad))} is truncated"):
            checkpoint_utils.load_checkpoint_to_cpu(str(bad))
    assert not issubclass(errors.CheckpointFileError, SystemExit)


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
    assert re.search(r"INFO .*resuming from \S+/checkpoint_last\.pt \(5 updates\), the newest intact checkpoint", log)
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


def test_config_check_covers_every_method_option_by_construction():
    """Every option of every method record that a resume must keep is checked, without a hand-kept list;
    those the issue found missing are among them, and a change of one stops the resume."""
    from conftest import build_model
    from fairseq_deepinit import options

    kept = {o.name for o, _m in options.all_options() if o.resume}
    assert kept <= set(config_check.CHECKED_OPTIONS)
    for name in ("deepnorm_variant", "subln", "scale_attn", "scale_fc", "scale_heads", "scale_resids",
                 "admin_formula", "admin_output_change", "b2t_init_rescale", "matt_share_v", "fixnorm"):  # fmt: skip
        assert name in config_check.CHECKED_OPTIONS, name
    # settings that do not change the model may change on resume
    assert not {"attention_impl", "admin_profile_path", "force_norm_with_scheme"} & set(config_check.CHECKED_OPTIONS)
    _, paper = build_model("deepnorm_iwslt_de_en", *TINY_DIMS)
    _, released = build_model("deepnorm_iwslt_de_en", *TINY_DIMS, "--deepnorm-variant", "torchscale")
    assert [d[0] for d in config_check.config_differences(paper, released)] == ["deepnorm_variant"]
    _, pre = build_model("preln_iwslt_de_en", *TINY_DIMS)
    _, normformer = build_model("preln_iwslt_de_en", *TINY_DIMS, "--scale-attn")
    assert [d[0] for d in config_check.config_differences(pre, normformer)] == ["scale_attn"]
