"""The paper cells trained side by side on one device, until a deadline (stages ``cells18``, ``cells6``).

Every method of the papers' matrix (:data:`deepinit_tools.matrix.regimes.MAIN_METHODS`: Post-LN,
Pre-LN, Lipschitz, T-Fixup, Admin, DS-Init, DS-Init+MAtt, TwT, DeepNorm) at one depth, each in its
paper's regime, each as its own ``fairseq-train`` process: the converged matrix's exact command
(:func:`deepinit_tools.matrix.commands.train_command`: bf16 autocast and the plugin's fast path on
CUDA), ``jobs`` of them at once sharing the device, plus

- after every epoch, the dev loss and the **greedy dev BLEU** (:data:`DEV_BLEU`: fairseq's
  ``--eval-bleu``, beam 1; sacreBLEU's 13a tokenisation of the BPE-removed, tokenised dev text, so
  close to, not the same as, the detokenised test scoring);
- only the best checkpoint is saved, without optimizer state (:data:`SAVE`: nothing here resumes,
  and nine 18-layer optimizer states per epoch would be gigabytes of disk writes).

A process ends by itself when its dev loss has not improved for ``patience`` epochs (the only
*converged* cells) or at the epoch cap; the others are stopped ``decode_s`` seconds before the
stage's deadline (*cut*). Then each best checkpoint translates test2016 and test2017 with beam 5
(sacreBLEU, :func:`deepinit_tools.matrix.cell.decode_best`) and, time allowing, the dev set greedily
(the source-blindness probe), all cells at once, until the deadline. Every cell's result says what
it is: "N epochs in M minutes, packed K at a time".

The pack file (the stage's JSON, ``converge --pack``'s format, so ``multi30k_matrix.py report
--converged --packs`` merges it) is rewritten every :data:`WRITE_S` seconds: ``cells`` holds every cell
whose training ended (test BLEU filled in as decoding finishes), ``training`` the per-epoch curves of
those still training.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Sequence

from deepinit_tools.matrix import regimes as rg
from deepinit_tools.matrix.cell import EMPTY_DECODED, decode_best, result_record
from deepinit_tools.matrix.commands import _TRAIN, _VALID, PACK_FORMAT, Options, train_command
from deepinit_tools.matrix.common import log
from deepinit_tools.matrix.decode import DecodeDeadline
from deepinit_tools.paths import REPO

DEV_BLEU_ARGS = '{"beam": 1, "max_len_a": 1.2, "max_len_b": 10}'
DEV_BLEU = ("--eval-bleu", "--eval-bleu-args", DEV_BLEU_ARGS, "--eval-bleu-remove-bpe", "--eval-bleu-detok", "space")
DEV_BLEU_NOTE = (
    "greedy, after every epoch: fairseq --eval-bleu (beam 1, sacreBLEU 13a on the BPE-removed tokenised dev text)"
)
SAVE = ("--no-last-checkpoints", "--no-save-optimizer-state")
WIDTH_REASON = (
    "d 256, FFN 1024, 4 heads (the converged matrix's width). Packed processes keep the GPU busy with kernel "
    "launches, whose number per step does not depend on the width: by the estimate (matrix/budget.py, "
    "GPU_WIDTH_FLOOR) a narrower model trains no more epochs in the same minutes, while d 512 costs about 1.4x "
    "per epoch; at d 256 the cells also sit in one table with the matrix's other cells."
)
POLL_S, WRITE_S, STOP_GRACE_S = 2.0, 10.0, 15.0
_SAFE_GLOBALS = threading.Lock()  # torch's allow-list is process-wide: one cell's load at a time


def decode_seconds(depth: int, device: str, cells: int) -> float:
    """Seconds kept for decoding after training stops: on CUDA, every cell's test2016 and test2017 (beam
    5) at once, process starts included (estimated: 60 s at 6 layers, 90 s at 18); the CPU rehearsal's
    small sets on 2 shared cores, 20 s plus 10 s a cell."""
    return 45.0 + 2.5 * depth if device == "cuda" else 20.0 + 10.0 * cells


def drop_metrics(ckpt: Path) -> None:
    """Rewrite ``ckpt`` without fairseq's metrics state (``extra_state["metrics"]``).

    fairseq's ``--eval-bleu`` logs its BLEU n-gram counts as numpy arrays, which fairseq-train saves
    with the metrics in every checkpoint; the plugin's checkpoint loader refuses numpy objects (it
    allows tensors, plain containers and ``argparse.Namespace``), so fairseq-generate would refuse
    the cell's best checkpoint. Decoding needs none of the metrics. The file, written by this
    session's own fairseq-train, is read with torch's weights-only unpickler that additionally
    accepts numpy's array reconstruction (no other code can run); the allow-list is process-wide,
    so the cells' decoding threads take turns."""
    import argparse

    import numpy as np
    import torch

    numpy_globals = [np.empty(0).__reduce__()[0], np.float64(0).__reduce__()[0], np.ndarray, np.dtype]
    numpy_globals += sorted({type(np.dtype(t)) for t in ("int64", "int32", "float64", "float32")}, key=str)
    # only what the process does not allow yet: leaving the block takes its globals off the list again, and
    # argparse.Namespace (the plugin's) must stay on it
    with _SAFE_GLOBALS:
        allowed = set(torch.serialization.get_safe_globals())
        extra = [g for g in [*numpy_globals, argparse.Namespace] if g not in allowed]
        with torch.serialization.safe_globals(extra):
            state = torch.load(ckpt, map_location="cpu", weights_only=True)
    if state.get("extra_state", {}).pop("metrics", None) is None:
        return
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(ckpt)


