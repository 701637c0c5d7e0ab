#!/usr/bin/env python
"""CUDA smoke test of every architecture: train 3 steps in fp16 and in bf16 autocast,
decode a batch with beam 4, count host syncs, name the SDPA backend of every attention kind.

Every architecture is every family of ``fairseq_deepinit.architectures.FAMILIES`` (the papers'
schemes, MAtt, Admin and the successors Sub-LN, B2T, NormFormer, closed-form Admin, torchscale's
DeepNorm) as a translation model, every family of ``fairseq_deepinit.lm.architectures.LM_FAMILIES``
as a decoder-only language model, and stock fairseq ``transformer`` / ``transformer_lm`` beside
them as references (then the training rows: every optimizer of the plugin and every method with a training
hook, stepped by fairseq's own ``Trainer``, :mod:`deepinit_tools.bench.smoke_training`). Each architecture is
built exactly as ``fairseq-train`` builds it
(deepinit_tools/harness/fairseq_train.py) at small dimensions and, per precision:

- **trains** ``--steps`` steps on one fixed fairseq batch (sources left-padded, targets
  right-padded, lengths varied, as fairseq collates them): ``fp16`` is fairseq's ``--fp16``
  (``FP16Optimizer``, fp16 weights, dynamic loss scale); ``bf16-autocast`` the plugin's
  ``--autocast-bf16`` (fp32 weights, forward and loss under ``torch.autocast(bfloat16)``, through
  ``--task translation_deepinit`` / ``translation_admin`` / ``language_modeling_admin``; the other
  language models have no task with that option, so their criterion is wrapped in the same
  ``AutocastCriterion`` the tasks use, and the row says so);
- **decodes** the batch with fairseq's ``SequenceGenerator``, beam 4 (language models: continue a
  prefix of each row);
- **counts host syncs** per training step and per decoded batch (:func:`count_host_syncs`): on CUDA
  ``torch.cuda.set_sync_debug_mode("warn")`` warnings; on the CPU the host reads a GPU would wait
  for (``.item()``, ``equal``, ``nonzero``, boolean indexing ...: ``harness.host_reads.HostReads``);
- **audits the dtype** of every matrix product of the last training step
  (``harness.op_counters.MatmulDtypeAudit``: attention counted once in its inputs' dtype where CUDA's fused
  kernels take its head widths, else as the math backend's products);
- **names the SDPA backend** that ran per attention kind (``encoder self_attn``, ``decoder
  self_attn``, ``decoder encoder_attn``; ``fairseq`` where an attention module did not call SDPA):
  the fused aten op the call dispatched to (flash / efficient / cudnn), ``math`` when none;
- records the **peak memory** (CUDA ``max_memory_allocated`` growth over build + train + decode;
  null on the CPU) and the seconds it took.

fp16 here is fairseq's ``FP16Optimizer`` with its flat fp32 master, which needs CUDA: on ``--device cpu`` the
fp16 pass runs in fp32 and every such row says ``fp32 (fp16 needs CUDA)``. The JSON (``--out-dir``/smoke.json)
is rewritten after every architecture and precision, so a run cut by a time limit keeps what
finished. Usage::

    python benchmarks/gpu_smoke.py --device cuda --out-dir $OUT          # every architecture
    OMP_NUM_THREADS=1 python benchmarks/gpu_smoke.py --device cpu --only postln,lm:preln --out-dir /tmp/s
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import List, Sequence, Tuple

from deepinit_tools import fairseq_argv as fa
from deepinit_tools import harness
from deepinit_tools.bench.readiness_table import model_products_off
from deepinit_tools.bench.smoke_counts import _Recorder, count_host_syncs, record_attention
from deepinit_tools.bench.smoke_data import lm_batch, on_device, translation_batch, write_dictionaries
from deepinit_tools.bench.smoke_training import SETUPS, smoke_training_one
from deepinit_tools.harness.fairseq_train import USER_DIR, Run, Variant, fairseq_config, setup_task
from deepinit_tools.harness.op_counters import MatmulDtypeAudit
from deepinit_tools.paths import import_plugin

PRECISIONS = ("fp16", "bf16-autocast")


@dataclasses.dataclass(frozen=True)
class Arch:
    """One architecture of the smoke test and how fairseq builds it."""

    name: str  # ``postln``, ``lm:preln``, ``stock``, ``lm:stock``
    lm: bool
    arch: str  # fairseq --arch
    task: str  # the task of the fp16 / fp32 pass
    bf16_task: str | None  # the task that has --autocast-bf16; None: AutocastCriterion around the criterion
    plugin: bool = True
    sdpa_refused: str | None = None  # why the family refuses --attention-impl sdpa (it keeps its own attention)


def plugin():
    """Every import from fairseq_deepinit in this script: the families, the autocast criterion and the task a
    family's records require."""
    import_plugin()
    from fairseq_deepinit.architectures import FAMILIES
    from fairseq_deepinit.errors import DeepInitConfigError
    from fairseq_deepinit.family_args import family_spec
    from fairseq_deepinit.lm.architectures import LM_FAMILIES
    from fairseq_deepinit.methods import training_task
    from fairseq_deepinit.training.autocast import AutocastCriterion

    def facts(family: str, lm: bool) -> Tuple[str | None, str | None]:
        """The task the family's records require, and why it refuses ``--attention-impl sdpa`` (None: it takes it)."""
        try:
            family_spec(family, ("--attention-impl", "sdpa"), lm=lm)
            refused = None
        except DeepInitConfigError as e:
            refused = str(e)
        return training_task(family_spec(family, lm=lm)), refused

    return FAMILIES, LM_FAMILIES, AutocastCriterion, facts


