"""Multi30k de-en (task 1) for every tool: where the raw gzip files are, and the one preparation of them.

Two binarisations share the reading of the gzip files in place (:func:`read_lines`) and fairseq's
``fairseq-preprocess`` command (:func:`deepinit_tools.fairseq_argv.preprocess`):

- :func:`binarize_multi30k`: word-level (or lower-cased) text, first lines of each split, min count 2, for the
  benchmarks; no text copy kept, a ``STAMP.json`` records the settings;
- :func:`prepare_bpe`: whole splits, joint BPE (the quickstart's subword-nmt), for the Multi30k matrix
  (``multi30k_matrix.py prepare``).

Finding Multi30k, downloading it if need be (``scripts/multi30k_data.py``).

Where the corpus comes from, first match wins:

1. ``--multi30k-dir DIR`` or the ``MULTI30K_DIR`` environment variable: a folder the user gave,
   read in place and trusted as it is (it may hold a subset or a variant of the corpus);
2. ``../shared/data/multi30k`` beside the checkout, where this project's own machines keep it;
3. the public release, the ``multi30k/dataset`` GitHub repository at a pinned commit
   (``data/task1/raw/*.gz``), downloaded once into ``work-data/multi30k`` and checked file by file
   against the sha256 values below (computed from the files at that commit).

Every expected failure (a given folder without the files, no network, a download with the wrong
sha256) raises :class:`Multi30kError` with one line that says what to do; the command line prints it
and exits 1. Its command line prints the folder it settled on (what ``diagnose_multi30k.sh`` uses).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import http.client
import itertools
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Sequence, Tuple

from deepinit_tools import fairseq_argv as fa
from deepinit_tools import prepare_bible  # the quickstart's joint BPE (subword-nmt), shared
from deepinit_tools.paths import REPO

LOCAL_DEFAULT = REPO.parent / "shared" / "data" / "multi30k"
# the benchmarks' --multi30k: read in place, never downloaded
DEFAULT_MULTI30K = Path(os.environ.get("MULTI30K_DIR", LOCAL_DEFAULT))
# fairseq split -> Multi30k file stem, as the matrix prepares them (test = test2016, test1 = test2017)
SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr", "test1": "test_2017_flickr"}
CACHE = REPO / "work-data" / "multi30k"
# A fixed commit, not a branch: the files (and so the sha256 values below) can never change under us.
COMMIT = "a3d2e0d26b56f3846f66a952536ffed4e401d05a"
BASE_URL = f"https://raw.githubusercontent.com/multi30k/dataset/{COMMIT}/data/task1/raw"
# sha256 of each de/en file at COMMIT (identical to this project's copies in shared/data/multi30k)
SHA256: Dict[str, str] = {
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2017_flickr.de.gz": "a2c89666db00c495cd8513b9d708d5a3acc205d7de312ef2bf5fb7ebc1540aee",
    "test_2017_flickr.en.gz": "76a444ee25172e72695cddb13ae4a3bda59430617be88e0bb46b60504f054074",
}
TIMEOUT_S = 60
HOW = "set MULTI30K_DIR (or --multi30k-dir) to a folder with Multi30k's task1 raw files (train.de.gz, ...)"

Opener = Callable[..., object]  # urllib.request.urlopen's signature: (url, timeout=...) -> binary response


class Multi30kError(RuntimeError):
    """An expected failure to find or fetch Multi30k; the message says what to do."""


def log(msg: str) -> None:
    print(f"[multi30k] {msg}", file=sys.stderr, flush=True)


def download(url: str, dest: Path, sha256: str, opener: Opener | None = None) -> Path:
    """Fetch ``url`` to ``dest`` through a temporary file, kept only when its sha256 is ``sha256``,
    so an interrupted or altered download never sits in the cache looking complete. ``opener``
    (default ``urllib.request.urlopen``, looked up at call time so tests can replace it) opens the URL."""
    opener = opener or urllib.request.urlopen
    tmp = dest.with_name(dest.name + ".part")
    h = hashlib.sha256()
    try:
        with opener(url, timeout=TIMEOUT_S) as response, open(tmp, "wb") as out:
            for block in iter(lambda: response.read(1 << 16), b""):
                h.update(block)
                out.write(block)
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        tmp.unlink(missing_ok=True)
        reason = getattr(e, "reason", None) or e
        raise Multi30kError(f"cannot download {url} ({reason}): check the network, or {HOW}") from None
    if h.hexdigest() != sha256:
        tmp.unlink(missing_ok=True)
        raise Multi30kError(
            f"{url} has sha256 {h.hexdigest()[:16]}..., expected {sha256[:16]}... (damaged or changed "
            f"download, not kept): re-run, or {HOW}"
        )
    os.replace(tmp, dest)
    return dest


def fetch_release(cache: Path | None = None, base_url: str | None = None, opener: Opener | None = None) -> Path:
    """``cache`` (default :data:`CACHE`) holding every file of :data:`SHA256`, downloading those
    missing or damaged from ``base_url`` (default :data:`BASE_URL`)."""
    cache = cache or CACHE
    base_url = base_url or BASE_URL
    cache.mkdir(parents=True, exist_ok=True)
    for name, sha in SHA256.items():
        path = cache / name
        if path.exists():
            if prepare_bible.sha256_of(path) == sha:
                continue
            log(f"{path} does not match its sha256 (damaged): downloading it again")
        log(f"downloading {name} from {base_url} into {cache}")
        download(f"{base_url}/{name}", path, sha, opener)
    return cache


def locate(
    given: Path | str | None = None,
    cache: Path | None = None,
    local_default: Path | None = None,
    base_url: str | None = None,
    opener: Opener | None = None,
) -> Path:
    """The folder with Multi30k's raw gzip files: ``given`` (else ``$MULTI30K_DIR``), else
    ``local_default`` (default :data:`LOCAL_DEFAULT`) when it holds every file, else the pinned
    release fetched into ``cache`` (:func:`fetch_release`). Module-level defaults are read at call
    time, so a test can point them elsewhere."""
    given = given or os.environ.get("MULTI30K_DIR") or None
    local_default = local_default or LOCAL_DEFAULT
    if given:
        folder = Path(given)
        missing = [n for n in SHA256 if not (folder / n).exists()]
        if missing:
            raise Multi30kError(
                f"{folder} (MULTI30K_DIR / --multi30k-dir) has no {missing[0]}: point it at the folder with "
                f"Multi30k's task1 raw files ({', '.join(SHA256)}), or unset it to download them"
            )
        return folder
    if all((local_default / n).exists() for n in SHA256):
        return local_default
    return fetch_release(cache, base_url, opener)


# ---------------------------------------------------------------------------------------------
# the preparation


def words(line: str) -> str:
    """Lower-cased words and punctuation marks, space separated (Multi30k is raw text)."""
    return " ".join(re.findall(r"\w+|[^\w\s]", line.lower()))


def lower(line: str) -> str:
    """Lower-cased, split on whitespace only (punctuation stays attached)."""
    return line.strip().lower()


def spaces(line: str) -> str:
    """The line as it is, its whitespace runs made one space (the matrix's input to BPE)."""
    return " ".join(line.split())


TOKENIZERS: Dict[str, Callable[[str], str]] = {"words": words, "lower": lower}


def read_lines(folder: Path, stem: str, lang: str, tok: Callable[[str], str], limit: int | None = None) -> List[str]:
    """The first ``limit`` (None: all) lines of ``folder/stem.lang.gz``, each through ``tok``, read in place."""
    with gzip.open(folder / f"{stem}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [tok(line) for line in itertools.islice(f, limit)]


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
    to take (None: all). The dictionaries are built on ``train``. The tokenised text exists only
    while fairseq-preprocess runs; ``STAMP.json`` records the settings, so ``dest`` is rebuilt when
    they change and reused otherwise, also where the raw corpus is elsewhere (recorded, not compared).
    """
    stamp = dest / "STAMP.json"
    want = {"splits": {k: list(v) for k, v in splits.items()}, "tokenizer": tokenizer, "threshold": threshold}
    if stamp.exists():
        have = json.loads(stamp.read_text())
        if {k: have.get(k) for k in want} == want:
            _mark_words(dest, tokenizer)  # a folder binarised before the record existed gets it now
            return dest
    if "train" not in splits:
        raise ValueError("binarize_multi30k needs a train split (the dictionaries are built on it)")
    for stem, _ in splits.values():
        for lang in ("de", "en"):
            if not (raw_dir / f"{stem}.{lang}.gz").exists():
                raise SystemExit(f"Multi30k not found: {raw_dir / f'{stem}.{lang}.gz'} is missing; pass --multi30k DIR")
    dest.mkdir(parents=True, exist_ok=True)
    for name, (stem, limit) in splits.items():
        for lang in ("de", "en"):
            lines = read_lines(raw_dir, stem, lang, TOKENIZERS[tokenizer], limit)
            (dest / f"{name}.tok.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    tests = sorted(n for n in splits if n.startswith("test"))
    cmd = fa.preprocess(
        dest / "train.tok",
        dest,
        valid=dest / "valid.tok" if "valid" in splits else None,
        tests=[dest / f"{n}.tok" for n in tests],
        threshold=threshold,
    )
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode:
            raise SystemExit(f"fairseq-preprocess failed:\n{proc.stdout[-3000:]}")
    finally:
        for path in dest.glob("*.tok.*"):
            path.unlink()  # never keep a text copy of the corpus
    stamp.write_text(json.dumps({**want, "raw": str(raw_dir)}))
    _mark_words(dest, tokenizer)
    return dest


def _mark_words(dest: Path, tokenizer: str) -> None:
    """Record the word-level pipeline in ``dest`` for ``deepinit-export --to huggingface``'s tokenizer."""
    from fairseq_deepinit.export.hf_tokenizer import write_marker  # the plugin's import is slow: only here

    write_marker(dest, ("de", "en"), tokenizer)


def prepare_bpe(work: Path, merges: int, multi30k_dir: str | Path | None = None) -> Path:
    """Multi30k de-en -> ``work/bin`` (fairseq binarised, joint BPE of ``merges`` merges; the splits of
    :data:`SPLITS`). The corpus is looked up (and downloaded if need be) only when ``work/bin`` is not
    there yet."""
    bin_dir = work / "bin"
    bpe = work / f"bpe{merges}"
    if (bin_dir / ".done").exists():
        log(f"data already prepared: {bin_dir}")
        if (bpe / "codes").exists():  # a folder prepared before the record existed gets it now
            prepare_bible.mark(bpe, bin_dir)
        return bin_dir
    corpus = locate(multi30k_dir)
    log(f"Multi30k from {corpus}")
    raw = work / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for out, split in SPLITS.items():
        for lang in ("de", "en"):
            lines = read_lines(corpus, split, lang, spaces)
            (raw / f"{out}.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    log(f"joint BPE ({merges} merges) on the tokenised training text")
    prepare_bible.learn_apply_bpe(raw, bpe, merges, splits=tuple(SPLITS))
    cmd = fa.preprocess(bpe / "train", bin_dir, valid=bpe / "valid", tests=[bpe / "test", bpe / "test1"], workers=2)
    log_path = work / "preprocess.log"
    with open(log_path, "w", encoding="utf-8") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
            raise Multi30kError(f"fairseq-preprocess failed: see {log_path}, then re-run `prepare`")
    prepare_bible.mark(bpe, bin_dir)  # for deepinit-export --to huggingface's tokenizer
    (bin_dir / ".done").write_text("ok\n")
    return bin_dir


# ---------------------------------------------------------------------------------------------
# the command line (scripts/multi30k_data.py)


def build_parser() -> argparse.ArgumentParser:
    """The command line: where to look and where to cache."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Prints the folder.",
    )
    p.add_argument(
        "--multi30k-dir",
        type=str,  # not Path: an empty value means "not given", as an empty MULTI30K_DIR does
        default=None,
        help="folder with Multi30k's task1 raw gzip files, read in place (default: $MULTI30K_DIR, else "
        f"{LOCAL_DEFAULT} if it holds them, else the pinned public release, downloaded once into --cache)",
    )
    p.add_argument(
        "--cache", type=Path, default=CACHE, help="where the downloaded release is kept (default: %(default)s)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        print(locate(a.multi30k_dir, cache=a.cache))
    except Multi30kError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