def paper_cells(depth: int, methods: Sequence[str] = rg.MAIN_METHODS) -> List[rg.Cell]:
    """Each method at ``depth`` in its paper's (main) regime."""
    return [rg.Cell(depth, m, "paper") for m in methods]


def epoch_curve(text: str) -> List[dict]:
    """Per epoch of a fairseq-train json log: dev loss / nll (bits), greedy dev BLEU (None without
    ``--eval-bleu``), updates, and the training wall seconds at the end of that epoch."""
    valid: Dict[int, dict] = {}
    wall: Dict[int, float] = {}
    for line in text.splitlines():
        m = _VALID.search(line)
        if m:
            r = json.loads(m.group(1))
            bleu = r.get("valid_bleu")
            valid[int(r["epoch"])] = {
                "epoch": int(r["epoch"]),
                "dev_loss": float(r["valid_loss"]),
                "dev_nll": float(r["valid_nll_loss"]),
                "dev_bleu": None if bleu is None else float(bleu),
                "updates": int(float(r["valid_num_updates"])),
            }
        m = _TRAIN.search(line)
        if m:
            r = json.loads(m.group(1))
            if "epoch" in r and "train_wall" in r:
                wall[int(r["epoch"])] = float(r["train_wall"])
    return [{**valid[e], "train_wall_s": wall.get(e)} for e in sorted(valid)]


def label(epochs: int, minutes: float, jobs: int, status: str) -> str:
    """What a result is: ``N epochs in M minutes, packed K at a time`` (+ converged / cut)."""
    head = f"{epochs} epoch{'s' if epochs != 1 else ''} in {minutes:.1f} minutes, packed {jobs} at a time"
    return head + {"converged": ", converged (dev-loss patience)", "cut": ", cut at the deadline"}.get(status, "")


