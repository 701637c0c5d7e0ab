"""Raw text through an exported CTranslate2 model, as the quickstart translates with fairseq.

``deepinit-export CHECKPOINT OUT --to ctranslate2`` writes the model; this translates raw sentences with it:
the quickstart's tokenisation (:func:`deepinit_tools.prepare_bible.tokenize`), its BPE (subword-nmt's
``apply-bpe`` with the codes and the vocabulary filter the corpus was prepared with), CTranslate2's beam
search with fairseq-generate's options (:mod:`fairseq_deepinit.export.decoding`), BPE removed as
``--remove-bpe`` does, :func:`~deepinit_tools.prepare_bible.detokenize`. Optionally scored (sacreBLEU against
raw references) and compared with a fairseq-generate output of the same sentences (identical hypotheses,
speed from fairseq-generate's own timing line).

    python scripts/translate_ct2.py MODEL_DIR --codes BPE/codes --vocabulary BPE/vocab.de < in.de > out.en
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

from deepinit_tools.decode_report import add_options, emit
from deepinit_tools.prepare_bible import detokenize, tokenize
from fairseq_deepinit.export.decoding import FairseqDecoding, fairseq_batches, translate_tokens
from fairseq_deepinit.export.run import METADATA

FAIRSEQ_DEFAULTS = FairseqDecoding()


class Bpe:
    """subword-nmt's ``apply-bpe`` in-process: ``codes``, and the vocabulary filter when ``vocabulary`` is given."""

    def __init__(self, codes: Path, vocabulary: Path | None = None, threshold: int = 50) -> None:
        from subword_nmt.apply_bpe import BPE, read_vocabulary

        vocab = None
        if vocabulary is not None:
            with open(vocabulary, encoding="utf-8") as f:
                vocab = read_vocabulary(f, threshold)
        with open(codes, encoding="utf-8") as f:
            self._bpe = BPE(f, vocab=vocab)

    def __call__(self, line: str) -> str:
        return self._bpe.process_line(line)


def remove_bpe(tokens: Sequence[str]) -> str:
    """fairseq's ``--remove-bpe`` (``@@ `` joins a word's pieces)."""
    return (" ".join(tokens) + " ").replace("@@ ", "").rstrip()


@dataclass
class Translation:
    """Detokenised hypotheses, the BPE tokens generated (``</s>`` counted, as fairseq-generate counts), the seconds
    CTranslate2's decoding took (tokenising and BPE not included, as fairseq-generate's timing), the sentences
    decoded again with ``<blank>`` suppressed and those whose hypothesis reached the length limit."""

    hypotheses: List[str]
    tokens: int
    seconds: float
    redone: int
    at_limit: List[int]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def load_translator(model_dir: str, threads: int = 1, compute_type: str = "default"):
    """The exported model on the CPU, ``threads`` threads for one translation at a time."""
    import ctranslate2

    return ctranslate2.Translator(
        model_dir, device="cpu", compute_type=compute_type, inter_threads=1, intra_threads=threads
    )


def translate_bpe(
    translator,
    sources: Sequence[str],
    decoding: FairseqDecoding,
    batch_size: int = 64,
    target_lengths: Sequence[int] | None = None,
) -> Translation:
    """BPE'd sentences -> detokenised hypotheses, timed. ``target_lengths`` (the BPE'd references' token counts):
    decode in fairseq-generate's batches (:func:`fairseq_deepinit.export.decoding.fairseq_batches`), whose longest
    source sets ``--max-len-a``'s limit there."""
    tokens = [s.split() for s in sources]
    batches = None
    if target_lengths is not None:
        batches = fairseq_batches([len(t) for t in tokens], target_lengths, batch_size)
    start = time.perf_counter()
    decoded = translate_tokens(translator, tokens, decoding, batch_size=batch_size, batches=batches)
    seconds = time.perf_counter() - start
    best = [h[0] for h in decoded.hypotheses]
    hyps = [detokenize(remove_bpe(h)) for h in best]
    return Translation(hyps, sum(len(h) + 1 for h in best), seconds, decoded.redone, decoded.at_limit)


def translate_lines(
    translator,
    lines: Sequence[str],
    bpe: Bpe,
    decoding: FairseqDecoding = FAIRSEQ_DEFAULTS,
    batch_size: int = 64,
    target_lengths: Sequence[int] | None = None,
) -> Translation:
    """Raw sentences -> detokenised hypotheses (the module docstring's pipeline)."""
    return translate_bpe(translator, [bpe(tokenize(line)) for line in lines], decoding, batch_size, target_lengths)


def max_target_positions(model_dir: str) -> int:
    """The exported model's ``--max-target-positions`` (fairseq caps ``max_len`` below it), as the export recorded."""
    meta = Path(model_dir) / METADATA
    return json.loads(meta.read_text())["max_target_positions"] if meta.exists() else FairseqDecoding.max_positions


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="translate_ct2.py",
        description="Translate raw sentences with a CTranslate2 model written by deepinit-export (tokenise, BPE, "
        "beam search as fairseq-generate, detokenise).",
    )
    p.add_argument("model", help="the folder deepinit-export --to ctranslate2 wrote")
    p.add_argument("--codes", required=True, help="the BPE codes the corpus was prepared with (subword-nmt)")
    p.add_argument("--vocabulary", help="subword-nmt's source vocabulary for its filter (default: no filter)")
    p.add_argument("--vocabulary-threshold", type=int, default=50, help="the filter's threshold (default: 50)")
    add_options(p, "CTranslate2 call")
    p.add_argument("--min-len", type=int, default=1, help="fairseq-generate's --min-len (default: 1)")
    p.add_argument(
        "--compute-type", default="default", help="CTranslate2's compute type (default: default, the model's)"
    )
    p.add_argument(
        "--target-bpe",
        help="the BPE'd references, to decode in fairseq-generate's batches (sorted by length, --batch-size at a "
        "time), whose longest source sets --max-len-a's limit as there (default: sources of one length together)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    source = open(args.input, encoding="utf-8") if args.input else sys.stdin
    with source:
        lines = [line.rstrip("\n") for line in source]
    decoding = FairseqDecoding(
        beam=args.beam,
        lenpen=args.lenpen,
        max_len_a=args.max_len_a,
        max_len_b=args.max_len_b,
        min_len=args.min_len,
        max_positions=max_target_positions(args.model),
    )
    translator = load_translator(args.model, args.threads, args.compute_type)
    bpe = Bpe(Path(args.codes), args.vocabulary and Path(args.vocabulary), args.vocabulary_threshold)
    targets = None
    if args.target_bpe:
        targets = [len(line.split()) for line in Path(args.target_bpe).read_text(encoding="utf-8").splitlines()]
    result = translate_lines(translator, lines, bpe, decoding, args.batch_size, targets)
    out = emit("CTranslate2", result, args, ", where fairseq forces </s> and CTranslate2 cuts: docs/export.md")
    if result.redone:
        print(f"({result.redone} sentences decoded again with <blank> suppressed)", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
