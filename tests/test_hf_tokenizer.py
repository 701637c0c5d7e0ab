"""deepinit-export's Hugging Face tokenizer (fairseq_deepinit/export/hf_tokenizer.py, hf_remote_tokenizer.py)
against the data pipelines it stands for, line by line on real Multi30k text read in place:

- the quickstart's (prepare_bible.tokenize, joint subword-nmt BPE applied with its vocabulary filter,
  fairseq's dictionary, ``</s>`` appended): every line's ids equal ``Dictionary.encode_line`` of the BPE file;
- decoding equals fairseq-generate's ``--remove-bpe`` then ``prepare_bible.detokenize``;
- the Multi30k word-level pipelines (``multi30k.words`` and ``.lower``);
- the folder loads and runs where neither fairseq nor this project can be imported;
- the marker: written by the pipelines' ``mark`` (also into a folder binarised before it existed), read back.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MULTI30K

transformers = pytest.importorskip("transformers")

from deepinit_tools import multi30k, prepare_bible  # noqa: E402
from fairseq_deepinit.export import hf_remote_tokenizer as remote  # noqa: E402
from fairseq_deepinit.export import hf_tokenizer as ht  # noqa: E402

SIZES = {"train": ("train", 400), "valid": ("val", 150), "test": ("test_2016_flickr", 150)}
MERGES = 600
# a line no Multi30k split has: characters outside the training text (<unk> in fairseq), brackets, quotes
EXTRA = "Ωmega (zwei) „Hunde“ laufen... [x] ab; ,ok"


def needs_multi30k() -> None:
    if not (MULTI30K / "train.de.gz").exists():
        pytest.skip(f"Multi30k not found at {MULTI30K} (set MULTI30K_DIR)")


def build_dictionary(files):
    """fairseq-preprocess's joined dictionary of ``files`` (TranslationTask.build_dictionary, padding factor 8)."""
    from fairseq.tasks.translation import TranslationTask

    return TranslationTask.build_dictionary([str(f) for f in files], workers=1, threshold=-1, nwords=-1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Raw Multi30k lines (a few hundred a split) -> prepare_bible.learn_apply_bpe (the quickstart's BPE, vocabulary
    filter included) -> a joined dictionary; the folder marked as the quickstart marks its data."""
    needs_multi30k()
    root = tmp_path_factory.mktemp("hftok")
    raw, bpe, data = root / "raw", root / "bpe", root / "bin"
    raw.mkdir()
    data.mkdir()
    for split, (stem, n) in SIZES.items():
        for lang in ("de", "en"):
            lines = multi30k.read_lines(MULTI30K, stem, lang, multi30k.spaces, n)
            (raw / f"{split}.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    prepare_bible.learn_apply_bpe(raw, bpe, MERGES)
    dictionary = build_dictionary([bpe / "train.de", bpe / "train.en"])
    for lang in ("de", "en"):  # joined, as the quickstart's
        dictionary.save(str(data / f"dict.{lang}.txt"))
    assert prepare_bible.main(["mark", "--bpe", str(bpe), "--bin", str(data)]) == 0
    return root, raw, bpe, data, dictionary


def load(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)


def pipeline_ids(line: str, bpe: Path, lang: str, dictionary, threshold: int | None = prepare_bible.VOCAB_THRESHOLD):
    """The quickstart's ids of a raw line: tokenize, subword-nmt apply-bpe (with the filter), encode_line."""
    from subword_nmt.apply_bpe import BPE, read_vocabulary

    with open(bpe / f"vocab.{lang}", encoding="utf-8") as f:
        vocab = read_vocabulary(f, threshold) if threshold is not None else None
    with open(bpe / "codes", encoding="utf-8") as f:
        segmented = BPE(f, vocab=vocab).process_line(prepare_bible.tokenize(line))
    return dictionary.encode_line(segmented, add_if_not_exist=False, append_eos=True).tolist()


@pytest.mark.slow  # all of Multi30k, 3 s
def test_the_pre_tokenisers_are_the_pipelines_on_every_line():
    """hf_remote_tokenizer carries its own copy of the pipelines' regular expressions: equal on all of Multi30k."""
    needs_multi30k()
    n = 0
    for stem in ("train", "val", "test_2016_flickr"):
        for lang in ("de", "en"):
            for line in multi30k.read_lines(MULTI30K, stem, lang, multi30k.spaces):
                tokens = prepare_bible.tokenize(line)
                assert remote.pretokenize(line, "punct") == tokens.split(), line
                assert remote.detokenize(tokens, "punct") == prepare_bible.detokenize(tokens), line
                assert remote.pretokenize(line, "words") == multi30k.words(line).split(), line
                assert remote.pretokenize(line, "lower") == multi30k.lower(line).split(), line
                n += 1
    assert n > 60000
    assert remote.pretokenize(EXTRA, "punct") == prepare_bible.tokenize(EXTRA).split()


@pytest.mark.slow  # the corpus fixture runs subword-nmt's commands
def test_ids_are_the_pipelines_on_every_line(corpus, tmp_path):
    """Every line of every split, in both languages (German through the folder's tokenizer, English through
    target_tokenizer/, which applies the English vocabulary filter): the tokenizer's ids are
    Dictionary.encode_line of the BPE file fairseq binarised."""
    _, raw, bpe, data, dictionary = corpus
    pipeline = ht.describe_pipeline(data)
    assert pipeline is not None and pipeline.vocabulary_threshold == prepare_bible.VOCAB_THRESHOLD
    written = ht.write_tokenizer(tmp_path / "tok", dictionary, dictionary, pipeline)
    assert written == [tmp_path / "tok", tmp_path / "tok" / ht.TARGET_SUBDIR]
    for lang, folder in zip(("de", "en"), written, strict=True):
        tok = load(folder)
        for split in SIZES:
            lines = (raw / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()
            want = [dictionary.encode_line(line, add_if_not_exist=False, append_eos=True).tolist()
                    for line in (bpe / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()]  # fmt: skip
            assert tok(lines)["input_ids"] == want, (lang, split)
        extra = tok(EXTRA)["input_ids"]
        assert extra == pipeline_ids(EXTRA, bpe, lang, dictionary) and dictionary.unk() in extra
        tok.save_pretrained(tmp_path / f"{lang}-saved")  # what transformers writes back loads as the same tokenizer
        assert load(tmp_path / f"{lang}-saved")(lines)["input_ids"] == want


@pytest.mark.slow  # the corpus fixture runs subword-nmt's commands
def test_the_vocabulary_filter_is_what_makes_them_equal(corpus, tmp_path):
    """The check above can fail: without subword-nmt's vocabulary filter (plain BPE of the same codes), the ids
    of most validation lines differ from the pipeline's."""
    _, raw, bpe, data, dictionary = corpus
    pipeline = dataclasses.replace(ht.describe_pipeline(data), vocabulary_threshold=None)
    ht.write_tokenizer(tmp_path, dictionary, dictionary, pipeline)
    lines = (raw / "valid.de").read_text(encoding="utf-8").splitlines()
    got = load(tmp_path)(lines)["input_ids"]
    assert got == [pipeline_ids(line, bpe, "de", dictionary, threshold=None) for line in lines]
    differ = sum(a != pipeline_ids(line, bpe, "de", dictionary) for a, line in zip(got, lines, strict=True))
    assert differ > len(lines) // 2, differ


@pytest.mark.slow  # the corpus fixture runs subword-nmt's commands
def test_decoding_is_remove_bpe_then_detokenize(corpus, tmp_path):
    """batch_decode(skip_special_tokens=True) of the target ids is fairseq-generate's string with --remove-bpe, then
    prepare_bible.detokenize (as the quickstart scores); <unk> stays as fairseq prints it, padding goes."""
    _, _, bpe, data, dictionary = corpus
    ht.write_tokenizer(tmp_path, dictionary, dictionary, ht.describe_pipeline(data))
    tok = load(tmp_path)
    ids = [dictionary.encode_line(line, add_if_not_exist=False, append_eos=True).tolist()
           for split in SIZES for line in (bpe / f"{split}.en").read_text(encoding="utf-8").splitlines()]  # fmt: skip
    piece = next(i for i, s in enumerate(dictionary.symbols) if s.endswith("@@"))
    ids += [[piece, dictionary.unk(), 10, piece, dictionary.eos(), dictionary.pad()], [dictionary.bos(), piece, 4]]
    # fairseq-generate's hypotheses never hold <pad>; Dictionary.string would print it
    want = [prepare_bible.detokenize(dictionary.string([i for i in x if i != dictionary.pad()], "@@ ")) for x in ids]
    assert tok.batch_decode(ids, skip_special_tokens=True) == want
    assert "<unk>" in want[-2]


@pytest.mark.slow  # the corpus fixture runs subword-nmt's commands
def test_loads_and_runs_without_fairseq_or_this_project(corpus, tmp_path):
    """A fresh interpreter in which fairseq, the plugin, the tools and subword-nmt cannot be imported (an import
    hook refuses them): AutoTokenizer loads the folder and gives the same ids and text."""
    _, raw, _, data, dictionary = corpus
    ht.write_tokenizer(tmp_path / "tok", dictionary, dictionary, ht.describe_pipeline(data))
    lines = (raw / "test.de").read_text(encoding="utf-8").splitlines()[:20] + [EXTRA]
    ids = [[5, 20, dictionary.unk(), 30, 2]]
    script = (
        "import importlib.abc, json, sys\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('fairseq', 'fairseq_cli', 'fairseq_deepinit', 'deepinit_tools',"
        " 'subword_nmt'):\n"
        "            raise ImportError('refused: ' + name)\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "from transformers import AutoTokenizer\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "lines, ids = json.loads(sys.stdin.read())\n"
        "print(json.dumps([tok(lines)['input_ids'], tok.batch_decode(ids, skip_special_tokens=True)]))\n"
    )
    proc = subprocess.run([sys.executable, "-I", "-c", script, str(tmp_path / "tok")], input=json.dumps([lines, ids]),
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok = load(tmp_path / "tok")
    assert json.loads(proc.stdout) == [tok(lines)["input_ids"], tok.batch_decode(ids, skip_special_tokens=True)]


@pytest.mark.slow  # the corpus fixture runs subword-nmt's commands
def test_separate_dictionaries_get_a_target_tokenizer(corpus, tmp_path):
    """Without a joined dictionary (the Multi30k matrix), the target's tokenizer goes into target_tokenizer/."""
    _, raw, bpe, data, _ = corpus
    src_dict, tgt_dict = build_dictionary([bpe / "train.de"]), build_dictionary([bpe / "train.en"])
    written = ht.write_tokenizer(tmp_path, src_dict, tgt_dict, ht.describe_pipeline(data))
    assert written == [tmp_path, tmp_path / ht.TARGET_SUBDIR]
    line = (bpe / "valid.en").read_text(encoding="utf-8").splitlines()[0]
    ids = tgt_dict.encode_line(line, add_if_not_exist=False, append_eos=True).tolist()
    assert (
        load(tmp_path / ht.TARGET_SUBDIR)((raw / "valid.en").read_text(encoding="utf-8").splitlines()[0])["input_ids"]
        == ids
    )
    assert load(tmp_path / ht.TARGET_SUBDIR).decode(ids, skip_special_tokens=True) == prepare_bible.detokenize(
        tgt_dict.string(ids, "@@ ")
    )


@pytest.mark.parametrize("name", ["words", "lower"])
def test_word_level_pipelines(name, tmp_path):
    """multi30k.binarize_multi30k's text (no BPE): ids of encode_line, decoding the tokens space-separated."""
    needs_multi30k()
    lines = multi30k.read_lines(MULTI30K, "train", "de", lambda x: x, 300)
    tokenised = tmp_path / "train.tok.de"
    tokenised.write_text("".join(multi30k.TOKENIZERS[name](line) + "\n" for line in lines[:200]), encoding="utf-8")
    dictionary = build_dictionary([tokenised])
    ht.write_marker(tmp_path, ("de", "en"), name)
    ht.write_tokenizer(tmp_path / "tok", dictionary, dictionary, ht.describe_pipeline(tmp_path))
    tok = load(tmp_path / "tok")
    want = [dictionary.encode_line(multi30k.TOKENIZERS[name](line), add_if_not_exist=False).tolist() for line in lines]
    assert tok(lines)["input_ids"] == want
    assert any(dictionary.unk() in w for w in want[200:])  # lines 200-299 have words the dictionary lacks
    assert tok.batch_decode(want, skip_special_tokens=True) == [dictionary.string(w) for w in want]


@pytest.mark.slow  # the corpus fixture runs subword-nmt's commands
def test_the_marker_is_written_once_and_read_back(corpus, tmp_path):
    """A folder binarised before the marker existed gets it from `prepare_bible.py mark` (the quickstart runs it on
    every run); the same content again changes nothing; no marker: None; a broken one: one error saying what to do."""
    _, _, bpe, _, _ = corpus
    assert ht.describe_pipeline(tmp_path) is None
    assert prepare_bible.mark(bpe, tmp_path) is True
    assert prepare_bible.mark(bpe, tmp_path) is False
    pipeline = ht.describe_pipeline(tmp_path)
    assert pipeline.pretokenizer == "punct" and pipeline.codes.read_bytes() == (bpe / "codes").read_bytes()
    assert pipeline.vocabularies["en"].read_bytes() == (bpe / "vocab.en").read_bytes()
    (tmp_path / "bpe.codes").unlink()
    with pytest.raises(ht.PipelineError, match="missing: delete it and re-run the data preparation"):
        ht.describe_pipeline(tmp_path)
    (tmp_path / ht.MARKER).write_text("{}")
    with pytest.raises(ht.PipelineError, match="has format None"):
        ht.describe_pipeline(tmp_path)
    assert prepare_bible.main(["mark", "--bpe", str(tmp_path / "nothing"), "--bin", str(tmp_path)]) == 1


def test_the_quickstart_marks_its_data_on_every_run():
    """After the binarise step and outside its `.done` skip, so that data binarised earlier gets the marker."""
    from conftest import REPO

    script = (REPO / "scripts" / "quickstart.sh").read_text()
    mark = script.index('prepare_bible.py mark --bpe "$BPE" --bin "$BIN"')
    assert script.index('touch "$BIN/.done"') < mark < script.index("step train")
    assert script.rindex("\nfi\n", 0, mark) > script.index('touch "$BIN/.done"')


@pytest.mark.slow  # the corpus fixture runs subword-nmt's commands
def test_the_check_tool_reports_every_line_equal(corpus, capsys):
    """scripts/hf_tokenizer_check.py (deepinit_tools.hf_tokenizer_check): on the small corpus, every line's ids and
    decoding equal, and the filter's effect (the reason for the remote-code tokenizer) is there to see."""
    from deepinit_tools import hf_tokenizer_check

    _, raw, _, data, _ = corpus
    assert hf_tokenizer_check.main(["--raw", str(raw), "--bin", str(data), "--splits", "valid", "test"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == ["valid.de", "test.de", "valid.en", "test.en"]
    for line, (_, n) in zip(lines, [SIZES["valid"], SIZES["test"]] * 2, strict=True):
        assert f"ids == pipeline {n}/{n}; decode == remove-bpe + detokenize {n}/{n}" in line, line
        changed = int(line.split("filter changes sentences ")[1].split("/")[0])
        assert changed > n // 2, line
    assert hf_tokenizer_check.main(["--raw", str(raw / "nothing"), "--bin", str(data)]) == 1


def small_multi30k(root: Path, n: int) -> Path:
    """The first ``n`` lines of each Multi30k file, as it is (cased), in a temporary folder of Multi30k's names."""
    import gzip

    root.mkdir(parents=True, exist_ok=True)
    for name in multi30k.SHA256:
        with (
            gzip.open(MULTI30K / name, "rt", encoding="utf-8") as f,
            gzip.open(root / name, "wt", encoding="utf-8") as g,
        ):
            for _, line in zip(range(n), f, strict=False):
                g.write(line)
    return root


def binarised(prefix: Path, dictionary) -> list:
    from fairseq.data import data_utils

    data = data_utils.load_indexed_dataset(str(prefix), dictionary)
    return [data[i].tolist() for i in range(len(data))]


@pytest.mark.slow  # subword-nmt and fairseq-preprocess
def test_the_multi30k_matrix_data_is_marked_and_its_tokenizers_give_its_ids(tmp_path):
    """multi30k.prepare_bpe (separate dictionaries): the marker is written, the source tokenizer's ids are the
    binarised German test set, the target tokenizer's the English one; a folder prepared before the marker
    existed gets it on the next call, with nothing redone."""
    from fairseq.data import Dictionary

    needs_multi30k()
    work = tmp_path / "work"
    data = multi30k.prepare_bpe(work, 300, small_multi30k(tmp_path / "m30k", 200))
    pipeline = ht.describe_pipeline(data)
    assert pipeline.pretokenizer == "punct" and pipeline.vocabulary_threshold == prepare_bible.VOCAB_THRESHOLD
    dicts = {lang: Dictionary.load(str(data / f"dict.{lang}.txt")) for lang in ("de", "en")}
    assert ht.write_tokenizer(tmp_path / "tok", dicts["de"], dicts["en"], pipeline) == [
        tmp_path / "tok",
        tmp_path / "tok" / ht.TARGET_SUBDIR,
    ]
    for lang, folder in (("de", tmp_path / "tok"), ("en", tmp_path / "tok" / ht.TARGET_SUBDIR)):
        raw = (work / "raw" / f"test.{lang}").read_text(encoding="utf-8").splitlines()
        assert load(folder)(raw)["input_ids"] == binarised(data / f"test.de-en.{lang}", dicts[lang])
    (data / ht.MARKER).unlink()
    before = (data / "train.de-en.de.bin").stat().st_mtime_ns
    assert multi30k.prepare_bpe(work, 300, tmp_path / "absent") == data  # not even looked up again
    assert ht.describe_pipeline(data) == pipeline and (data / "train.de-en.de.bin").stat().st_mtime_ns == before


@pytest.mark.slow  # fairseq-preprocess
def test_the_word_level_data_is_marked_and_its_tokenizer_gives_its_ids(tmp_path):
    """multi30k.binarize_multi30k: the marker names its pre-tokeniser; the tokenizer's ids are the binarised
    validation set; a reused folder (its STAMP.json) gets the marker back."""
    from fairseq.data import Dictionary

    needs_multi30k()
    root = small_multi30k(tmp_path / "m30k", 300)
    splits = {"train": ("train", 250), "valid": ("val", 100)}
    data = multi30k.binarize_multi30k(root, tmp_path / "bin", splits, tokenizer="words")
    pipeline = ht.describe_pipeline(data)
    assert pipeline.pretokenizer == "words" and pipeline.codes is None
    dicts = {lang: Dictionary.load(str(data / f"dict.{lang}.txt")) for lang in ("de", "en")}
    ht.write_tokenizer(tmp_path / "tok", dicts["de"], dicts["en"], pipeline)
    raw = multi30k.read_lines(root, "val", "de", lambda line: line, 100)
    ids = load(tmp_path / "tok")(raw)["input_ids"]
    assert ids == binarised(data / "valid.de-en.de", dicts["de"]) and any(dicts["de"].unk() in x for x in ids)
    (data / ht.MARKER).unlink()
    assert multi30k.binarize_multi30k(root, tmp_path / "bin", splits, tokenizer="words") == data
    assert ht.describe_pipeline(data) == pipeline
