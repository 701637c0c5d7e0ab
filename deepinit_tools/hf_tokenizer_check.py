"""The Hugging Face export's tokenizer against the data pipeline it stands for, line by line, and why a
``tokenizers`` BPE could not stand for it (docs/export_tokenizer.md has the quickstart's figures).

For every split and language of a prepared folder (the raw text of
:func:`deepinit_tools.prepare_bible.learn_apply_bpe`, and
the binarised folder with its marker, which names the codes and vocabularies) it prints:

- how many sentences subword-nmt's vocabulary filter segments differently from the plain BPE of the same
  codes, and how many word tokens;
- how many sentences' plain BPE holds a token the dictionary lacks (``<unk>`` to fairseq);
- for the merge table without the merges whose result the filter rejects: the corpus's word types it segments
  differently from the filter, and the sentences;
- the exported tokenizer (:func:`fairseq_deepinit.export.hf_tokenizer.write_tokenizer`, loaded by
  ``transformers``): sentences whose ids equal ``tokenize`` -> ``apply-bpe`` -> ``Dictionary.encode_line``, whose
  ids equal the binarised split (where it was not length-filtered), and whose decoding of those ids equals
  ``--remove-bpe`` -> ``detokenize``.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

from deepinit_tools import prepare_bible


def _bpe(codes_text: str, vocab: set | None = None):
    from subword_nmt.apply_bpe import BPE

    return BPE(io.StringIO(codes_text), vocab=vocab)


def restricted_codes(codes_text: str, vocab: set) -> str:
    """The codes without the merges whose result the filter rejects (a non-final ``x`` without ``x@@`` in the
    vocabulary, a final ``x</w>`` without ``x``)."""
    header, *merges = codes_text.rstrip("\n").split("\n")

    def kept(result: str) -> bool:
        return result[:-4] in vocab if result.endswith("</w>") else result + "@@" in vocab

    return "\n".join([header, *(m for m in merges if kept(m.replace(" ", "")))]) + "\n"


def filter_figures(lines: Sequence[str], codes_text: str, vocab: set, symbols: set) -> Dict[str, str]:
    """The three 'why not tokenizers' figures for the tokenised ``lines`` of one language."""
    plain, filtered, restricted = _bpe(codes_text), _bpe(codes_text, vocab), _bpe(restricted_codes(codes_text, vocab))
    n = len(lines)
    seg = [(plain.process_line(x), filtered.process_line(x), restricted.process_line(x)) for x in lines]
    words = [w for x in lines for w in x.split()]
    types = sorted(set(words))
    return {
        "filter changes sentences": f"{sum(p != f for p, f, _ in seg)}/{n}",
        "filter changes word tokens": f"{sum(plain.segment(w) != filtered.segment(w) for w in words)}/{len(words)}",
        "plain BPE has a token outside the dictionary": f"{sum(any(t not in symbols for t in p.split()) for p, _, _ in seg)}/{n}",  # noqa: E501
        "restricted table differs, word types": f"{sum(restricted.segment(w) != filtered.segment(w) for w in types)}/{len(types)}",  # noqa: E501
        "restricted table differs, sentences": f"{sum(r != f for _, f, r in seg)}/{n}",
    }


def tokenizer_figures(tok, raw: List[str], want: List[List[int]], binarised: List[List[int]] | None, dictionary):
    """The exported tokenizer's equalities on one split of one language."""
    start = time.perf_counter()
    got = tok(raw)["input_ids"]
    seconds = time.perf_counter() - start
    decoded = tok.batch_decode(want, skip_special_tokens=True)
    ref = [prepare_bible.detokenize(dictionary.string(ids, "@@ ")) for ids in want]
    out = {
        "ids == pipeline": f"{sum(a == b for a, b in zip(got, want, strict=True))}/{len(raw)}",
        "decode == remove-bpe + detokenize": f"{sum(a == b for a, b in zip(decoded, ref, strict=True))}/{len(raw)}",
        "encode lines/s": f"{len(raw) / max(seconds, 1e-9):.0f}",
    }
    if binarised is not None:
        out["ids == binarised split"] = f"{sum(a == b for a, b in zip(got, binarised, strict=True))}/{len(raw)}"
    return out


def check(raw_dir: Path, bin_dir: Path, splits: Sequence[str], why_not: bool = True) -> List[str]:
    """The report's lines (see the module)."""
    from fairseq.data import Dictionary, data_utils
    from subword_nmt.apply_bpe import read_vocabulary
    from transformers import AutoTokenizer

    from fairseq_deepinit.export import hf_tokenizer as ht

    pipeline = ht.describe_pipeline(bin_dir)
    if pipeline is None:
        raise SystemExit(f"{bin_dir} has no {ht.MARKER}: run `scripts/prepare_bible.py mark --bpe BPE --bin BIN`")
    langs = (pipeline.source_lang, pipeline.target_lang)
    dictionary = Dictionary.load(str(bin_dir / f"dict.{langs[0]}.txt"))
    if dictionary.symbols != Dictionary.load(str(bin_dir / f"dict.{langs[1]}.txt")).symbols:
        raise SystemExit(f"{bin_dir}: the dictionaries differ; this check reads joined dictionaries only")
    if pipeline.codes is None or pipeline.pretokenizer != "punct":
        raise SystemExit(f"{bin_dir}: not prepare_bible's text (tokenize, subword-nmt BPE), which this check reads")
    codes_text = pipeline.codes.read_text(encoding="utf-8")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = ht.write_tokenizer(Path(tmp) / "tok", dictionary, dictionary, pipeline)
        for src, folder in zip(langs, (folders[0], folders[-1]), strict=True):  # the source's, the target's
            tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
            vocab = None
            if pipeline.vocabulary_threshold is not None:
                with open(pipeline.vocabularies[src], encoding="utf-8") as f:
                    vocab = read_vocabulary(f, pipeline.vocabulary_threshold)
            filtered = _bpe(codes_text, vocab)
            for split in splits:
                raw = (raw_dir / f"{split}.{src}").read_text(encoding="utf-8").splitlines()
                tokenised = [prepare_bible.tokenize(line) for line in raw]
                want = [dictionary.encode_line(filtered.process_line(x), add_if_not_exist=False).tolist()
                        for x in tokenised]  # fmt: skip
                prefix = bin_dir / f"{split}.{langs[0]}-{langs[1]}.{src}"
                data = (
                    data_utils.load_indexed_dataset(str(prefix), dictionary) if Path(f"{prefix}.bin").exists() else None
                )
                binarised = (
                    [data[i].tolist() for i in range(len(data))] if data is not None and len(data) == len(raw) else None
                )
                figures = tokenizer_figures(tok, raw, want, binarised, dictionary)
                if why_not and vocab is not None:
                    figures.update(filter_figures(tokenised, codes_text, vocab, set(dictionary.symbols)))
                out.append(f"{split}.{src} ({len(raw)} lines): " + "; ".join(f"{k} {v}" for k, v in figures.items()))
                print(out[-1], flush=True)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--raw", type=Path, required=True, help="the raw text: SPLIT.LANG files (no default)")
    parser.add_argument("--bin", type=Path, required=True, help="the binarised folder with its marker (no default)")
    parser.add_argument("--splits", nargs="+", default=["train", "valid", "test"], help="default: %(default)s")
    parser.add_argument("--no-why-not", action="store_true", help="skip the tokenizers figures (default: off)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for path in (args.raw, args.bin):
        if not path.is_dir():
            print(f"error: {path} is not a folder", file=sys.stderr)
            return 1
    check(args.raw, args.bin, args.splits, why_not=not args.no_why_not)
    return 0
