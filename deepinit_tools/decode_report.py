"""What a translation of the test set is scored by, for any decoder (fairseq-generate, CTranslate2, transformers):
sacreBLEU against raw references, and fairseq-generate's own speed line. No fairseq import: the transformers
tool (:mod:`deepinit_tools.hf_translate`) runs without it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

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
