"""fairseq-generate's beam search as CTranslate2's ``translate_batch`` options, and translation of token lists.

fairseq's ``SequenceGenerator`` (fairseq/sequence_generator.py) and CTranslate2's ``BeamSearch``
(src/decoding.cc) are the same algorithm: each step takes the ``2 * beam`` best continuations, finishes the
``</s>`` ones among the first ``beam`` and keeps the first ``beam`` others, and a sentence ends when ``beam``
hypotheses have finished; both divide a finished hypothesis's summed log-probability by its length to the
power ``--lenpen``. What must be set to make them agree (docs/export.md has the table, file and line):

- ``--beam`` -> ``beam_size``; ``--nbest`` -> ``num_hypotheses``;
- ``--lenpen`` -> ``length_penalty`` with ``return_end_token=True``: fairseq's length counts the final ``</s>``
  (``eos_scores /= (step + 1) ** len_pen``), CTranslate2's counts the hypothesis's tokens, which include the
  ``</s>`` only when it is returned (``finalize_hypothesis_score``); the ``</s>`` is then cut from the result.
  ``--unnormalized`` -> ``length_penalty=0``;
- ``--max-len-a``/``--max-len-b`` -> ``max_decoding_length = min(int(a * n + b), max_positions - 1) + 1`` with
  ``n`` the source length with its ``</s>``: fairseq allows ``max_len`` words and then the ``</s>``, CTranslate2
  ``max_decoding_length`` steps, ``</s>`` included. fairseq reads ``n`` from the padded batch (its longest
  source), so :func:`translate_tokens` decodes sources of one length together, which is what fairseq does
  with batches of one length. At that limit the two differ: fairseq forces ``</s>`` at the last step,
  CTranslate2 keeps the best word there (a hypothesis that long is cut, not ended);
- ``--min-len`` (default 1: no ``</s>`` as the first word) -> ``min_decoding_length``;
- ``<pad>`` (``<blank>`` in the vocabulary): fairseq sets its log-probability to -inf after the log-softmax,
  so every other word keeps the probability the model gives it. CTranslate2's ``suppress_sequences`` (and its
  ``min_decoding_length``) mask the logits before the log-softmax, which renormalises: each step's scores would
  move by ``log(1 - p(<pad>))``, and near ties flip (FixNorm's output bias gives ``<pad>`` about
  ``label_smoothing / V``). So ``<blank>`` is left in, as fairseq's scores are; a hypothesis that picks it
  (it never wins a beam slot in a trained model) is decoded again with ``<blank>`` suppressed, and counted;
- ``</s>`` as the first word: both forbid it below ``--min-len`` (default 1); CTranslate2's masking
  renormalises that first step, a shift of ``log(1 - p(</s>))`` shared by every hypothesis of the sentence;
- the source's ``</s>`` and the decoder's first input ``</s>`` are in the model's config (:mod:`.to_ct2`).

Not carried (refused by :func:`ct2_options`): sampling, diverse beam search, ``--unkpen`` other than 0,
``--prefix-size``, ``--match-source-len``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Dict, List, Sequence, Tuple

from ..errors import ExportError

BLANK = "<blank>"
EOS = "</s>"


@dataclass(frozen=True)
class FairseqDecoding:
    """fairseq-generate's decoding options (its defaults) that :func:`ct2_options` carries over."""

    beam: int = 5
    nbest: int = 1
    lenpen: float = 1.0
    unnormalized: bool = False
    max_len_a: float = 0.0
    max_len_b: int = 200
    min_len: int = 1
    max_positions: int = 1024  # the model's --max-target-positions (fairseq caps max_len below it)
    unkpen: float = 0.0
    no_repeat_ngram_size: int = 0

    def max_len(self, source_length: int) -> int:
        """fairseq's ``max_len`` for sources of ``source_length`` tokens (``</s>`` included)."""
        return min(int(self.max_len_a * source_length + self.max_len_b), self.max_positions - 1)


def ct2_options(decoding: FairseqDecoding, source_length: int) -> Dict[str, object]:
    """``translate_batch`` keyword arguments equal to ``decoding`` for sources of ``source_length`` tokens."""
    if decoding.unkpen != 0:
        raise ExportError("--unkpen other than 0 has no CTranslate2 counterpart (disable_unk forbids <unk> outright)")
    return dict(
        beam_size=decoding.beam,
        num_hypotheses=decoding.nbest,
        length_penalty=0.0 if decoding.unnormalized else decoding.lenpen,
        return_end_token=True,
        max_decoding_length=decoding.max_len(source_length) + 1,
        min_decoding_length=decoding.min_len,
        no_repeat_ngram_size=decoding.no_repeat_ngram_size,
        max_input_length=0,
        return_scores=True,
    )


def _strip_end(tokens: Sequence[str]) -> List[str]:
    return list(tokens[:-1]) if tokens and tokens[-1] == EOS else list(tokens)


def translate_tokens(
    translator, sources: Sequence[Sequence[str]], decoding: FairseqDecoding = FairseqDecoding(), batch_size: int = 64
) -> Tuple[List[List[List[str]]], int]:
    """``(hypotheses, redone)``: the ``nbest`` hypotheses (tokens, without ``</s>``) of each source (tokens,
    without ``</s>``), decoded as fairseq-generate decodes them: sources of one length together (their
    ``max_len`` is one number), in batches of at most ``batch_size``; in the order of ``sources``. ``redone``:
    how many sentences were decoded again with ``<blank>`` suppressed (module docstring)."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    out: List[List[List[str]]] = [[] for _ in sources]
    redone = 0
    for length, group in groupby(order, key=lambda i: len(sources[i])):
        ids = list(group)
        options = ct2_options(decoding, length + 1)
        for start in range(0, len(ids), batch_size):
            chunk = ids[start : start + batch_size]
            results = translator.translate_batch([list(sources[i]) for i in chunk], **options)
            for i, result in zip(chunk, results, strict=True):
                if any(BLANK in h for h in result.hypotheses):
                    redone += 1
                    again = translator.translate_batch([list(sources[i])], suppress_sequences=[[BLANK]], **options)
                    result = again[0]
                out[i] = [_strip_end(h) for h in result.hypotheses]
    return out, redone


__all__ = ["BLANK", "FairseqDecoding", "ct2_options", "translate_tokens"]
