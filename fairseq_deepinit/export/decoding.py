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
  source), so :func:`translate_tokens` decodes in fairseq-generate's batches when it is given them
  (:func:`.decoding.fairseq_batches`), else sources of one length together. At that limit the two differ: fairseq forces
  ``</s>`` at the last step, CTranslate2 keeps the best word there (a hypothesis that long is cut, not ended);
- ``--min-len`` (default 1: no ``</s>`` as the first word) -> ``min_decoding_length``;
- ``<pad>`` (``<blank>`` in the vocabulary): fairseq sets its log-probability to -inf after the log-softmax,
  so every other word keeps the probability the model gives it. CTranslate2's ``suppress_sequences`` (and its
  ``min_decoding_length``) mask the logits before the log-softmax, which renormalises: each step's scores would
  move by ``log(1 - p(<pad>))``, and near ties flip (FixNorm's output bias gives ``<pad>`` about
  ``label_smoothing / V``). So ``<blank>`` is left in, as fairseq's scores are; a hypothesis that picks it
  (it never wins a beam slot in a trained model) is decoded again with ``<blank>`` suppressed, and counted;
- ``</s>`` as the first word: both forbid it below ``--min-len`` (default 1); CTranslate2's masking
  renormalises that first step: every hypothesis of the sentence gets the same ``c = -log(1 - p(</s>))`` added,
  which leaves the search itself unchanged (every comparison during it is between two sums that both hold c)
  and moves the final normalised scores by ``c / length^lenpen``, which differs between hypotheses of different
  lengths and so reorders them. ``exact_first_step`` (the default) undoes that: every finished hypothesis is
  returned, c is read from ``score_batch`` (the log-probability of ``</s>`` first) and the hypotheses are ranked
  again by fairseq's score. Without it, the tiny trained models of tests/fixtures/v010 (beam 3) give
  fairseq-generate's hypotheses for 18/20 (DeepNorm), 17/20 (Admin) and 0/20 (TwT) test sentences, with it
  20/20 each (tests/test_export_decoding.py); it costs one ``score_batch`` of the sources per batch;
- the source's ``</s>`` and the decoder's first input ``</s>`` are in the model's config (:mod:`.to_ct2`).

Not carried (refused by :func:`ct2_options`): sampling, diverse beam search, ``--unkpen`` other than 0,
``--prefix-size``, ``--match-source-len``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import groupby
from typing import Dict, List, NamedTuple, Sequence

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


class Decoded(NamedTuple):
    """What :func:`translate_tokens` / :func:`generate_tokens` return: per source, its ``nbest`` hypotheses (tokens,
    without ``</s>``); how many sentences were decoded again with ``<blank>`` suppressed; which sentences' best
    hypothesis reached the length limit without ``</s>`` (where fairseq would have forced one: module docstring)."""

    hypotheses: List[List[List[str]]]
    redone: int
    at_limit: List[int]


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


def _rerank(result, c: float, lenpen: float, nbest: int) -> List[List[str]]:
    """The hypotheses by fairseq's score: CTranslate2's minus ``c / length^lenpen`` (module docstring)."""
    fixed = [score - c / len(h) ** lenpen for h, score in zip(result.hypotheses, result.scores, strict=True)]
    order = sorted(range(len(fixed)), key=lambda k: -fixed[k])
    return [result.hypotheses[k] for k in order[:nbest]]


def fairseq_batches(
    source_lengths: Sequence[int], target_lengths: Sequence[int] | None = None, batch_size: int = 64
) -> List[List[int]]:
    """The batches fairseq-generate makes of a test set (indices into it): sorted by target length, then stably by
    source length (``LanguagePairDataset.ordered_indices``, fairseq/data/language_pair_dataset.py:427-438, the test
    split unshuffled), then ``--batch-size`` sentences at a time (``--required-batch-size-multiple 1``)."""
    order = list(range(len(source_lengths)))
    if target_lengths is not None:
        order.sort(key=lambda i: target_lengths[i])
    order.sort(key=lambda i: source_lengths[i])
    return [order[k : k + batch_size] for k in range(0, len(order), batch_size)]


def translate_tokens(
    translator,
    sources: Sequence[Sequence[str]],
    decoding: FairseqDecoding = FairseqDecoding(),
    batch_size: int = 64,
    exact_first_step: bool = True,
    batches: Sequence[Sequence[int]] | None = None,
) -> Decoded:
    """The ``nbest`` hypotheses of each source (tokens, without ``</s>``), in the order of ``sources``
    (:class:`Decoded`).

    fairseq-generate's ``max_len`` reads the padded length of each batch (its longest source): ``batches``
    (:func:`.decoding.fairseq_batches`) decodes in fairseq-generate's own batches, each with its longest source's limit;
    without them, sources of one length are decoded together (what fairseq does with batches of one length) in
    batches of at most ``batch_size``. ``exact_first_step``: rank the finished hypotheses by fairseq's own score
    (module docstring); ``False`` skips one scoring pass per batch and may rank them differently.
    """
    if batches is None:
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
        batches = [
            ids[start : start + batch_size]
            for _length, group in groupby(order, key=lambda i: len(sources[i]))
            for ids in [list(group)]
            for start in range(0, len(ids), batch_size)
        ]
    out: List[List[List[str]]] = [[] for _ in sources]
    redone, at_limit = 0, []
    lenpen = 0.0 if decoding.unnormalized else decoding.lenpen
    for chunk in batches:
        options = ct2_options(decoding, max(len(sources[i]) for i in chunk) + 1)
        if exact_first_step:
            options["num_hypotheses"] = decoding.beam
        batch = [list(sources[i]) for i in chunk]
        results = translator.translate_batch(batch, **options)
        if exact_first_step and decoding.min_len > 0:
            first = translator.score_batch(batch, [[] for _ in batch])
            shifts = [-math.log1p(-math.exp(r.log_probs[0])) for r in first]
        else:
            shifts = [0.0] * len(batch)
        for i, result, c in zip(chunk, results, shifts, strict=True):
            if any(BLANK in h for h in result.hypotheses):
                redone += 1
                result = translator.translate_batch([list(sources[i])], suppress_sequences=[[BLANK]], **options)[0]
            hypotheses = _rerank(result, c, lenpen, decoding.nbest) if exact_first_step else result.hypotheses
            if hypotheses and (not hypotheses[0] or hypotheses[0][-1] != EOS):
                at_limit.append(i)
            out[i] = [_strip_end(h) for h in hypotheses]
    return Decoded(out, redone, at_limit)