@functools.lru_cache(maxsize=1)
def architectures() -> Tuple[Arch, ...]:
    """Stock references first, then every translation family, then every language-model family, each under
    the task its records require (Admin's profiling tasks, which have ``--autocast-bf16`` too) or fairseq's."""
    families, lm_families, _, facts = plugin()
    out = [Arch("stock", False, "transformer", "translation", "translation_deepinit", plugin=False)]
    for f in families:
        need, refused = facts(f, lm=False)
        out.append(Arch(f, False, f"{f}_iwslt_de_en", need or "translation", need or "translation_deepinit",
                        sdpa_refused=refused))  # fmt: skip
    out.append(Arch("lm:stock", True, "transformer_lm", "language_modeling", None, plugin=False))
    for f in lm_families:
        need, refused = facts(f, lm=True)
        out.append(Arch(f"lm:{f}", True, f"{f}_lm_tiny", need or "language_modeling", need, sdpa_refused=refused))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# one architecture in one precision


def train_argv(a: Arch, data: Path, precision: str, opts) -> List[str]:
    """fairseq-train arguments of ``a`` at the smoke dimensions in ``precision``."""
    bf16 = precision == "bf16-autocast"
    task = a.bf16_task if bf16 and a.bf16_task else a.task
    argv = [str(data), "--task", task, "--arch", a.arch, "--dropout", "0.1", *fa.ADAM, "--lr", "1e-4",
            "--max-tokens", "4096", "--seed", "1", "--num-workers", "0"]  # fmt: skip
    argv += fa.dims(opts.layers, opts.dim, opts.ffn, opts.heads, ("decoder",) if a.lm else ("encoder", "decoder"))
    if a.lm:
        argv += ["--criterion", "cross_entropy", "--tokens-per-sample", "64"]
    else:
        argv += ["-s", "src", "-t", "tgt", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"]
    if a.plugin or bf16:
        argv += ["--user-dir", USER_DIR]
    if a.plugin and opts.attention_impl != "fairseq" and not a.sdpa_refused:
        argv += ["--attention-impl", opts.attention_impl]
    if bf16 and a.bf16_task:
        argv += fa.precision_flags("bf16", has_task=True)  # the family's own bf16 task, selected above
    if precision == "fp16":
        argv += fa.precision_flags("fp16")
    if opts.device == "cpu":
        argv.append("--cpu")
    return argv


def smoke_one(a: Arch, precision: str, data: Path, opts) -> dict:
    """Build, train ``--steps`` steps, decode with beam ``--beam``; what was seen, or the error."""
    import torch

    ran = precision if (precision != "fp16" or opts.device == "cuda") else "fp32"
    out: dict = {"arch": a.name, "fairseq_arch": a.arch, "precision": precision, "ran_as": ran}
    notes = []
    if ran != precision:
        notes.append("fp32 (fp16 needs CUDA: fairseq's flat fp16 master is CUDA-only)")
    elif precision == "bf16-autocast" and not a.bf16_task:
        notes.append("autocast through AutocastCriterion (no task with --autocast-bf16 for this model)")
    if a.sdpa_refused and opts.attention_impl != "fairseq":
        notes.append(f"its own attention: --attention-impl {opts.attention_impl} refused ({a.sdpa_refused})")
    if notes:
        out["note"] = "; ".join(notes)
    t0 = time.perf_counter()
    rec = _Recorder()
    try:
        with harness.peak(opts.device) if opts.device == "cuda" else contextlib.nullcontext() as box:
            fcfg = fairseq_config(train_argv(a, data, ran, opts))
            task = setup_task(fcfg)
            run = Run(fcfg, task, Variant("fp16" if ran == "fp16" else "fp32"), opts.device, opts.seed)
            autocast = ran == "bf16-autocast"
            if autocast and not a.bf16_task:
                run.criterion = plugin()[2](run.criterion, opts.device)
            batch = lm_batch(task, opts.batch, opts.seed) if a.lm else translation_batch(task, opts.batch, opts.seed)
            sample = on_device(batch, opts.device)
            losses, syncs = [], []
            want = {"fp16": "float16", "bf16-autocast": "bfloat16", "fp32": "float32"}[ran]
            with record_attention(run.model, rec):
                for _ in range(opts.steps):
                    before = run.overflows
                    # the dtypes of the last step (Admin profiles in fp32 in the first)
                    with count_host_syncs(opts.device) as n, MatmulDtypeAudit(getattr(torch, want)) as audit:
                        run.step(sample)
                    syncs.append(n["n"])
                    losses.append(None if run.overflows > before else round(run.last_loss, 4))
                train_backends = {k: dict(v) for k, v in rec.backends.items()}
                train_matmuls = {str(d).replace("torch.", ""): n for d, n in audit.by_dtype().items()}
                rec.backends.clear()
                with count_host_syncs(opts.device) as n:
                    hypos = decode(a, task, run.model, sample, opts, manual_autocast=autocast and not a.bf16_task)
            decode_syncs = n["n"]
        finite = [x for x in losses if x is not None]
        off = model_products_off(audit, run.model)  # DyT/Derf's alpha gradient, mHC's mapping: fp32 by design
        problems = [
            *(["no update applied (every step overflowed)"] if not finite else []),
            *(["non-finite training loss"] if not all(math.isfinite(x) for x in finite) else []),
            *([f"matrix products not all in {want}: {train_matmuls}"] if off else []),
            *([f"fewer than {opts.beam} hypotheses per sentence"] if any(len(h) < opts.beam for h in hypos) else []),
        ]
        out.update(
            status="failed" if problems else "ok",
            train_losses=losses,
            fp16_overflows=run.overflows,
            syncs_per_train_step=syncs,
            decode_syncs=decode_syncs,
            decoded_sentences=len(hypos),
            hypotheses_per_sentence=sorted({len(h) for h in hypos}),
            matmul_dtypes_train=train_matmuls,
            sdpa_train=train_backends,
            sdpa_decode={k: dict(v) for k, v in rec.backends.items()},
            peak_mem_mib=None if box is None or box.mib is None else round(box.mib, 1),
        )
        if problems:
            out["error"] = "; ".join(problems)
        del run
    except Exception as e:  # noqa: BLE001  (recorded in the row; the next architecture runs)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        out.update(status="error", error=f"{type(e).__name__}: {first}")
    out["seconds"] = round(time.perf_counter() - t0, 2)
    if opts.device == "cuda":
        torch.cuda.empty_cache()
    return out


def decode(a: Arch, task, model, sample: dict, opts, manual_autocast: bool) -> list:
    """fairseq's beam search over the batch (language models: continue each row's first tokens)."""
    import torch
    from fairseq.dataclass.configs import GenerationConfig

    model.eval()
    # as fairseq-generate: beamable cross-attention, no attention weights unless --print-alignment
    model.prepare_for_inference_(SimpleNamespace(generation=GenerationConfig(beam=opts.beam)))
    gen = task.build_generator([model], GenerationConfig(beam=opts.beam, max_len_a=1.2, max_len_b=6))
    if a.lm:
        prefix = sample["net_input"]["src_tokens"][:, :4]  # eos + 3 tokens: every row has at least 4
        sample = {"net_input": {"src_tokens": prefix, "src_lengths": torch.full_like(prefix[:, 0], 4)},
                  "id": sample["id"]}  # fmt: skip
    ctx = torch.autocast(opts.device, dtype=torch.bfloat16) if manual_autocast else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        return task.inference_step(gen, [model], sample)


# ---------------------------------------------------------------------------------------------
# report


def summary(rows: Sequence[dict]) -> str:
    """One markdown table: every architecture and precision, what ran and what was seen."""

    def backends(rec: dict) -> str:
        per = {**rec.get("sdpa_train", {})}
        return "; ".join(f"{k}: {'/'.join(sorted(v))}" for k, v in per.items())

    cells = []
    for r in rows:
        syncs = r.get("syncs_per_train_step") or []
        cells.append([r["arch"], r["ran_as"], r["status"], _fmt(r.get("train_losses")),
                      "/".join(str(s) for s in syncs) or "n/a", r.get("decode_syncs", "n/a"),
                      backends(r) or "n/a", "n/a" if r.get("peak_mem_mib") is None else f"{r['peak_mem_mib']:.0f}",
                      f"{r['seconds']:.1f}", r.get("error", r.get("note", ""))])  # fmt: skip
    header = ["arch", "precision", "status", "train losses", "syncs/step", "decode syncs", "SDPA backend (train)",
              "peak MiB", "s", "note"]  # fmt: skip
    return harness.markdown_table(header, cells, right=(4, 5, 7, 8))


def _fmt(losses) -> str:
    if not losses:
        return "n/a"
    return " ".join("skip" if x is None else f"{x:.2f}" for x in losses)


def build_parser() -> harness.Parser:
    pos = harness.positive_int
    p = harness.Parser(prog="gpu_smoke.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda", help="where to run")
    p.add_argument("--only", default="", help="comma-separated architectures (default: all; --list shows them)")
    p.add_argument("--list", action="store_true", help="print the architectures and exit")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated, of " + ", ".join(PRECISIONS))
    p.add_argument("--attention-impl", choices=("sdpa", "fairseq"), default="sdpa", help="the plugin's attention")
    p.add_argument("--layers", type=pos, default=2, help="layers per stack")
    p.add_argument("--dim", type=pos, default=128, help="embedding dimension")
    p.add_argument("--ffn", type=pos, default=256, help="FFN inner dimension")
    p.add_argument("--heads", type=pos, default=4, help="attention heads")
    p.add_argument("--batch", type=pos, default=8, help="sentences per batch")
    p.add_argument("--steps", type=pos, default=3, help="training steps per architecture and precision")
    p.add_argument("--beam", type=pos, default=4, help="beam size of the decoding")
    p.add_argument("--seed", type=int, default=1, help="model and batch seed")
    p.add_argument("--out-dir", type=Path, help="write smoke.json (after every row) and smoke.md here (default: none)")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    p = build_parser()
    opts = p.parse_args(argv)
    if opts.dim % opts.heads:
        p.error(f"--heads {opts.heads} must divide --dim {opts.dim}")
    precisions = [x for x in opts.precisions.split(",") if x]
    bad = [x for x in precisions if x not in PRECISIONS]
    if bad or not precisions:
        p.error(f"--precisions {opts.precisions!r}: choose from {', '.join(PRECISIONS)}")
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    import torch

    if opts.device == "cuda" and not torch.cuda.is_available():
        harness.fail("--device cuda: no CUDA device is visible to torch")
    archs, setups = list(architectures()), list(SETUPS)
    if opts.list:
        print("\n".join(f"{a.name:<26} --arch {a.arch}" for a in archs))
        print("\n".join(f"{s.name:<26} --arch {s.family}_iwslt_de_en {' '.join(s.flags)}" for s in setups))
        return {}
    if opts.only:
        wanted = [x for x in opts.only.split(",") if x]
        unknown = sorted(set(wanted) - {a.name for a in archs} - {s.name for s in setups})
        if unknown:
            p.error(f"--only: unknown architecture(s) {', '.join(unknown)}; --list shows them")
        archs, setups = [a for a in archs if a.name in wanted], [s for s in setups if s.name in wanted]
    meta = harness.environment(opts.device, "gpu_smoke.py", list(argv if argv is not None else sys.argv[1:]))
    meta.update(dims=f"{opts.layers} layers, d {opts.dim}, FFN {opts.ffn}, {opts.heads} heads", batch=opts.batch,
                steps=opts.steps, beam=opts.beam, attention_impl=opts.attention_impl,
                syncs="CUDA: torch.cuda.set_sync_debug_mode('warn') warnings" if opts.device == "cuda" else
                "CPU: host reads (_local_scalar_dense, equal, nonzero) counted by a dispatch mode")  # fmt: skip
    rows: List[dict] = []
    lock = threading.Lock()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data = write_dictionaries(Path(tmp))
        runs = [(a.name, lambda a=a, p=p: smoke_one(a, p, data, opts)) for a in archs for p in precisions]
        runs += [(s.name, lambda s=s, p=p: smoke_training_one(s, p, opts)) for s in setups for p in precisions]
        for name, run in runs:
            row = run()
            rows.append(row)
            print(f"{name} {row['ran_as']}: {row['status']} {row.get('error', '')}", file=sys.stderr, flush=True)
            with lock:
                _write(opts.out_dir, meta, rows, time.perf_counter() - start, done=False)
    doc = _write(opts.out_dir, meta, rows, time.perf_counter() - start, done=True)
    print(harness.provenance(meta))
    print(summary(rows))
    failed = [f"{r['arch']} {r['ran_as']}" for r in rows if r["status"] != "ok"]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return doc


def _write(out_dir: Path | None, meta: dict, rows: List[dict], seconds: float, done: bool) -> dict:
    doc = {"finished": done, "seconds": round(seconds, 1),
           "passed": sum(r["status"] == "ok" for r in rows), "rows": rows}  # fmt: skip
    if out_dir is not None:
        harness.write_json(out_dir / "smoke.json", doc, meta)
        if done:
            harness.write_markdown(out_dir / "smoke.md", harness.provenance(meta) + "\n\n" + summary(rows))
    return {"meta": meta, **doc}
