"""The text pipeline of a binarised data folder, written as a Hugging Face tokenizer next to an exported model.

A pipeline that makes fairseq data records how it made the text in a marker, :data:`MARKER`, in the folder it
binarises into (:func:`write_marker`): the pre-tokeniser, and subword-nmt's BPE codes and vocabularies with the
filter threshold, copied into the folder so that an export finds them. :func:`describe_pipeline` reads the marker
back (None without one). :func:`write_tokenizer` writes a tokenizer whose ids are the fairseq dictionary's:
:mod:`fairseq_deepinit.export.hf_remote_tokenizer` copied in as ``tokenization_deepinit.py``, the dictionary,
codes and the source language's BPE vocabulary, and ``tokenizer_config.json`` pointing ``AutoTokenizer`` at it.
Loading it takes ``trust_remote_code=True`` and only ``transformers``.

Why not a ``tokenizers`` ``tokenizer.json``: subword-nmt's vocabulary filter (``apply-bpe --vocabulary V
--vocabulary-threshold N``, the quickstart's) undoes merges after the BPE, which no ``tokenizers`` model
expresses, and a BPE model cannot map several of its symbols (merge results the dictionary lacks) to ``<unk>``'s
one id: its merges are keyed by symbol ids. docs/export.md, "Tokenizer", has the measurements.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Tuple

from fairseq_deepinit.errors import ExportError

MARKER = "text_pipeline.json"
FORMAT = 1
PRETOKENIZERS = ("punct", "words", "lower")
SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # fairseq's Dictionary: ids 0, 1, 2, 3
# copied, never imported here: it imports transformers, which data preparation does not need
REMOTE_SOURCE = Path(__file__).with_name("hf_remote_tokenizer.py")
REMOTE_MODULE = "tokenization_deepinit"
TARGET_SUBDIR = "target_tokenizer"


class PipelineError(ExportError):
    """A marker, codes or dictionary this module cannot use; the message says what to do."""


@dataclass(frozen=True)
class TextPipeline:
    """How the text of a binarised folder was made (the marker, read by :func:`describe_pipeline`).

    ``pretokenizer``: ``punct`` (``deepinit_tools.prepare_bible.tokenize``), ``words`` (``multi30k.words``) or
    ``lower`` (``multi30k.lower``); ``codes``: subword-nmt's codes (None: word-level text); ``vocabularies`` and
    ``vocabulary_threshold``: ``apply-bpe``'s vocabulary filter per language (None: no filter)."""

    source_lang: str
    target_lang: str
    pretokenizer: str
    codes: Path | None = None
    vocabularies: Mapping[str, Path] | None = None
    vocabulary_threshold: int | None = None


def _copy_if_changed(src: Path, dst: Path) -> bool:
    if dst.exists() and dst.read_bytes() == src.read_bytes():
        return False
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)
    return True


