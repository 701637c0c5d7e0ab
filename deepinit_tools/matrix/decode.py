"""Translating with a cell's best checkpoint: greedy dev probe (distinct outputs) and sacreBLEU on
test2016 / test2017, with progress lines while fairseq-generate runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from deepinit_tools import (
    fairseq_argv as fa,
)
from deepinit_tools import (
    generate_progress,  # sentences-done lines while fairseq-generate runs
    prepare_bible,  # the tokeniser, BPE and scorer of the quickstart, shared
)
from deepinit_tools.matrix.common import BLEU_RE, TEST_SETS, MatrixError, cell_dir, log


class DecodeDeadline(Exception):
    """fairseq-generate was stopped at the deadline; nothing was written (the next run decodes again)."""


def translate(
    bin_dir: Path,
    out: Path,
    subset: str,
    label: str,
    beam: int,
    threads: int,
    device: str = "cpu",
    deadline: float | None = None,
) -> Path:
    """``fairseq-generate`` of ``subset`` with the cell's best checkpoint (skipped when up to date),
    logging sentences done of the total every tenth of the set; its stderr goes to a log beside it.
    ``device`` "cuda" decodes on the GPU (fp32), "cpu" with ``--cpu``. At ``deadline`` (a
    ``time.time()``) the process is killed and :class:`DecodeDeadline` raised; the partial output
    stays a ``.tmp`` file, never taken for a finished translation."""
    ckpt = out / "checkpoint_best.pt"
    gen = out / f"generate-{label}.txt"
    if not (gen.exists() and gen.stat().st_mtime > ckpt.stat().st_mtime):
        cmd = fa.command("generate", bin_dir)
        cmd += ["--path", str(ckpt), "--gen-subset", subset, "--beam", str(beam), "--remove-bpe"]
        cmd += ["--max-len-a", "1.2", "--max-len-b", "10", "--batch-size", "128"]
        cmd += ["--required-batch-size-multiple", "1"] + (["--cpu"] if device == "cpu" else [])
        # unbuffered, so that hypotheses (and the progress counted from them) arrive batch by batch
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        tmp, err = gen.with_suffix(".tmp"), gen.with_suffix(".log")
        name = f"{out.name} {label}"
        if deadline is not None and time.time() >= deadline:
            raise DecodeDeadline(name)
        with open(tmp, "wb") as f, open(err, "wb") as e:
            # its own process group, so that a stop at the deadline also ends its
            # data-loader workers, which would hold the pipe open
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=e, env=env, process_group=0)
            stopped = threading.Event()

            def stop() -> None:
                stopped.set()
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended just now
                    pass

            timer = threading.Timer(deadline - time.time(), stop) if deadline is not None else None
            if timer is not None:
                timer.daemon = True
                timer.start()
            raw = bin_dir.parent / "raw" / f"{subset}.en"  # prepare's untokenised copy: one line per sentence
            total = sum(1 for _ in open(raw, "rb")) if raw.exists() else None
            try:
                with proc.stdout:
                    generate_progress.relay(proc.stdout, f, log, total=total, label=name)
                proc.wait()
            finally:
                if timer is not None:
                    timer.cancel()
            if stopped.is_set():
                raise DecodeDeadline(name)
            if proc.returncode != 0:
                raise MatrixError(f"fairseq-generate failed on {name} (exit {proc.returncode}): see {err}")
        tmp.replace(gen)
    return gen


def _trained_cell_dir(work: Path, name: str) -> Path:
    out = cell_dir(work, name)
    if not (out / "checkpoint_best.pt").exists():
        raise MatrixError(f"{out / 'checkpoint_best.pt'} not found: train the cell first (`matrix --cells {name}`)")
    return out


def bleu_cell(bin_dir: Path, work: Path, name: str, beam: int, threads: int) -> dict:
    """sacreBLEU of the cell's best checkpoint on test2016 and test2017 (``bleu.json``)."""
    out = _trained_cell_dir(work, name)
    scores = {}
    for subset, label in TEST_SETS.items():
        gen = translate(bin_dir, out, subset, label, beam, threads)
        scores[label] = prepare_bible.score(gen, work / "raw" / f"{subset}.en")
    (out / "bleu.json").write_text(json.dumps(scores, indent=1))
    return scores


def probe_cell(bin_dir: Path, work: Path, name: str, threads: int) -> dict:
    """Greedy translation of the dev set with the cell's best checkpoint (``probe.json``): how many
    distinct hypotheses it produces and its BLEU. A model that emits (nearly) the same sentence for
    every input has learnt a target-side language model and ignores the source; its dev loss alone
    does not show that (about 5.2 bits/token here)."""
    out = _trained_cell_dir(work, name)
    gen = translate(bin_dir, out, "valid", "dev-greedy", 1, threads)
    hyps = prepare_bible.read_hypotheses(gen)
    bleu = prepare_bible.score(gen, work / "raw" / "valid.en")
    result = {"distinct": len(set(hyps)), "sentences": len(hyps), "bleu": float(BLEU_RE.search(bleu).group(1))}
    (out / "probe.json").write_text(json.dumps(result, indent=1))
    return result
