"""Two CPU ranks (gloo) started by torchrun with the documented command: killed and resumed, a frozen rank.

- A 2-rank run SIGKILLed in the middle of a save (the copy to ``checkpoint_last.pt``, slowed by the
  test hook) and run again with the same command resumes: rank 0 reads the newest intact checkpoint
  and hands the state to rank 1 (fairseq's broadcast, :mod:`fairseq_deepinit.checkpoints.broadcast`),
  and the run ends with the checkpoint of the same run never interrupted, bit for bit (weights,
  optimizer state, update count). A translation family (Admin, whose omega and profiled flags travel
  in the state) and a language-model family, each with a DDP backend that runs on the CPU:
  ``legacy_ddp`` / ``no_c10d`` and ``pytorch_ddp`` (its GPU ``device_ids`` dropped for CPU modules,
  :mod:`fairseq_deepinit.training.launch`).
- The command is plain ``torchrun --nproc_per_node 2 fairseq-train ... --distributed-backend gloo``:
  world size, rank and ``env://`` come from torchrun's environment (one model across the ranks: the
  two ranks' batches are summed into each update's ``wpb``).
- Two ranks stopped inside epoch 2 (gated attention with ``legacy_ddp``; hyper-connections with
  ``pytorch_ddp`` and ``--update-freq 2``) and resumed end with the uninterrupted run's checkpoint, bit for
  bit (:mod:`fairseq_deepinit.checkpoints.batch_order`); that checkpoint resumed on one process logs the
  world-size change in one line and trains on.
- A rank frozen with SIGSTOP ends the other within ``--heartbeat-timeout`` with one line.

Each run is d=16, 2+2 layers (2 layers for the LM), 4 updates: seconds, most of it the two imports.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, USER_DIR, run_cli
from fairseq_deepinit.checkpoints import atomic

pytestmark = pytest.mark.slow
TIMEOUT = 180

DECODER = ["--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2",
           "--decoder-layers", "2"]  # fmt: skip
ENCODER = ["--encoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2",
           "--encoder-layers", "2", "--share-all-embeddings"]  # fmt: skip
COMMON = [
    "--user-dir", USER_DIR, "--optimizer", "adam", "--lr", "1e-3", "--cpu", "--num-workers", "0",
    "--disable-validation", "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "1",
    "--seed", "1", "--distributed-backend", "gloo", "--dropout", "0.1", *DECODER,
]  # fmt: skip
TRANSLATION = ["-s", "src", "-t", "tgt", *ENCODER, "--max-tokens", "300"]
FAMILIES = {
    "admin_translation": ["--task", "translation_admin", "--arch", "admin_iwslt_de_en", *TRANSLATION],
    "preln_lm": ["--task", "language_modeling", "--arch", "preln_lm_tiny", "--tokens-per-sample", "16",
                 "--max-tokens", "128"],
}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(*args: str) -> list:
    """``torchrun --nproc_per_node 2 fairseq-train args...`` as docs/usage.md writes it (a free port)."""
    exe = Path(sys.executable)
    runner = (
        [str(exe.with_name("torchrun"))]
        if exe.with_name("torchrun").exists()
        else [str(exe), "-m", "torch.distributed.run"]
    )
    train = exe.with_name("fairseq-train")
    target = [str(train)] if train.exists() else ["-m", "fairseq_cli.train"]
    return [*runner, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            *target, *map(str, args)]  # fmt: skip


def start(args: list, cwd: Path, env: dict | None = None) -> subprocess.Popen:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full.get("PYTHONPATH")]))
    return subprocess.Popen(torchrun_command(*args), cwd=cwd, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip


def workers(proc: subprocess.Popen) -> dict:
    """``{rank: pid}`` of the ranks torchrun started (each in a session of its own)."""
    out = {}
    for entry in Path("/proc").iterdir():
        try:
            # /proc/<pid>/stat: "pid (name) state ppid ..."; the name may hold spaces, so split after its ")"
            if not entry.name.isdigit() or int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != proc.pid:
                continue
            pid, env = int(entry.name), (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            out[rank] = pid
    return out


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every rank (a preemption)."""
    ranks = workers(proc)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in ranks.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def finish(proc: subprocess.Popen, timeout: int = TIMEOUT) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        out, _ = proc.communicate()
        pytest.fail(f"2-rank run did not finish in {timeout} s:\n{out[-4000:]}")
    return out


