"""Training one candidate of ``deepinit-compare``, resumably, and reading its result.

Each candidate lives in ``OUT/<name>/``: ``train.log`` (fairseq-train's json log, appended by every
attempt), its checkpoints (fairseq resumes from ``checkpoint_last.pt``), ``attempts.json`` (wall time,
exit status and peak memory of each attempt) and, once fairseq-train has exited, ``result.json``. A
candidate with a ``result.json`` is not trained again; one stopped by ``--budget-min`` (or killed)
continues from its checkpoint on the next call.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List

from . import candidates as cands
from .command import Setting, continue_command, printable, train_command
from .process import run_logged
from .verdict import classify, gnorm_at, last_line, parse_log

_print_lock = threading.Lock()


def say(msg: str) -> None:
    with _print_lock:
        print(f"[deepinit-compare] {msg}", file=sys.stderr, flush=True)


def progress_line(name: str, text: str, max_update: int) -> str | None:
    """``name: update U/MAX, train loss L, valid nll N @V, R upd/s`` from the log so far (None before the
    first update)."""
    parsed = parse_log(text)
    if not parsed["train"]:
        return None
    last = parsed["train"][-1]
    line = f"{name}: update {int(float(last['num_updates']))}/{max_update}, train loss {last['loss']}"
    if parsed["valid"]:
        u, _, nll = parsed["valid"][-1]
        line += f", valid nll {nll:.3f} @{u}"
    return line + f", {last.get('ups', '?')} upd/s"


def _env(threads: int | None, gpu: int | None) -> Dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


def train(
    name: str,
    s: Setting,
    stall_bits: float,
    deadline: float | None,
    threads: int | None = None,
    gpu: int | None = None,
    progress_s: float = 30.0,
) -> dict:
    """Train candidate ``name`` (unless finished before) and return its record (:func:`record`)."""
    out = s.out / name
    result_path = out / "result.json"
    if result_path.exists():
        say(f"{name}: finished before ({result_path}), not rerun")
        return json.loads(result_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    attempts_path = out / "attempts.json"
    attempts: List[dict] = json.loads(attempts_path.read_text()) if attempts_path.exists() else []
    if deadline is not None and time.time() > deadline:
        return record(name, s, stall_bits, attempts, finished=False)
    log_path = out / "train.log"
    resumed = (out / "checkpoint_last.pt").exists()
    say(f"{name}: training" + (" (resuming from checkpoint_last.pt)" if resumed else ""))
    last = {"t": 0.0, "line": None}

    def poll() -> None:
        if time.time() - last["t"] < progress_s:
            return
        line = progress_line(name, _tail(log_path), s.max_update)
        if line and line != last["line"]:
            say(line)
            last.update(t=time.time(), line=line)

    done = run_logged(train_command(name, s), log_path, _env(threads, gpu), deadline, on_poll=poll)
    attempts.append(
        {"wall_s": done.wall_s, "returncode": done.returncode, "peak_rss_mib": done.peak_rss_mib, "resumed": resumed}
    )
    attempts_path.write_text(json.dumps(attempts, indent=1))
    finished = done.returncode is not None
    r = record(name, s, stall_bits, attempts, finished)
    if finished:
        tmp = result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(r, indent=1))
        tmp.replace(result_path)
        say(f"{name}: {r['status']}" + (f" ({r['reason']})" if r["reason"] else "") + f", {r['updates']} updates")
    else:
        say(f"{name}: stopped by --budget-min at update {r['updates']}; the next call continues it")
    return r


def _tail(path: Path, size: int = 1 << 16) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - size))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def reason_of(status: str, parsed: dict, verdict: dict, stall_bits: float, text: str) -> str:
    """Why the run has its status, in one line (empty for ``ok``)."""
    if status in ("diverged", "failed"):
        if parsed["error"]:
            return parsed["error"]
        if status == "diverged":
            return "non-finite validation loss"
        return last_line(text)
    if status == "stalled":
        best = verdict["best_dev_nll"]
        if best is None:
            return "no validation finished"
        if best >= stall_bits:
            return f"best valid nll {best:.3f} bits never below the unigram model's {stall_bits:.3f}"
        return "the second half of the run improved the best valid nll by less than 0.1 bits"
    return ""


def record(name: str, s: Setting, stall_bits: float, attempts: List[dict], finished: bool) -> dict:
    """A candidate's summary record, from its log (the source of truth) and its attempts."""
    text = (s.out / name / "train.log").read_text(encoding="utf-8") if (s.out / name / "train.log").exists() else ""
    parsed = parse_log(text)
    rc = attempts[-1]["returncode"] if attempts and attempts[-1]["returncode"] is not None else 0
    verdict = classify(parsed, rc, stall_bits, None)
    status = "ok" if verdict["status"] == "converging" else verdict["status"]
    finite = [v for v in parsed["valid"] if math.isfinite(v[1])]
    best = min(finite, key=lambda v: v[1]) if finite else None
    ups = [float(r["ups"]) for r in parsed["train"][1:] if float(r.get("ups", 0)) > 0]
    early = parsed["valid"][0][0] if parsed["valid"] else s.valid_every
    peaks = [a["peak_rss_mib"] for a in attempts if a.get("peak_rss_mib") is not None]
    return {
        "method": name,
        "label": cands.CANDIDATES[name].label,
        "status": status,
        "reason": reason_of(status, parsed, verdict, stall_bits, text),
        "finished": finished,
        "best_valid_loss": best[1] if best else None,
        "best_valid_nll": best[2] if best else None,
        "best_update": best[0] if best else None,
        "valid": [list(v) for v in parsed["valid"]],
        "updates": max((int(float(r["num_updates"])) for r in parsed["train"]), default=0),
        "updates_per_s": round(statistics.median(ups), 3) if ups else None,
        "wall_s": round(sum(a["wall_s"] for a in attempts), 1),
        "peak_rss_mib": max(peaks) if peaks else None,
        "attempts": len(attempts),
        "gnorm_init": gnorm_at(parsed["train"], 1),
        "gnorm_early": gnorm_at(parsed["train"], early),
        "gnorm_last": gnorm_at(parsed["train"]),
        "command": printable(train_command(name, s)),
        "continue_command": printable(continue_command(name, s)),
        "log": str(s.out / name / "train.log"),
    }


def run_all(names: List[str], s: Setting, stall_bits: float, deadline: float | None, jobs: int, slot_env: Callable):
    """Train ``names``, ``jobs`` at a time (``slot_env(i)`` -> (threads, gpu) of the i-th running slot);
    returns their records in ``names``' order."""
    from concurrent.futures import ThreadPoolExecutor

    slots = list(range(jobs))
    lock = threading.Lock()

    def one(name: str) -> dict:
        with lock:
            slot = slots.pop(0)
        try:
            threads, gpu = slot_env(slot)
            return train(name, s, stall_bits, deadline, threads, gpu)
        finally:
            with lock:
                slots.append(slot)

    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(one, names))
