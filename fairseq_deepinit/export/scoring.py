"""Teacher-forced log-probabilities of the same tokens from the plugin model and from CTranslate2's.

The check after ``--to ctranslate2`` (:func:`check_ct2_dir`) and the tests compare the two on sentences of
random words: for a translation model, ``log p(y_t | y_<t, x)`` for every target word and the final
``</s>`` (CTranslate2's ``Translator.score_batch``, which adds the source ``</s>`` and starts the decoder
with ``</s>`` as the model's config says); for a language model, ``log p(w_t | w_<t)`` of every word after
the first, the first being ``</s>`` as fairseq's language models start a sentence (``Generator.score_batch``).
Each sentence is scored alone on the plugin side (no padding). :func:`compare_log_probs` is the comparison
every target's check makes (``--to fairseq``'s too: :func:`.to_fairseq.compare`).
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch

from ..errors import ExportError

Pair = Tuple[List[int], List[int]]


def random_sentences(model, n: int = 6, seed: int = 0, max_len: int = 12) -> List[Pair]:
    """``n`` (source ids, target ids) of random non-special words of random lengths (source empty for an LM)."""
    g = torch.Generator().manual_seed(seed)
    dec = model.decoder.dictionary
    enc = None if getattr(model, "encoder", None) is None else model.encoder.dictionary
    out = []
    for _ in range(n):
        lengths = torch.randint(1, max_len + 1, (2,), generator=g).tolist()
        tgt = torch.randint(dec.nspecial, len(dec), (lengths[1],), generator=g).tolist()
        src = [] if enc is None else torch.randint(enc.nspecial, len(enc), (lengths[0],), generator=g).tolist()
        out.append((src, tgt))
    return out


def plugin_scores(model, sentences: Sequence[Pair]) -> List[torch.Tensor]:
    """The plugin model's log-probabilities (float64) of each target word and ``</s>`` (translation) or of each
    word after the first (a language model, whose first word is ``</s>``)."""
    dec = model.decoder.dictionary
    eos = dec.eos()
    out = []
    with torch.no_grad():
        for src, tgt in sentences:
            if getattr(model, "encoder", None) is None:
                tokens = torch.tensor([[eos, *tgt]])
                logits = model(tokens[:, :-1])[0]
                gold = tokens[:, 1:]
            else:
                source = torch.tensor([[*src, eos]])
                prev = torch.tensor([[eos, *tgt]])
                logits = model(source, torch.tensor([source.size(1)]), prev)[0]
                gold = torch.tensor([[*tgt, eos]])
            lp = torch.log_softmax(logits.to(torch.float64), -1)
            out.append(lp.gather(-1, gold[..., None])[0, :, 0])
    return out


def ct2_scores(ct2_model, vocabularies: Sequence[List[str]], sentences: Sequence[Pair]) -> List[torch.Tensor]:
    """CTranslate2's log-probabilities of the same tokens (``ct2_model``: a Translator or a Generator)."""
    import ctranslate2

    src_vocab, tgt_vocab = vocabularies[0], vocabularies[-1]
    if isinstance(ct2_model, ctranslate2.Generator):
        batch = [["</s>", *(tgt_vocab[i] for i in tgt)] for _src, tgt in sentences]
        results = ct2_model.score_batch(batch)
    else:
        source = [[src_vocab[i] for i in src] for src, _tgt in sentences]
        target = [[tgt_vocab[i] for i in tgt] for _src, tgt in sentences]
        results = ct2_model.score_batch(source, target)
    return [torch.tensor(r.log_probs, dtype=torch.float64) for r in results]


def max_difference(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """The largest per-token |difference| of two lists of per-sentence log-probabilities; NaN when a value of
    either is not finite (``max`` would drop a NaN: ``max(0.0, nan)`` is 0.0)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            raise ExportError(f"the export scored {y.numel()} tokens where the model has {x.numel()}")
        if not (x.isfinite().all() and y.isfinite().all()):
            return math.nan
        if x.numel():
            worst = max(worst, (x.to(torch.float64) - y.to(torch.float64)).abs().max().item())
    return worst


def compare_log_probs(
    reference: Sequence[torch.Tensor], exported: Sequence[torch.Tensor], tolerance: float, target: str
) -> float:
    """The exactness check of every export target: the largest |difference| of the exported model's
    log-probabilities (``exported``, ``target`` names it in the message) from the plugin model's
    (``reference``), each a list of tensors of the same shapes; raises unless every value of both is finite and
    the difference is at most ``tolerance`` (``inf``: report the difference, still refusing NaN and inf).
    """
    for side, values in (("the plugin model's", reference), (f"{target}'s", exported)):
        bad = sum(int((~v.isfinite()).sum()) for v in values)
        if bad:
            total = sum(v.numel() for v in values)
            raise ExportError(
                f"{side} log-probabilities of the check hold {bad} non-finite values (NaN or inf) of {total}; "
                "the export cannot be shown exact"
            )
    diff = max_difference(reference, exported)
    if not diff <= tolerance:
        raise ExportError(f"{target}'s log-probabilities differ from the model's by {diff:.3g} > {tolerance}")
    return diff


def load_ct2(model_dir: str, lm: bool, compute_type: str = "float32", threads: int = 1):
    """The CTranslate2 model in ``model_dir`` on the CPU."""
    import ctranslate2

    cls = ctranslate2.Generator if lm else ctranslate2.Translator
    return cls(model_dir, device="cpu", compute_type=compute_type, inter_threads=1, intra_threads=threads)


def check_ct2_dir(model_dir: str, model, vocabularies, tolerance: float, compute_type: str = "float32") -> float:
    """Score random sentences with the written model and ``model`` (the plugin's); raise if they differ by more
    than ``tolerance`` or a value is not finite (:func:`compare_log_probs`); return the largest difference."""
    lm = getattr(model, "encoder", None) is None
    sentences = random_sentences(model)
    ct2 = ct2_scores(load_ct2(model_dir, lm, compute_type), vocabularies, sentences)
    what = "CTranslate2" if compute_type == "float32" else f"CTranslate2 ({compute_type})"
    return compare_log_probs(plugin_scores(model, sentences), ct2, tolerance, what)