def ct2_lm_options(decoding: FairseqDecoding, prompt_length: int) -> Dict[str, object]:
    """``generate_batch`` keyword arguments for fairseq's ``SequenceGenerator`` continuing a prompt of
    ``prompt_length`` words given as ``prefix_tokens`` (fairseq-interactive / fairseq-generate on a language model).

    The prompt is read before the search (``include_prompt_in_result=False``), not forced word by word inside
    it: CTranslate2's forced prefix bars ``</s>`` from all but the first beam at the first free step
    (``update_sample_with_prefix``, src/decoding.cc:21-68), fairseq does not. Lengths then count generated words:
    fairseq's ``max_len`` counts the prompt too, and its ``--min-len`` applies from the first word of the prompt
    on. Every finished hypothesis is returned, for :func:`generate_tokens` to rank by fairseq's score.
    """
    options = ct2_options(decoding, prompt_length)
    total = options.pop("max_decoding_length")
    options.pop("min_decoding_length")
    options.pop("max_input_length")
    options.update(
        max_length=max(total - prompt_length, 1),
        min_length=max(decoding.min_len - prompt_length, 0),
        include_prompt_in_result=False,
        num_hypotheses=decoding.beam,
    )
    return options


def generate_tokens(
    generator, prompts: Sequence[Sequence[str]], decoding: FairseqDecoding = FairseqDecoding()
) -> Decoded:
    """A language model's continuations of ``prompts`` (prompt words, without the leading ``</s>``), decoded as
    fairseq decodes a prompt given as ``prefix_tokens`` (:class:`Decoded`; the hypotheses begin with the prompt).

    fairseq ranks a finished hypothesis by ``(S_prompt + S) / (P + L)^lenpen`` (the prompt's ``P`` words and
    log-probability ``S_prompt`` included), CTranslate2 by ``S / L^lenpen``: every comparison during the search is
    between sums that both miss ``S_prompt``, so the search is the same, and the finished hypotheses are ranked
    again by fairseq's score (``S_prompt`` from ``score_batch``). A ``--min-len`` that reaches past the prompt by
    one word masks ``</s>`` at the first generated step: the shift it adds to every hypothesis is taken out as
    for a translation's first step; one that reaches further is refused (its shifts differ between beams).
    """
    out: List[List[List[str]]] = []
    redone, at_limit = 0, []
    lenpen = 0.0 if decoding.unnormalized else decoding.lenpen
    for index, prompt in enumerate(prompts):
        if decoding.min_len - len(prompt) > 1:
            raise ExportError(
                f"--min-len {decoding.min_len} reaches {decoding.min_len - len(prompt)} words past a "
                f"{len(prompt)}-word prompt: CTranslate2 renormalises each of those steps (docs/export.md); give a "
                "--min-len at most one word beyond the prompt"
            )
        options = ct2_lm_options(decoding, len(prompt))
        start = [EOS, *prompt]
        result = generator.generate_batch([start], **options)[0]
        if any(BLANK in h for h in result.sequences):
            redone += 1
            result = generator.generate_batch([start], suppress_sequences=[[BLANK]], **options)[0]
        scored = generator.score_batch([[*start, EOS]])[0].log_probs
        prompt_score = sum(scored[:-1])
        shift = -math.log1p(-math.exp(scored[-1])) if options["min_length"] > 0 else 0.0
        fixed = []
        for h, score in zip(result.sequences, result.scores, strict=True):
            generated = score * len(h) ** lenpen - shift
            fixed.append((prompt_score + generated) / (len(prompt) + len(h)) ** lenpen)
        order = sorted(range(len(fixed)), key=lambda k: -fixed[k])
        best = result.sequences[order[0]] if order else []
        if not best or best[-1] != EOS:
            at_limit.append(index)
        out.append([[*prompt, *_strip_end(result.sequences[k])] for k in order[: decoding.nbest]])
    return Decoded(out, redone, at_limit)


__all__ = [
    "BLANK",
    "Decoded",
    "FairseqDecoding",
    "ct2_lm_options",
    "ct2_options",
    "fairseq_batches",
    "generate_tokens",
    "translate_tokens",
]
