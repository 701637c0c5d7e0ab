"""Run the selected stages of a GPU session under one budget; write what comes back as it goes.

The output folder (the device's ``$OUT``) gets at most :data:`MAX_FILES` files, none in a subfolder
(the device returns at most 8 files, 16 MiB each, 2 folders deep, and a stray ``.tmp`` of a copy in
flight must still fit):

- ``session.json``: the environment, the budget, every stage's deadline, status, seconds and summary
  (rewritten at every stage's start and end);
- ``session.log``: every stage's output, as it runs;
- one JSON per stage (``smoke.json``, ``gpu-6l.json``, ``cells-18l.json``, ...), copied from the
  stage's work folder whenever the stage rewrites it (:class:`Mirror`), so a command cut by its
  limit returns what each stage had finished;
- ``extras.tar.gz``: the stages' markdown tables, the profile's operator tables, the cells' training
  logs and test translations (rebuilt after every stage, kept under :data:`EXTRAS_LIMIT`).

A script stage that outlives its deadline is stopped (its JSON keeps what it finished: every script
rewrites it as it goes) and the next stage starts.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Sequence

from deepinit_tools import harness
from deepinit_tools.paths import REPO, tools_env
from deepinit_tools.session import cells as cells_mod
from deepinit_tools.session import data as data_mod
from deepinit_tools.session.stages import Budget, Stage, script_command

SESSION_FORMAT = "deepinit-gpu-session/1"
MAX_FILES = 7
EXTRAS_LIMIT = 15 * 2**20
MIRROR_S = 3.0
STOP_GRACE_S = 10.0


class Mirror:
    """Copies registered files into the output folder whenever they change (valid JSON only, so a
    file caught mid-write is copied on the next pass), every :data:`MIRROR_S` seconds."""

    def __init__(self, out: Path) -> None:
        self.out, self.files, self.seen = out, {}, {}
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def add(self, src: Path, name: str) -> None:
        with self.lock:
            self.files[name] = src

    def sync(self) -> None:
        with self.lock:
            for name, src in self.files.items():
                try:
                    stat = src.stat()
                except FileNotFoundError:
                    continue
                key = (stat.st_mtime_ns, stat.st_size)
                if self.seen.get(name) == key:
                    continue
                blob = src.read_bytes()
                if name.endswith(".json"):
                    try:
                        json.loads(blob)
                    except ValueError:
                        continue
                tmp = self.out / f".{name}.tmp"
                tmp.write_bytes(blob)
                tmp.replace(self.out / name)
                self.seen[name] = key

    def _loop(self) -> None:
        while not self.stop.wait(MIRROR_S):
            self.sync()

    def __enter__(self) -> Mirror:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.sync()


class Tee(io.TextIOBase):
    """A text stream writing to several (this process's stderr and the session log)."""

    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            st.write(s)
            st.flush()
        return len(s)


def _utc() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def run_script(cmd: List[str], log, deadline: float) -> tuple[int | None, bool]:
    """Run ``cmd`` (output appended to ``log``) until it ends or ``deadline``; (return code, cut)."""
    env = {**tools_env(), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, process_group=0)
    try:
        return proc.wait(timeout=max(1.0, deadline - time.time())), False
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                return proc.wait(timeout=grace), True
            except subprocess.TimeoutExpired:
                continue
        return proc.returncode, True


def summarise(stage: Stage, doc: dict | None) -> dict:
    """The few figures of a stage's JSON that session.json repeats."""
    if doc is None:
        return {"result": "no result file"}
    out = {"finished": doc.get("finished")}
    if stage.name == "smoke":
        out["passed"] = f"{doc.get('passed')} of {len(doc.get('rows', []))}"
    elif stage.greedy:
        out["label"] = doc.get("label")
    elif "targets" in doc:
        out["targets"] = doc["targets"]
        out["rows"] = len(doc.get("rows", []))
    return out


def build_extras(work: Path, stages: Sequence[Stage], dest: Path) -> List[str]:
    """``extras.tar.gz`` of the stages' extras; drops the lowest-priority pattern while over the limit."""
    entries = [(s, pattern) for s in stages for pattern in s.extras]
    dropped: List[str] = []
    while True:
        with tarfile.open(dest, "w:gz") as tar:
            for s, pattern in entries:
                for f in sorted((work / s.name).glob(pattern)):
                    tar.add(f, arcname=f"{s.name}/{f.relative_to(work / s.name)}")
        if dest.stat().st_size <= EXTRAS_LIMIT or not entries:
            return dropped
        s, pattern = entries.pop()
        dropped.append(f"{s.name}/{pattern}")


class Session:
    """One session: its stages, budget, folders and the session.json document."""

    def __init__(self, stages: Sequence[Stage], budget: Budget, opts, argv: Sequence[str]) -> None:
        self.stages, self.budget, self.opts = list(stages), budget, opts
        self.out, self.work = opts.out_dir, opts.work_dir
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        meta = harness.environment(opts.device, "gpu_session.py", list(argv))
        self.doc = {
            "format": SESSION_FORMAT,
            "meta": meta,
            "budget_min": budget.minutes,
            "t0_utc": datetime.datetime.fromtimestamp(budget.t0, datetime.UTC).isoformat(timespec="seconds"),
            "quick": opts.quick,
            "stages": [],
            "finished": False,
        }

    def write(self) -> None:
        harness.write_json(self.work / "session.json", {k: v for k, v in self.doc.items() if k != "meta"},
                           self.doc["meta"])  # fmt: skip
        shutil.copyfile(self.work / "session.json", self.out / ".session.json.tmp")
        (self.out / ".session.json.tmp").replace(self.out / "session.json")

    def run(self) -> int:
        log = open(self.out / "session.log", "a", encoding="utf-8", buffering=1)
        mirror = Mirror(self.out)
        extras_dest = self.work / "extras.tar.gz"
        mirror.add(extras_dest, "extras.tar.gz")
        with log, mirror, contextlib.redirect_stderr(Tee(sys.__stderr__, log)):
            for i, stage in enumerate(self.stages):
                rec = self._run_stage(stage, self.stages[i + 1 :], log, mirror)
                print(f"[session] {stage.name}: {rec['status']} {json.dumps(rec.get('summary', {}))}",
                      file=sys.stderr)  # fmt: skip
                ran = [s for s in self.stages[: i + 1]]
                dropped = build_extras(self.work, ran, extras_dest)
                if dropped:
                    rec["extras_dropped"] = dropped
                self.write()
                mirror.sync()
            self.doc["finished"] = True
            self.doc["seconds"] = round(time.time() - self.budget.t0, 1)
            self.write()
        # a stage cut at its deadline or skipped for time is no failure: its JSON says what it finished
        failed = [r["name"] for r in self.doc["stages"] if r["status"] in ("failed", "error")]
        return 1 if failed else 0

    def _run_stage(self, stage: Stage, later: Sequence[Stage], log, mirror: Mirror) -> Dict:
        deadline = self.budget.deadline(stage, later)
        rec: Dict = {"name": stage.name, "what": stage.what, "result": stage.result}
        self.doc["stages"].append(rec)
        if deadline is None:
            rec.update(status="skipped", note="too little of the budget left")
            return rec
        t = time.time()
        rec.update(
            status="running", started_s=round(t - self.budget.t0, 1), deadline_s=round(deadline - self.budget.t0, 1)
        )
        self.write()
        work = self.work / stage.name
        shutil.rmtree(work, ignore_errors=True)  # a cell's old checkpoint_best.pt must not pass for this run's
        work.mkdir(parents=True, exist_ok=True)
        result = work / stage.result
        mirror.add(result, stage.result)
        print(f"\n[session] ==== {stage.name} ({_utc()}, until +{rec['deadline_s']:.0f} s) ====", file=sys.stderr)
        try:
            if stage.greedy:
                doc = self._cells(stage, work, deadline)
                rec["status"] = "ok" if doc.get("finished") else "cut"
            else:
                cmd = script_command(stage, self.opts, work, deadline)
                rec["command"] = " ".join(cmd).replace(str(REPO) + "/", "")
                print(f"[session] {rec['command']}", file=sys.stderr)
                rc, cut = run_script(cmd, log, deadline)
                rec.update(returncode=rc, status="cut" if cut else "ok" if rc == 0 else "failed")
        except Exception as e:  # noqa: BLE001  (recorded; the next stage runs)
            rec.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
        rec["seconds"] = round(time.time() - t, 1)
        try:
            rec["summary"] = summarise(stage, json.loads(result.read_text()) if result.exists() else None)
        except ValueError:
            rec["summary"] = {"result": "unreadable (cut while writing)"}
        return rec

    def _cells(self, stage: Stage, work: Path, deadline: float) -> dict:
        """The packed cells stage, in this process (it only starts and watches fairseq processes)."""
        from deepinit_tools.matrix.cell import device_name, stall_bits_of
        from deepinit_tools.matrix.commands import Options

        o_ = self.opts
        depth = 2 if o_.quick else stage.depth
        cells = cells_mod.paper_cells(depth, o_.methods)
        data = data_mod.cells_data(o_.carry, o_.quick)
        if not (data / "bin" / ".done").exists():
            raise FileNotFoundError(f"{data}: no prepared data; run `gpu_session.py prepare` before the device call")
        o = Options(data, work / "runs", o_.device, "bf16" if o_.device == "cuda" else "fp32",
                    jobs=o_.jobs or len(cells), dim=o_.dim, ffn=o_.ffn, heads=o_.heads, patience=o_.patience,
                    max_epochs=o_.max_epochs, threads=1, beam=5)  # fmt: skip
        decode_s = o_.decode_s if o_.decode_s is not None else cells_mod.decode_seconds(depth, o_.device, len(cells))
        meta = {**self.doc["meta"], "stage": stage.name, "layers": depth, "dim": o.dim, "ffn": o.ffn,
                "heads": o.heads, "jobs": o.jobs, "decode_s": decode_s,
                "train_until_utc": datetime.datetime.fromtimestamp(deadline - decode_s, datetime.UTC).isoformat(
                    timespec="seconds")}  # fmt: skip
        pack = cells_mod.Pack(cells, o, deadline, decode_s, work / stage.result, meta, device_name(o.device),
                              stall_bits_of(o))  # fmt: skip
        return pack.run()
