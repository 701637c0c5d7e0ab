#!/usr/bin/env python
"""fairseq-generate against the CTranslate2 and transformers exports of the same model: tokens/s, ratio, BLEU,
identical outputs.

For each ``--model NAME=CHECKPOINT`` (a checkpoint of the plugin, its data in ``--data``):

1. the model is exported with ``deepinit-export --to ctranslate2`` twice, float32 and ``--quantization int8``,
   and with ``--to huggingface`` where its route allows (into ``--work``, reused when newer than the checkpoint);
2. the first ``--limit`` sentences of the ``--subset`` split are translated, beam ``--beam``, by three systems,
   once per round for ``--rounds`` rounds, the order rotating (:func:`deepinit_tools.harness.timing.interleave`):
   ``fairseq``: fairseq-generate's generation loop in this process (``task.build_generator`` and
   ``task.inference_step`` on batches of ``--batch-size`` sentences in fairseq's length order, fairseq_cli/
   generate.py's ``gen_timer`` region: the model's forward and the search, no data loading); ``ct2-fp32`` and
   ``ct2-int8``: :func:`fairseq_deepinit.export.decoding.translate_tokens` with the same options, batches of
   ``--batch-size``; ``transformers``: ``generate`` of the exported folder (float32) on the same batches, right
   padded, beam and length limit as fairseq's; at each of ``--threads`` (torch's threads, CTranslate2's
   ``intra_threads``);
3. per system: generated tokens per second (``</s>`` counted, as fairseq-generate counts) on the wall clock and
   per CPU second of this process, their ratio to fairseq's (paired per round, median), sacreBLEU of the
   detokenised hypotheses against ``--reference`` (raw text), and how many hypotheses are identical to fairseq's.

Targets (docs/export.md): float32 >= 2x fairseq's tokens/s with identical outputs, int8 >= 4x with BLEU within
0.5; transformers has none (a measurement).
The decoding options are fairseq-generate's defaults but the beam and ``--max-len-b`` (``--max-len-a 0``:
the limit does not depend on the batch); where a hypothesis reaches the limit the two systems end it differently
(:mod:`fairseq_deepinit.export.decoding`), and the table says how many did.

    OMP_NUM_THREADS=1 python benchmarks/export_speed.py --data work-data/bible-s-k/bpe8000-len80/bin \\
        --reference work-data/bible-s-k/raw/test.en --model quickstart=<run>/checkpoint_last.pt
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Dict, List, Sequence

from deepinit_tools.ct2_translate import detokenize, remove_bpe
from deepinit_tools.harness import report
from deepinit_tools.harness.cli import Parser, int_list, positive_int
from deepinit_tools.harness.timing import Stat, interleave, median

SYSTEMS = ("fairseq", "ct2-fp32", "ct2-int8", "transformers")
TARGETS = {"ct2-fp32": 2.0, "ct2-int8": 4.0}


def plugin():
    """Every import from fairseq_deepinit in this script (one place, for the package's re-layout)."""
    from fairseq_deepinit.export import decoding, run

    return decoding, run


def _stale(marker: Path, checkpoint: Path) -> bool:
    return not marker.exists() or marker.stat().st_mtime < checkpoint.stat().st_mtime


def export_models(name: str, checkpoint: Path, data: Path, work: Path) -> Dict[str, str]:
    """``{system: exported folder}`` of the checkpoint: CTranslate2 float32 and int8, and transformers where the
    route takes the model (its refusal printed otherwise); reused when newer than the checkpoint, else replaced."""
    from fairseq_deepinit.errors import ExportError

    _decoding, run = plugin()
    out = {}
    for system, quantization in (("ct2-fp32", None), ("ct2-int8", "int8")):
        folder = work / f"{name}-{system}"
        if _stale(folder / "model.bin", checkpoint):
            run.export_ct2(str(checkpoint), str(folder), quantization=quantization, data=str(data), force=True)
        out[system] = str(folder)
    folder = work / f"{name}-transformers"
    try:
        if _stale(folder / "model.safetensors", checkpoint):
            run.export_hf(str(checkpoint), str(folder), data=str(data), force=True)
        out["transformers"] = str(folder)
    except ExportError as e:
        print(f"[{name}] no transformers row: {e}")
    return out


class Fairseq:
    """fairseq-generate's generation loop on the first ``limit`` sentences of ``subset``."""

    def __init__(
        self, checkpoint: Path, data: Path, subset: str, limit: int, beam: int, batch_size: int, max_len_b: int
    ):
        import torch
        from fairseq import checkpoint_utils

        plugin()
        # in float32 as the exports are checked, whatever precision trained it (a --autocast-bf16 run's task would
        # otherwise generate under bf16 autocast)
        models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
            [str(checkpoint)], arg_overrides={"data": str(data), "autocast_bf16": False}
        )
        self.model = models[0].float().eval()
        self.task = task
        task.load_dataset(subset)
        dataset = task.dataset(subset)
        ids = list(range(min(limit, len(dataset))))
        self.sources = [[task.source_dictionary[t] for t in dataset[i]["source"].tolist()[:-1]] for i in ids]
        decoding, _run = plugin()
        sizes = (dataset.src_sizes[ids], None if dataset.tgt_sizes is None else dataset.tgt_sizes[ids])
        self.order = decoding.fairseq_batches(*sizes, batch_size)  # fairseq-generate's batches, for both systems
        self.batches = [dataset.collater([dataset[ids[i]] for i in batch]) for batch in self.order]
        self.generator = task.build_generator(
            [self.model], argparse.Namespace(beam=beam, max_len_a=0, max_len_b=max_len_b, min_len=1, lenpen=1, unkpen=0)
        )
        self.ids = ids
        self.hypotheses: Dict[int, List[str]] = {}
        self._torch = torch

    def __call__(self) -> int:
        tokens = 0
        with self._torch.no_grad():
            for batch in self.batches:
                hypos = self.task.inference_step(self.generator, [self.model], batch)
                for sid, hypo in zip(batch["id"].tolist(), hypos, strict=True):
                    best = hypo[0]["tokens"]
                    tokens += len(best)
                    self.hypotheses[sid] = [self.task.target_dictionary[t] for t in best.tolist()[:-1]]
        return tokens


