"""Raw text through an exported Hugging Face model, with transformers alone, as the quickstart translates with fairseq.

``deepinit-export CHECKPOINT OUT --to huggingface`` writes the model and, for data prepared by this project's
pipelines, its tokenizer; this translates raw sentences with them and nothing else: ``AutoTokenizer``
(the pipeline's tokenisation, BPE and dictionary ids; ``trust_remote_code``: docs/export_tokenizer.md),
``AutoModelForSeq2SeqLM.generate`` with fairseq-generate's
search (beam, ``--lenpen``, ``--max-len-a/b``: at most ``int(a n + b)`` words then ``</s>``, ``n`` the source's
tokens with its ``</s>``; sentences of one length decoded together, so each has its own limit), and
``batch_decode`` (BPE removed, detokenised). Neither fairseq nor the plugin is imported (:func:`main` checks).
Optionally scored (sacreBLEU against raw references) and compared with a fairseq-generate output of the same
sentences (identical hypotheses, speed beside fairseq-generate's own timing line).

    python scripts/translate_hf.py MODEL_DIR --input test.de --output hyp.en --reference test.en
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import List, Sequence

from deepinit_tools.decode_report import add_options, emit

#: where the export puts the target language's tokenizer when it differs (hf_tokenizer.TARGET_SUBDIR; not imported:
#: this tool imports nothing of the plugin)
TARGET_TOKENIZER = "target_tokenizer"


@dataclass
class Translation:
    """Detokenised hypotheses, the tokens generated (``</s>`` counted, as fairseq-generate counts) and the seconds
    ``generate`` took (tokenising not included, as fairseq-generate's timing), the sentences that reached the
    length limit."""

    hypotheses: List[str]
    tokens: int
    seconds: float
    at_limit: List[int]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def translate(
    model,
    tokenizer,
    decoder,
    lines: Sequence[str],
    beam: int = 5,
    lenpen: float = 1.0,
    max_len_a: float = 0.0,
    max_len_b: int = 200,
    batch_size: int = 64,
) -> Translation:
    """Raw sentences -> detokenised hypotheses (module docstring); ``tokenizer`` encodes the source, ``decoder`` (the
    folder's target tokenizer, or the same) decodes."""
    import torch

    ids = tokenizer(list(lines)).input_ids
    positions = int(getattr(model.config, "max_position_embeddings", 1024))
    out: List[str | None] = [None] * len(lines)
    tokens, seconds, at_limit = 0, 0.0, []
    by_length = sorted(range(len(lines)), key=lambda i: len(ids[i]))
    for n, group in groupby(by_length, key=lambda i: len(ids[i])):
        group = list(group)
        limit = min(int(max_len_a * n + max_len_b), positions - 1)
        for start in range(0, len(group), batch_size):
            chunk = group[start : start + batch_size]
            batch = torch.tensor([ids[i] for i in chunk])
            t0 = time.perf_counter()
            with torch.no_grad():
                generated = model.generate(
                    input_ids=batch,
                    attention_mask=torch.ones_like(batch),
                    num_beams=beam,
                    length_penalty=lenpen,
                    max_length=limit + 2,  # the decoder's start token, `limit` words, </s>
                    early_stopping=True,
                )
            seconds += time.perf_counter() - t0
            for i, row in zip(chunk, generated[:, 1:].tolist(), strict=True):
                words = [t for t in row if t not in (model.config.eos_token_id, model.config.pad_token_id)]
                tokens += len(words) + 1
                if len(words) >= limit:
                    at_limit.append(i)
                out[i] = decoder.decode(words, skip_special_tokens=True)
    return Translation([h or "" for h in out], tokens, seconds, sorted(at_limit))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="translate_hf.py",
        description="Translate raw sentences with a Hugging Face model folder written by deepinit-export --to "
        "huggingface, through transformers alone (its tokenizer, generate with fairseq-generate's search).",
    )
    p.add_argument("model", help="the folder deepinit-export --to huggingface wrote (with its tokenizer)")
    add_options(p, "generate call")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    if not (Path(args.model) / "tokenization_deepinit.py").is_file():
        print(
            f"translate_hf.py: error: {args.model} has no tokenizer (its data folder did not say how its text was "
            "made: README.md there says how to give the model ids)",
            file=sys.stderr,
        )
        return 1
    source = open(args.input, encoding="utf-8") if args.input else sys.stdin
    with source:
        lines = [line.rstrip("\n") for line in source]
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model).eval()
    # the folder's tokenizer is the training pipeline's own code (docs/export_tokenizer.md), hence trust_remote_code
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
    target = Path(args.model) / TARGET_TOKENIZER
    decoder = AutoTokenizer.from_pretrained(target, trust_remote_code=True) if target.is_dir() else tokenizer
    result = translate(
        model, tokenizer, decoder, lines, args.beam, args.lenpen, args.max_len_a, args.max_len_b, args.batch_size
    )
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("fairseq", "fairseq_deepinit"))
    if loaded:
        raise AssertionError(f"translate_hf.py imported {', '.join(loaded[:3])}; it must run on transformers alone")
    emit("transformers", result, args)
    return 0