def train_2_ranks(args: list, cwd: Path, env: dict | None = None) -> str:
    out = finish(start(args, cwd, env))
    assert "Traceback" not in out and "error:" not in out, out[-4000:]
    return out


def checkpoint_tensors(path: Path) -> dict:
    """Every tensor of a checkpoint (weights, optimizer state) by its path in the pickled state."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    flat: dict = {}

    def walk(prefix: str, value) -> None:
        if torch.is_tensor(value):
            flat[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)

    walk("model", state["model"])
    walk("optimizer", state["last_optimizer_state"])
    flat["num_updates"] = torch.tensor(state["optimizer_history"][-1]["num_updates"])
    return flat


@pytest.mark.parametrize(
    "family, backend",
    # each family with one of the two kinds of backend (legacy_ddp and no_c10d are one class in fairseq)
    [("admin_translation", "legacy_ddp"), ("preln_lm", "pytorch_ddp")],
)  # fmt: skip
def test_killed_2_rank_run_resumes_bit_identical(synthetic_bin, lm_bin, tmp_path, family, backend):
    data = synthetic_bin if family == "admin_translation" else lm_bin
    args = [data, *COMMON, *FAMILIES[family], "--ddp-backend", backend, "--save-interval-updates", "2",
            "--max-update", "4"]  # fmt: skip
    ref, save = tmp_path / "uninterrupted", tmp_path / "killed"
    log = train_2_ranks([*args, "--save-dir", ref], tmp_path)
    # one model across the two ranks: rank 0 logs every update, rank 1 only warnings
    assert len(re.findall(r"num_updates=\d+", log)) == 4, log[-3000:]
    if family == "admin_translation":
        assert "omega from profiling 2 batch(es) (1 per rank) (formula=code, 2 rank(s)" in log

    # killed inside the copy of the first save to checkpoint_last.pt (rank 1 waits in the next update)
    proc = start([*args, "--save-dir", save], tmp_path, env={atomic.TEST_HOOK_SLOW_COPY_ENV: "5"})
    try:
        deadline = time.time() + TIMEOUT
        while time.time() < deadline and proc.poll() is None:
            if any(".checkpoint_last.pt." in p for p in atomic.stale_temporaries(save)):
                break
            time.sleep(0.05)
        kill(proc)
    finally:
        proc.communicate()
    names = sorted(p.name for p in save.iterdir())
    assert "checkpoint_1_2.pt" in names and "checkpoint_last.pt" not in names, names

    log = train_2_ranks([*args, "--save-dir", save], tmp_path)  # the same command again
    assert re.search(r"resuming from \S+checkpoint_1_2\.pt \(2 updates\)", log), log[-3000:]
    assert "taking over the lock left by a run that has ended" in log  # the killed run's lock
    assert "Loaded checkpoint" in log and "omega from profiling" not in log  # profiled before the kill
    got, want = checkpoint_tensors(save / "checkpoint_last.pt"), checkpoint_tensors(ref / "checkpoint_last.pt")
    assert got.keys() == want.keys()
    assert int(got["num_updates"]) == 4
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


@pytest.mark.parametrize(
    "arch, backend, update_freq, stop, max_update",
    # 13 batches per epoch, 7 per rank (rank 1's last one empty): epochs of 7 updates, or 4 with --update-freq 2
    [("gatedattn_iwslt_de_en", "legacy_ddp", "1", "checkpoint_2_10.pt", 20),
     ("hc_iwslt_de_en", "pytorch_ddp", "2", "checkpoint_2_6.pt", 12)],
)  # fmt: skip
def test_2_rank_resume_past_epoch_1_is_the_uninterrupted_run(
    synthetic_bin, tmp_path, arch, backend, update_freq, stop, max_update
):
    """Two ranks stopped inside epoch 2 and resumed (``--restore-file``, another save dir) end with the
    uninterrupted run's checkpoint, bit for bit (fairseq_deepinit/checkpoints/batch_order.py; stock fairseq cuts the
    resumed epoch's batches under another seed). The same checkpoint resumed on one process trains on, after one
    line that says what the other world size changes."""
    args = [synthetic_bin, *COMMON, *TRANSLATION, "--task", "translation", "--arch", arch, "--max-tokens", "1500",
            "--ddp-backend", backend, "--update-freq", update_freq, "--save-interval-updates", stop.split("_")[2][:-3],
            "--max-update", str(max_update)]  # fmt: skip
    ref, save = tmp_path / "uninterrupted", tmp_path / "resumed"
    log = train_2_ranks([*args, "--save-dir", ref], tmp_path)
    assert "end of epoch 2 " in log, log[-3000:]
    log = train_2_ranks([*args, "--save-dir", save, "--restore-file", ref / stop], tmp_path)
    assert "Loaded checkpoint" in log and "resuming with" not in log, log[-3000:]
    got, want = checkpoint_tensors(save / "checkpoint_last.pt"), checkpoint_tensors(ref / "checkpoint_last.pt")
    assert got.keys() == want.keys() and int(got["num_updates"]) == max_update
    assert [k for k in want if not torch.equal(got[k], want[k])] == []

    if update_freq == "1":  # one process where two ranks trained: 6 of epoch 2's 13 batches (3 per rank)
        one = [a for a in args if a not in ("--ddp-backend", backend)]
        log = run_cli("train", *one, "--save-dir", tmp_path / "one", "--restore-file", ref / stop, forked=True).stdout
        lines = [ln for ln in log.splitlines() if "resuming with" in ln]
        assert len(lines) == 1, log[-3000:]
        assert lines[0].endswith(
            "resuming with 1 rank instead of 2: each update now sums 1 batch (1 rank x --update-freq 1, --max-tokens "
            "1500) where the checkpoint's run summed 2 batches (2 ranks x --update-freq 1, --max-tokens 1500), so "
            "the updates from here on are not those of the run it continues (its learning rate was set for that "
            "batch per update); epoch 2 continues after 6 of its 13 batches, where 6 of 13 had been trained"
        ), lines[0]
        assert f"num_updates={max_update}," in log and "Traceback" not in log, log[-3000:]


def test_frozen_rank_ends_the_job_within_the_heartbeat_timeout(synthetic_bin, tmp_path):
    """SIGSTOP on rank 1 (a frozen process, host or GPU): rank 0 gives up after --heartbeat-timeout with
    one line instead of waiting in its collective (fairseq's own heartbeat only logs: its SIGINT cannot
    interrupt the collective), and torchrun ends the frozen rank."""
    timeout = 4
    args = [synthetic_bin, *COMMON, *TRANSLATION, "--task", "translation", "--arch", "postln_iwslt_de_en",
            "--max-update", "100000", "--no-save", "--heartbeat-timeout", str(timeout)]  # fmt: skip
    proc = start([*args, "--save-dir", tmp_path / "ckpt"], tmp_path)
    lines: list = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.time() + TIMEOUT
        while time.time() < deadline and not any("num_updates=2," in ln for ln in lines):
            assert proc.poll() is None, "".join(lines)[-3000:]
            time.sleep(0.05)
        workers = [
            int(p)
            for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        ]
        rank1 = next(p for p in workers if "RANK=1" in Path(f"/proc/{p}/environ").read_text().split("\0"))
        os.kill(rank1, signal.SIGSTOP)
        frozen = time.time()
        while time.time() < frozen + timeout + 30 and not any(": error: " in ln for ln in lines):
            time.sleep(0.1)
        waited = time.time() - frozen
    finally:
        kill(proc)
        proc.wait()
        reader.join(timeout=10)
    errors = [ln.strip() for ln in lines if ": error: " in ln]
    assert errors, "".join(lines)[-3000:]
    assert waited < timeout + 15, waited
    assert errors[0].endswith(
        f"fairseq-deepinit: error: rank 0: another rank did not answer within {timeout} s (--heartbeat-timeout): it "
        "froze, was stopped or lost its host. This rank stops (torchrun then ends the others); run the same command "
        "again to resume from the newest checkpoint"
    ), errors
    assert not any("Traceback" in ln for ln in lines), "".join(lines)[-3000:]