def write_marker(
    data_dir: Path,
    langs: Tuple[str, str],
    pretokenizer: str,
    codes: Path | None = None,
    vocabularies: Mapping[str, Path] | None = None,
    vocabulary_threshold: int | None = None,
) -> bool:
    """Write :data:`MARKER` into ``data_dir``, copying ``codes`` and ``vocabularies`` there as ``bpe.codes`` and
    ``bpe.vocab.LANG``. Returns whether anything changed (a second call with the same content changes nothing)."""
    if pretokenizer not in PRETOKENIZERS:
        raise PipelineError(f"unknown pre-tokeniser {pretokenizer!r}; choose from {', '.join(PRETOKENIZERS)}")
    bpe = None
    copies: List[Tuple[Path, str]] = []
    if codes is not None:
        names = {lang: f"bpe.vocab.{lang}" for lang in (vocabularies or {})}
        copies = [(codes, "bpe.codes")] + [(Path(vocabularies[lang]), name) for lang, name in names.items()]
        bpe = {"kind": "subword-nmt", "codes": "bpe.codes", "separator": "@@"}
        bpe.update(vocabularies=names or None, vocabulary_threshold=vocabulary_threshold)
    record = {"format": FORMAT, "source_lang": langs[0], "target_lang": langs[1], "pretokenizer": pretokenizer}
    record["bpe"] = bpe
    changed = False
    for src, name in copies:
        changed |= _copy_if_changed(Path(src), data_dir / name)
    marker = data_dir / MARKER
    text = json.dumps(record, indent=1, sort_keys=True) + "\n"
    if not marker.exists() or marker.read_text(encoding="utf-8") != text:
        tmp = marker.with_name(MARKER + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(marker)
        changed = True
    return changed


def describe_pipeline(data_dir: str | Path) -> TextPipeline | None:
    """The pipeline recorded in ``data_dir``'s :data:`MARKER`, or None where there is no marker."""
    data_dir = Path(data_dir)
    marker = data_dir / MARKER
    if not marker.exists():
        return None
    redo = "delete it and re-run the data preparation (it writes the marker again)"
    try:
        record = json.loads(marker.read_text(encoding="utf-8"))
        if record.get("format") != FORMAT:
            raise PipelineError(f"{marker} has format {record.get('format')!r}; this version reads {FORMAT}: {redo}")
        bpe = record["bpe"]
        codes = vocabularies = threshold = None
        if bpe is not None:
            if bpe["kind"] != "subword-nmt" or bpe["separator"] != "@@":
                raise PipelineError(f"{marker}: only subword-nmt BPE with the separator @@ is known, not {bpe}")
            codes = data_dir / bpe["codes"]
            vocabularies = {lang: data_dir / name for lang, name in (bpe["vocabularies"] or {}).items()} or None
            threshold = bpe["vocabulary_threshold"]
        pipeline = TextPipeline(record["source_lang"], record["target_lang"], record["pretokenizer"], codes,
                                vocabularies, threshold)  # fmt: skip
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise PipelineError(f"{marker} is not a text-pipeline marker ({e}): {redo}") from e
    if pipeline.pretokenizer not in PRETOKENIZERS:
        raise PipelineError(f"{marker}: unknown pre-tokeniser {pipeline.pretokenizer!r}: {redo}")
    if threshold is not None and not set(vocabularies or ()) >= {pipeline.source_lang, pipeline.target_lang}:
        raise PipelineError(f"{marker}: a vocabulary threshold needs both languages' BPE vocabularies: {redo}")
    for path in [codes, *(vocabularies or {}).values()]:
        if path is not None and not path.exists():
            raise PipelineError(f"{marker} names {path}, which is missing: {redo}")
    return pipeline


def _symbols_and_counts(dictionary) -> Tuple[List[str], List[int]]:
    """A fairseq ``Dictionary``'s symbols and counts (or a plain list of symbols, counts 1)."""
    symbols = list(getattr(dictionary, "symbols", dictionary))
    counts = list(getattr(dictionary, "count", [1] * len(symbols)))
    if tuple(symbols[:4]) != SPECIALS:
        raise PipelineError(f"the dictionary starts with {symbols[:4]}, not fairseq's {list(SPECIALS)}")
    return symbols, counts


def write_dict(path: Path, dictionary) -> None:
    """``dict.txt`` as fairseq writes it (the four specials implicit), repeats flagged ``#fairseq:overwrite``
    so that a symbol keeps the id ``Dictionary.index`` gives it (its last)."""
    symbols, counts = _symbols_and_counts(dictionary)
    seen = set(SPECIALS)
    lines = []
    for sym, count in zip(symbols[4:], counts[4:], strict=True):
        if not sym or any(c.isspace() for c in sym) or sym != sym.strip():
            raise PipelineError(f"the dictionary has the symbol {sym!r}, which dict.txt cannot hold")
        lines.append(f"{sym} {count}" + (" #fairseq:overwrite" if sym in seen else ""))
        seen.add(sym)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _write_one(folder: Path, dictionary, pipeline: TextPipeline, lang: str, model_max_length: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(REMOTE_SOURCE, folder / f"{REMOTE_MODULE}.py")
    write_dict(folder / "dict.txt", dictionary)
    config: Dict = {
        "tokenizer_class": "DeepinitTokenizer",
        "auto_map": {"AutoTokenizer": [f"{REMOTE_MODULE}.DeepinitTokenizer", None]},
        "pretokenizer": pipeline.pretokenizer,
        "vocabulary_threshold": None,
        "bos_token": "<s>",
        "pad_token": "<pad>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
    }
    if pipeline.codes is not None:
        shutil.copyfile(pipeline.codes, folder / "bpe.codes")
        if pipeline.vocabulary_threshold is not None:
            if lang not in (pipeline.vocabularies or {}):
                raise PipelineError(f"a vocabulary threshold without the {lang} BPE vocabulary: give vocabularies")
            shutil.copyfile(pipeline.vocabularies[lang], folder / "bpe.vocab")
            config["vocabulary_threshold"] = pipeline.vocabulary_threshold
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")


def write_tokenizer(
    out_dir: str | Path, src_dict, tgt_dict, pipeline: TextPipeline, model_max_length: int = 1024
) -> List[Path]:
    """Write the tokenizer of ``pipeline`` into ``out_dir``: the source language's (its text encodes as the
    encoder's input), over ``src_dict``; with a joined dictionary it also decodes generated ids. Where the target
    language's text is made differently (another dictionary, or the BPE vocabulary filter of its own language),
    the target's tokenizer goes into ``out_dir/target_tokenizer`` too (target text to label ids, generated ids to
    text). ``src_dict`` and ``tgt_dict`` are fairseq ``Dictionary`` objects (or symbol lists). Returns the folders
    written."""
    out_dir = Path(out_dir)
    _write_one(out_dir, src_dict, pipeline, pipeline.source_lang, model_max_length)
    joined = _symbols_and_counts(src_dict)[0] == _symbols_and_counts(tgt_dict)[0]
    if joined and (pipeline.codes is None or pipeline.vocabulary_threshold is None):
        return [out_dir]
    _write_one(out_dir / TARGET_SUBDIR, tgt_dict, pipeline, pipeline.target_lang, model_max_length)
    return [out_dir, out_dir / TARGET_SUBDIR]
