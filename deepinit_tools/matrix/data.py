"""``multi30k_matrix.py prepare``: Multi30k read in place (or fetched), tokenised, joint BPE, binarised."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

from deepinit_tools import (
    multi30k_data,  # MULTI30K_DIR, the local copy, or the pinned public release
    prepare_bible,  # the tokeniser, BPE and scorer of the quickstart, shared
)
from deepinit_tools.matrix.common import SPLITS, MatrixError, log


def prepare(work: Path, merges: int, multi30k_dir: str | Path | None = None) -> Path:
    """Multi30k de-en -> ``work/bin`` (fairseq binarised; test = test2016, test1 = test2017).
    The corpus is looked up (and downloaded if need be) only when ``work/bin`` is not there yet."""
    bin_dir = work / "bin"
    if (bin_dir / ".done").exists():
        log(f"data already prepared: {bin_dir}")
        return bin_dir
    corpus = multi30k_data.locate(multi30k_dir)
    log(f"Multi30k from {corpus}")
    raw = work / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for out, split in SPLITS.items():
        for lang in ("de", "en"):
            src = corpus / f"{split}.{lang}.gz"
            with gzip.open(src, "rt", encoding="utf-8") as f, open(raw / f"{out}.{lang}", "w", encoding="utf-8") as g:
                for line in f:
                    g.write(" ".join(line.split()) + "\n")
    bpe = work / f"bpe{merges}"
    log(f"joint BPE ({merges} merges) on the tokenised training text")
    prepare_bible.learn_apply_bpe(raw, bpe, merges, splits=tuple(SPLITS))
    cmd = [sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "de", "--target-lang", "en"]
    cmd += ["--trainpref", str(bpe / "train"), "--validpref", str(bpe / "valid")]
    cmd += ["--testpref", f"{bpe / 'test'},{bpe / 'test1'}", "--destdir", str(bin_dir), "--workers", "2"]
    log_path = work / "preprocess.log"
    with open(log_path, "w", encoding="utf-8") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
            raise MatrixError(f"fairseq-preprocess failed: see {log_path}, then re-run `prepare`")
    (bin_dir / ".done").write_text("ok\n")
    return bin_dir