@dataclasses.dataclass
class Job:
    """One cell's training process and what became of it."""

    cell: rg.Cell
    out: Path
    cmd: List[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    ended: float | None = None
    rc: int | None = None
    cut: bool = False
    decoded: dict = dataclasses.field(default_factory=lambda: dict(EMPTY_DECODED))
    record: dict | None = None


class Pack:
    """Train ``cells`` ``o.jobs`` at a time until ``deadline - decode_s``, decode until ``deadline``,
    rewriting the pack file ``path`` as it goes (see the module docstring)."""

    def __init__(
        self,
        cells: Sequence[rg.Cell],
        o: Options,
        deadline: float,
        decode_s: float,
        path: Path,
        meta: dict,
        device: str,
        stall_bits: float,
    ) -> None:
        self.o = dataclasses.replace(o, extra_args=" ".join([o.extra_args, *map(shlex.quote, DEV_BLEU + SAVE)]).strip())
        self.deadline, self.train_end = deadline, deadline - decode_s
        self.path, self.meta, self.device, self.stall = path, meta, device, stall_bits
        self.jobs = [Job(c, o.runs / c.dirname, train_command(c, self.o)) for c in cells]
        self.lock = threading.Lock()
        self.start = time.time()

    # -- the training processes ------------------------------------------------------------------

    def _launch(self, j: Job) -> None:
        j.out.mkdir(parents=True, exist_ok=True)
        threads = str(self.o.threads)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"}
        with open(j.out / "train.log", "w", encoding="utf-8") as f:
            # its own process group: a stop also ends its data-loader worker
            j.proc = subprocess.Popen(j.cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, process_group=0)
        j.started = time.time()
        log(f"train {j.cell.name}")

    def _stop(self, running: List[Job]) -> None:
        """SIGTERM every running process group, SIGKILL what is left after :data:`STOP_GRACE_S`."""
        for j in running:
            j.cut = True
            _signal(j, signal.SIGTERM)
        until = time.time() + STOP_GRACE_S
        for j in running:
            try:
                j.rc = j.proc.wait(timeout=max(0.1, until - time.time()))
            except subprocess.TimeoutExpired:
                _signal(j, signal.SIGKILL)
                j.rc = j.proc.wait()
            j.ended = j.ended or time.time()

    def run(self) -> dict:
        pending, running = list(self.jobs), []
        # decoding: every cell at once on a GPU machine's 16 cores; on a small CPU, as many as it has cores
        pool = ThreadPoolExecutor(max_workers=max(1, min(len(self.jobs), os.cpu_count() or 1)))
        decodes = []
        last_write = 0.0
        while pending or running:
            now = time.time()
            for j in [j for j in running if j.proc.poll() is not None]:
                j.rc, j.ended = j.proc.returncode, now
                running.remove(j)
                self._finish(j)
                decodes.append(pool.submit(self._decode, j))
            if now >= self.train_end:
                self._stop(running)
                for j in running:
                    self._finish(j)
                    decodes.append(pool.submit(self._decode, j))
                running = []
                if pending:
                    log(f"not started before the deadline: {', '.join(j.cell.name for j in pending)}")
                break
            while pending and len(running) < self.o.jobs:
                running.append(pending.pop(0))
                self._launch(running[-1])
            if now - last_write >= WRITE_S:
                self.write(finished=False)
                last_write = now
            time.sleep(POLL_S)
        self.write(finished=False)
        for f in decodes:
            f.result()
        pool.shutdown()
        return self.write(finished=True)

    # -- results ---------------------------------------------------------------------------------

    def _finish(self, j: Job) -> None:
        """The cell's record once its training ended (rebuilt after each decoding step)."""
        text = (j.out / "train.log").read_text(encoding="utf-8", errors="replace")
        wall = (j.ended or time.time()) - j.started
        attempts = [{"wall_s": round(wall, 1), "resumed": False, "stopped_at_deadline": j.cut}]
        rc = 0 if j.cut else j.rc  # a stop at the deadline is no failure of the cell
        r = result_record(j.cell, self.o, self.device, self.stall, text, rc, j.decoded, attempts, j.cmd)
        if j.cut and r["status"] != "diverged":
            r["status"], r["stop"] = "cut", "deadline"
        elif r["status"] == "converged" and r["stop"] != "patience":
            r["status"] = "lr-floor"  # TwT's plateau schedule reached --stop-min-lr: converged only by patience
        curve = epoch_curve(text)
        bleus = [e["dev_bleu"] for e in curve if e["dev_bleu"] is not None]
        r.update(
            label=label(r["epochs"], wall / 60, self.o.jobs, r["status"]),
            minutes=round(wall / 60, 2),
            packed=self.o.jobs,
            dev_curve=curve,
            best_dev_bleu=max(bleus) if bleus else None,
            dev_bleu=DEV_BLEU_NOTE,
            decoded=[k for k in ("test2016_bleu", "test2017_bleu", "probe") if j.decoded[k] is not None],
        )  # fmt: skip
        with self.lock:
            j.record = r

    def _decode(self, j: Job) -> None:
        if not (j.out / "checkpoint_best.pt").exists():
            return
        o = dataclasses.replace(self.o, deadline=self.deadline)
        try:
            drop_metrics(j.out / "checkpoint_best.pt")
            decode_best(o, j.out, j.decoded, tests_first=True)
        except DecodeDeadline as e:
            log(f"{j.cell.name}: decoding stopped at the deadline ({e})")
        except Exception as e:  # noqa: BLE001  (recorded; the other cells decode on)
            log(f"{j.cell.name}: decoding failed: {type(e).__name__}: {e}")
            j.decoded["decode_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        self._finish(j)
        log(f"{j.cell.name}: {j.record['label']}; BLEU {j.decoded['test2016_bleu']} / {j.decoded['test2017_bleu']}")
        self.write(finished=False)

    def write(self, finished: bool) -> dict:
        """Rewrite the pack file (atomically) and return its document."""
        with self.lock:
            done = [j.record for j in self.jobs if j.record is not None]
            training = []
            for j in self.jobs:
                if j.record is None and j.proc is not None:
                    curve = epoch_curve((j.out / "train.log").read_text(encoding="utf-8", errors="replace"))
                    mins = round((time.time() - j.started) / 60, 2)
                    training.append({"cell": j.cell.name, "minutes": mins, "dev_curve": curve})
            doc = {
                "format": PACK_FORMAT,
                "meta": self.meta,
                "finished": finished,
                "label": summary(done, self.o.jobs),
                "width": WIDTH_REASON,
                "dev_bleu": DEV_BLEU_NOTE,
                "cells": done,
                "training": training,
                "not_started": [j.cell.name for j in self.jobs if j.proc is None],
            }
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(doc, indent=1))
            tmp.replace(self.path)
        return doc


def summary(records: Sequence[dict], jobs: int) -> str:
    """One line for the whole pack: epochs and minutes, how many converged."""
    if not records:
        return f"no cell finished training yet (packed {jobs} at a time)"
    epochs = sorted({r["epochs"] for r in records})
    minutes = max(r["minutes"] for r in records)
    span = (
        f"{epochs[0]} epoch{'s' if epochs[0] != 1 else ''}" if len(epochs) == 1 else f"{epochs[0]}-{epochs[-1]} epochs"
    )
    converged = [r["method"] for r in records if r["status"] == "converged"]
    return (
        f"{len(records)} cells, {span} in {minutes:.1f} minutes, packed {jobs} at a time; converged "
        f"(dev-loss patience): {', '.join(converged) if converged else 'none'}"
    )


def _signal(j: Job, sig: int) -> None:
    try:
        os.killpg(j.proc.pid, sig)
    except ProcessLookupError:  # it ended just now
        pass
