"""What a translation of the test set is scored by, for any decoder (fairseq-generate, CTranslate2, transformers):
sacreBLEU against raw references, fairseq-generate's own speed line, and the hypotheses identical to its own
(:func:`emit`, the translation tools' output). No fairseq import: the transformers tool
(:mod:`deepinit_tools.hf_translate`) runs without it."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Sequence, TextIO

from deepinit_tools.prepare_bible import read_hypotheses

_FAIRSEQ_SPEED = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s")


def fairseq_speed(log: Path) -> float | None:
    """fairseq-generate's tokens per second (generation time only) from its log, or None."""
    found = _FAIRSEQ_SPEED.findall(Path(log).read_text(encoding="utf-8", errors="replace"))
    if not found:
        return None
    _sentences, tokens, seconds = found[-1]
    return int(tokens.replace(",", "")) / float(seconds)


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> str:
    import sacrebleu

    metric = sacrebleu.metrics.BLEU()
    return (
        f"{metric.corpus_score(list(hypotheses), [list(references)])} (sacrebleu signature: {metric.get_signature()})"
    )


def add_options(p: argparse.ArgumentParser, call: str) -> None:
    """The options every translation tool shares: input and output, fairseq-generate's search (``--beam``,
    ``--lenpen``, ``--max-len-a`` / ``-b``), the batch (sentences per ``call``), threads, and what :func:`compare`
    reads (``--reference``, ``--fairseq-output``, ``--fairseq-log``)."""
    p.add_argument("--input", help="raw source sentences, one per line (default: standard input)")
    p.add_argument("--output", help="where to write the translations (default: standard output)")
    p.add_argument("--beam", type=int, default=5, help="fairseq-generate's --beam (default: 5)")
    p.add_argument("--lenpen", type=float, default=1.0, help="fairseq-generate's --lenpen (default: 1.0)")
    p.add_argument("--max-len-a", type=float, default=0.0, help="fairseq-generate's --max-len-a (default: 0)")
    p.add_argument("--max-len-b", type=int, default=200, help="fairseq-generate's --max-len-b (default: 200)")
    p.add_argument("--batch-size", type=int, default=64, help=f"sentences per {call} (default: 64)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default: 1)")
    p.add_argument("--reference", help="raw reference translations: print sacreBLEU (default: no score)")
    p.add_argument(
        "--fairseq-output", help="a fairseq-generate output of the same sentences to compare with (default: none)"
    )
    p.add_argument("--fairseq-log", help="that run's log (stderr), for its tokens/s (default: no speed comparison)")


def compare(system: str, result, args, out: TextIO = sys.stdout, at_limit_why: str = "") -> None:
    """BLEU, speed and identical hypotheses of ``system`` beside fairseq-generate's (those of ``args`` that are
    given: ``reference``, ``fairseq_log``, ``fairseq_output``). ``result`` has ``hypotheses``, ``tokens``,
    ``seconds``, ``tokens_per_second`` and ``at_limit`` (the sentences that reached the length limit);
    ``at_limit_why``: what the two do there, appended to the count of those."""
    if args.reference:
        refs = Path(args.reference).read_text(encoding="utf-8").splitlines()
        print(f"{system}: {bleu(result.hypotheses, refs)}", file=out)
    fairseq = fairseq_speed(args.fairseq_log) if args.fairseq_log else None
    speed = f"{system}: {result.tokens} tokens in {result.seconds:.1f}s, {result.tokens_per_second:.1f} tokens/s"
    if fairseq:
        speed += f"; fairseq-generate {fairseq:.1f} tokens/s: {result.tokens_per_second / fairseq:.2f}x"
    print(speed, file=out)
    if args.fairseq_output:
        theirs = read_hypotheses(Path(args.fairseq_output))
        differ = [i for i, (a, b) in enumerate(zip(result.hypotheses, theirs, strict=False)) if a != b]
        n = len(result.hypotheses)
        line = f"identical to fairseq-generate's hypotheses: {n - len(differ)}/{n}"
        if differ:
            cut = len(set(differ) & set(result.at_limit))
            line += f" ({cut} of the {len(differ)} others reach the length limit{at_limit_why})"
        print(line, file=out)


def emit(system: str, result, args, at_limit_why: str = "") -> TextIO:
    """The hypotheses to ``args.output`` (and the comparison to standard output) or to standard output (and the
    comparison to standard error); returns the comparison's stream."""
    text = "".join(h + "\n" for h in result.hypotheses)
    out = sys.stdout
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
        out = sys.stderr
    compare(system, result, args, out, at_limit_why)
    return out