class CTranslate2:
    """The same sentences through an exported model (:func:`fairseq_deepinit.export.decoding.translate_tokens`)."""

    def __init__(self, folder: str, sources, order, beam: int, threads: int, max_len_b: int):
        import ctranslate2

        decoding, _run = plugin()
        self.translator = ctranslate2.Translator(folder, device="cpu", inter_threads=1, intra_threads=threads)
        self.sources = sources
        self.order = order
        self.options = decoding.FairseqDecoding(beam=beam, max_len_b=max_len_b)
        self.hypotheses: List[List[str]] = []
        self.at_limit: List[int] = []
        self._translate = decoding.translate_tokens

    def __call__(self) -> int:
        decoded = self._translate(self.translator, self.sources, self.options, batches=self.order)
        self.hypotheses = [h[0] for h in decoded.hypotheses]
        self.at_limit = decoded.at_limit
        return sum(len(h) + 1 for h in self.hypotheses)


class Transformers:
    """The same sentences, in the same batches, through the exported transformers folder's ``generate``."""

    def __init__(self, folder: str, sources, order, beam: int, max_len_b: int, source_dict, target_dict):
        from transformers import AutoModelForSeq2SeqLM

        self.model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
        eos, self.pad = self.model.config.eos_token_id, self.model.config.pad_token_id
        self.ids = [[source_dict.index(w) for w in s] + [eos] for s in sources]
        self.order = order
        self.beam, self.max_len_b = beam, max_len_b
        self.target_dict = target_dict
        self.hypotheses: List[List[str]] = []
        self.at_limit: List[int] = []

    def __call__(self) -> int:
        import torch

        out: Dict[int, List[str]] = {}
        with torch.no_grad():
            for batch in self.order:
                width = max(len(self.ids[i]) for i in batch)
                ids = torch.tensor([self.ids[i] + [self.pad] * (width - len(self.ids[i])) for i in batch])
                generated = self.model.generate(
                    input_ids=ids,
                    attention_mask=ids.ne(self.pad).long(),
                    num_beams=self.beam,
                    max_length=self.max_len_b + 2,
                    early_stopping=True,
                )
                for i, row in zip(batch, generated[:, 1:].tolist(), strict=True):
                    words = [t for t in row if t not in (self.model.config.eos_token_id, self.pad)]
                    out[i] = [self.target_dict[t] for t in words]
        self.hypotheses = [out[i] for i in range(len(self.ids))]
        self.at_limit = [i for i, h in enumerate(self.hypotheses) if len(h) >= self.max_len_b]
        return sum(len(h) + 1 for h in self.hypotheses)


def bleu(hypotheses: Sequence[Sequence[str]], references: Sequence[str]) -> float:
    import sacrebleu

    return sacrebleu.corpus_bleu([detokenize(remove_bpe(h)) for h in hypotheses], [list(references)]).score


