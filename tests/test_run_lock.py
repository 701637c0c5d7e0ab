"""One run per save folder, and a finished run that stays finished (fairseq_deepinit/checkpoints/run_lock.py).

In process: the lock (held, busy, released at exit, stale after a SIGKILL, the owner's pid/host when the
file system has no flock) and the finished-run rule. Then fairseq-train itself: a second run in a folder
that a live run holds is refused with one line before it reads or writes anything there; a finished run
run again says so, exits 0 and changes no file; a larger --max-update continues.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from conftest import USER_DIR, run_cli
from fairseq_deepinit import errors
from fairseq_deepinit.checkpoints import run_lock


@pytest.fixture
def fresh_locks(monkeypatch):
    """This process holds no save dir at the start and gives up what the test took at its end."""
    monkeypatch.setattr(run_lock, "_held", {})
    yield
    run_lock.release_all()


def test_held_busy_and_released(tmp_path, fresh_locks, monkeypatch):
    assert run_lock.acquire(str(tmp_path)) is True
    assert run_lock.acquire(str(tmp_path)) is False  # already this process's
    owner = run_lock.read_owner(run_lock.lock_path(str(tmp_path)))
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname() and owner["command"]
    # another run (here: a second open file description of this process, which flock treats like one)
    monkeypatch.setattr(run_lock, "_held", {})
    with pytest.raises(errors.SaveDirBusyError) as info:
        run_lock.acquire(str(tmp_path))
    line = errors.format_error(info.value)
    assert f"--save-dir {tmp_path} is in use by another run (pid {os.getpid()} on host" in line
    assert "Wait for it to end, stop it, or pass another --save-dir" in line and "\n" not in line


@pytest.mark.slow
def test_released_at_exit_and_stale_after_a_kill(tmp_path, fresh_locks, caplog):
    """Two child processes (the plugin imported through conftest's PYTHONPATH): one ends normally, one is killed."""
    code = (
        "from fairseq_deepinit.checkpoints import run_lock; import sys, time; run_lock.acquire(sys.argv[1]); "
        "print('held', flush=True); time.sleep(float(sys.argv[2]))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path), "0"], capture_output=True, text=True)
    assert done.returncode == 0 and not os.path.exists(run_lock.lock_path(str(tmp_path)))  # removed at exit
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), "60"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    with pytest.raises(errors.SaveDirBusyError, match=f"pid {proc.pid} on host"):
        run_lock.acquire(str(tmp_path))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert os.path.exists(run_lock.lock_path(str(tmp_path)))  # a kill leaves the file ...
    with caplog.at_level("WARNING"):
        assert run_lock.acquire(str(tmp_path)) is True  # ... and the lock with it: stale, taken over
    assert f"taking over the lock left by a run that has ended (pid {proc.pid} on host" in caplog.text


@pytest.mark.slow  # starts a Python process as the lock's recorded owner
def test_without_flock_the_recorded_owner_decides(tmp_path, fresh_locks, monkeypatch):
    monkeypatch.setattr(run_lock, "fcntl", None)
    path = run_lock.lock_path(str(tmp_path))

    def recorded(**owner):
        with open(path, "w") as f:
            json.dump({"pid": os.getppid(), "host": socket.gethostname(), "started": "then", **owner}, f)

    recorded()  # a live process of this host
    with pytest.raises(errors.SaveDirBusyError, match=f"pid {os.getppid()}"):
        run_lock.acquire(str(tmp_path))
    recorded(host="elsewhere")  # another host: cannot be checked, so held until the file is deleted
    with pytest.raises(errors.SaveDirBusyError, match=f"if that run has ended, delete {path}"):
        run_lock.acquire(str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    recorded(pid=int(dead.stdout))  # a process of this host that has ended
    assert run_lock.acquire(str(tmp_path)) is True
    assert run_lock.read_owner(path)["pid"] == os.getpid()


@pytest.mark.parametrize(
    "updates, max_update, reset, finished",
    [(3, 3, False, True), (4, 3, False, True), (2, 3, False, False), (3, 0, False, False), (3, 3, True, False)],
)
def test_finished_rule(updates, max_update, reset, finished):
    if finished:
        with pytest.raises(SystemExit) as info:
            run_lock.check_not_finished("ckpt/checkpoint_last.pt", updates, max_update, reset)
        assert info.value.code == 0
    else:
        run_lock.check_not_finished("ckpt/checkpoint_last.pt", updates, max_update, reset)


TRAIN = [
    "--user-dir", USER_DIR, "--task", "translation", "-s", "src", "-t", "tgt", "--arch", "postln_iwslt_de_en",
    "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
    "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2",
    "--decoder-attention-heads", "2", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--cpu",
    "--num-workers", "0", "--disable-validation", "--no-epoch-checkpoints", "--log-format", "simple", "--seed", "1",
]  # fmt: skip


@pytest.mark.slow
def test_fairseq_train_in_a_busy_save_dir_is_refused(synthetic_bin, tmp_path, fresh_locks):
    save = tmp_path / "ckpt"
    save.mkdir()
    run_lock.acquire(str(save))  # a live run (this process) holds the folder
    proc = run_cli("train", synthetic_bin, *TRAIN, "--max-update", "2", "--save-dir", save, check=False)
    assert proc.returncode == 1, proc.stdout[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ": error: " in ln]
    assert len(lines) == 1 and lines[0].startswith(f"{errors.PREFIX}--save-dir {save} is in use by another run (pid "
                                                   f"{os.getpid()} on host"), proc.stdout[-3000:]  # fmt: skip
    assert "Traceback" not in proc.stdout
    assert sorted(p.name for p in save.iterdir()) == [run_lock.LOCK_NAME]  # nothing read, removed or written


@pytest.mark.slow
def test_a_finished_run_run_again_changes_nothing(synthetic_bin, tmp_path):
    save = tmp_path / "ckpt"
    run_cli("train", synthetic_bin, *TRAIN, "--max-update", "3", "--save-dir", save, forked=True)
    # (a forked run ends with os._exit, which skips the removal of its lock file: flock released, file left)
    before = {p.name: p.read_bytes() for p in save.iterdir() if p.name != run_lock.LOCK_NAME}
    assert list(before) == ["checkpoint_last.pt"]
    again = run_cli("train", synthetic_bin, *TRAIN, "--max-update", "3", "--save-dir", save, check=False)
    assert again.returncode == 0, again.stdout[-3000:]
    assert (
        f"training is already finished: {save}/checkpoint_last.pt holds 3 updates and --max-update is 3, so nothing "
        "was trained or written. Pass a larger --max-update to train on"
    ) in again.stdout
    assert "num_updates=" not in again.stdout and "Saved checkpoint" not in again.stdout
    assert {p.name: p.read_bytes() for p in save.iterdir()} == before  # and its own lock file removed at exit
    more = run_cli("train", synthetic_bin, *TRAIN, "--max-update", "5", "--save-dir", save, "--log-interval", "1",
                   forked=True).stdout  # fmt: skip
    assert "num_updates=4" in more and "num_updates=5" in more
