"""Multi30k de-en, read in place (gzip and all) and binarised once with fairseq-preprocess.

Shared by every benchmark so that all of them train on the same kind of data. The tokenised text
exists only while fairseq-preprocess runs (the corpus is never copied as text); a ``STAMP.json``
records the settings, so a folder is rebuilt when they change and reused otherwise, also on
another machine where the raw corpus is elsewhere (the raw folder is recorded, not compared).
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, Mapping, Tuple

from deepinit_tools.paths import REPO

DEFAULT_MULTI30K = Path(os.environ.get("MULTI30K_DIR", REPO.parent / "shared" / "data" / "multi30k"))


def words(line: str) -> str:
    """Lower-cased words and punctuation marks, space separated (Multi30k is raw text)."""
    return " ".join(re.findall(r"\w+|[^\w\s]", line.lower()))


def lower(line: str) -> str:
    """Lower-cased, split on whitespace only (punctuation stays attached)."""
    return line.strip().lower()


TOKENIZERS: Dict[str, Callable[[str], str]] = {"words": words, "lower": lower}


def binarize_multi30k(
    raw_dir: Path,
    dest: Path,
    splits: Mapping[str, Tuple[str, int | None]],
    tokenizer: str = "words",
    threshold: int = 2,
) -> Path:
    """Binarise Multi30k de-en into ``dest`` once (min count ``threshold``); returns ``dest``.

    ``splits`` maps fairseq's split name (``train``, ``valid``, ``test``, ``test1``...) to the
    Multi30k file stem (``train``, ``val``, ``test_2016_flickr``) and how many of its first lines
    to take (None: all). The dictionaries are built on ``train``.
    """
    stamp = dest / "STAMP.json"
    want = {"splits": {k: list(v) for k, v in splits.items()}, "tokenizer": tokenizer, "threshold": threshold}
    if stamp.exists():
        have = json.loads(stamp.read_text())
        if {k: have.get(k) for k in want} == want:
            return dest
    if "train" not in splits:
        raise ValueError("binarize_multi30k needs a train split (the dictionaries are built on it)")
    for stem, _ in splits.values():
        for lang in ("de", "en"):
            if not (raw_dir / f"{stem}.{lang}.gz").exists():
                raise SystemExit(f"Multi30k not found: {raw_dir / f'{stem}.{lang}.gz'} is missing; pass --multi30k DIR")
    dest.mkdir(parents=True, exist_ok=True)
    tok = TOKENIZERS[tokenizer]
    for name, (stem, limit) in splits.items():
        for lang in ("de", "en"):
            with gzip.open(raw_dir / f"{stem}.{lang}.gz", "rt", encoding="utf-8") as f:
                lines = [tok(line) for line in itertools.islice(f, limit)]
            (dest / f"{name}.tok.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    cmd = [
        sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "de", "--target-lang", "en",
        "--trainpref", str(dest / "train.tok"), "--destdir", str(dest), "--workers", "1",
        "--thresholdsrc", str(threshold), "--thresholdtgt", str(threshold),
    ]  # fmt: skip
    if "valid" in splits:
        cmd += ["--validpref", str(dest / "valid.tok")]
    tests = [n for n in splits if n.startswith("test")]
    if tests:
        cmd += ["--testpref", ",".join(str(dest / f"{n}.tok") for n in sorted(tests))]
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode:
            raise SystemExit(f"fairseq-preprocess failed:\n{proc.stdout[-3000:]}")
    finally:
        for path in dest.glob("*.tok.*"):
            path.unlink()  # never keep a text copy of the corpus
    stamp.write_text(json.dumps({**want, "raw": str(raw_dir)}))
    return dest