def measure(args, name: str, checkpoint: Path, references: List[str]) -> List[dict]:
    import torch

    folders = export_models(name, checkpoint, args.data, args.work)
    fairseq = Fairseq(checkpoint, args.data, args.subset, args.limit, args.beam, args.batch_size, args.max_len_b)
    refs = references[: len(fairseq.ids)]
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        systems = {"fairseq": fairseq}
        for system, folder in folders.items():
            if system == "transformers":
                dicts = (fairseq.task.source_dictionary, fairseq.task.target_dictionary)
                systems[system] = Transformers(
                    folder, fairseq.sources, fairseq.order, args.beam, args.max_len_b, *dicts
                )
            else:
                systems[system] = CTranslate2(
                    folder, fairseq.sources, fairseq.order, args.beam, threads, args.max_len_b
                )
        load = os.getloadavg()[0]
        rounds = interleave(
            systems, args.rounds, warmup=0, on_round=lambda r, _, t=threads: print(f"[{name} x{t}] round {r + 1}")
        )
        base = [fairseq.hypotheses[i] for i in fairseq.ids]
        for system in [s for s in SYSTEMS if s in systems]:
            hyps = base if system == "fairseq" else systems[system].hypotheses
            rows.append(
                dict(
                    model=name,
                    threads=threads,
                    system=system,
                    tokens=int(rounds.work[system][-1]),
                    wall_tps=Stat.of(rounds.rates(system, "wall")).median,
                    cpu_tps=Stat.of(rounds.rates(system, "cpu")).median,
                    wall_ratio=median(rounds.ratios(system, "fairseq", "wall")),
                    cpu_ratio=median(rounds.ratios(system, "fairseq", "cpu")),
                    bleu=bleu(hyps, refs),
                    identical=sum(a == b for a, b in zip(hyps, base, strict=True)),
                    # of the hypotheses that differ from fairseq's, those that reached the length limit
                    at_limit=len(
                        {i for i, (a, b) in enumerate(zip(hyps, base, strict=True)) if a != b}
                        & set(getattr(systems[system], "at_limit", []))
                    ),
                    sentences=len(base),
                    load_before=load,
                    load_after=os.getloadavg()[0],
                )
            )
    return rows


def table(rows: List[dict]) -> str:
    header = ["model", "threads", "system", "tokens/s wall", "tokens/s CPU", "ratio wall", "ratio CPU", "BLEU",
              "identical to fairseq", "load avg"]  # fmt: skip
    body = []
    for r in rows:
        limit = f" (of the others {r['at_limit']} at the length limit)" if r["at_limit"] else ""
        body.append(
            [r["model"], r["threads"], r["system"], f"{r['wall_tps']:.1f}", f"{r['cpu_tps']:.1f}",
             f"{r['wall_ratio']:.2f}", f"{r['cpu_ratio']:.2f}", f"{r['bleu']:.2f}",
             f"{r['identical']}/{r['sentences']}{limit}",
             f"{r['load_before']:.1f}-{r['load_after']:.1f}"]
        )  # fmt: skip
    return report.markdown_table(header, body, right=(1, 3, 4, 5, 6, 7))


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="export_speed.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", required=True, metavar="NAME=CHECKPOINT", help="a model to measure")
    p.add_argument("--data", type=Path, required=True, help="the models' fairseq-preprocess folder")
    p.add_argument("--reference", type=Path, required=True, help="raw reference translations of --subset")
    p.add_argument("--subset", default="test", help="the split translated")
    p.add_argument("--limit", type=positive_int, default=200, help="its first sentences translated")
    p.add_argument("--beam", type=positive_int, default=5, help="beam size")
    p.add_argument("--batch-size", type=positive_int, default=64, help="sentences per batch, both systems")
    p.add_argument("--max-len-b", type=positive_int, default=200, help="fairseq-generate's --max-len-b (--max-len-a 0)")
    p.add_argument("--threads", type=int_list, default=[1, 2], help="thread counts, comma-separated")
    p.add_argument("--rounds", type=positive_int, default=3, help="timing rounds (systems interleaved)")
    p.add_argument("--work", type=Path, default=Path("work-data/export-speed"), help="where the exports go")
    p.add_argument("--json", type=Path, help="write the rows and their provenance here")
    p.add_argument("--markdown", type=Path, help="write the table here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    meta = report.environment("cpu", "export_speed.py", argv)
    references = args.reference.read_text(encoding="utf-8").splitlines()
    rows = []
    for spec in args.model:
        name, _, checkpoint = spec.partition("=")
        rows += measure(args, name, Path(checkpoint), references)
    text = report.provenance(meta) + "\n\n" + table(rows)
    print(text)
    report.write_json(args.json, {"rows": rows}, meta)
    report.write_markdown(args.markdown, text)
    return 0
