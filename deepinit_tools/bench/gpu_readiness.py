#!/usr/bin/env python
"""What a GPU will see, measured without one: a table over every architecture family.

Rows: every translation family (``--arch <family>_iwslt_de_en``), every decoder-only family
(``--arch <family>_lm_tiny``), then MAtt incremental decoding (beam search's calls), Admin profiling
(``--task translation_admin``'s first update) and the diagnostics criterion (an update with and one
without statistics). Every model has the same dimensions (``--shape``, default 6 layers per stack)
and the recipes' dropouts (0.1 on embeddings, attention and activations); stock fairseq
(``transformer`` / ``transformer_lm``, Pre-LN where the family is) is measured beside it on the
same batch: four sentences, sources left-padded and targets right-padded as fairseq batches them.

Columns, each with its target (``ok`` / ``FAIL``; ``-`` where it does not apply):

- ``meta``: one training update (forward, backward, fairseq's update, ``reduce_metrics``) with the
  model on the ``meta`` device, which, like CUDA, refuses a non-scalar CPU operand and has no data
  to read: it must run, with no host read by the plugin (reads are answered with stand-in values
  and counted, harness/counters.py ``HostReads``);
- ``reads/step``: host reads of device data per non-diagnostic update, after one warm-up update,
  on ``meta`` (which sees copies to the host too) and with the CPU standing in for the device
  (``.item()``-like reads; a copy of a CPU tensor to the host is no op there); stock fairseq's in
  brackets. Target: <= 1;
- ``ops``: aten ops that launch a kernel per update, plugin / stock (fused calls counted once, as
  CUDA runs them). Target for the init-only families (same modules as stock) and the methods that
  only move or rescale stock's computation (readiness_table.SAME_COMPUTE): <= 1.02;
- ``causal``: under ``--attention-impl sdpa``, decoder self-attention calls that pass ``is_causal``
  with no T x T mask, of all of them ("refused" where the family refuses ``sdpa``: an attention soft-cap);
- ``sdpa``: under ``--attention-impl sdpa``, self-attention calls that reach
  ``F.scaled_dot_product_attention``, of all of them (MAtt's average branch has none);
- ``fp32 mm``: matrix products (forward and backward) not in bf16 under ``torch.autocast("cpu", torch.bfloat16)``,
  without / with ``--checkpoint-activations``, ``--attention-impl fairseq`` and ``sdpa``. Target: 0 (or refused);
- ``breaks``: ``torch._dynamo.explain`` of the training-mode forward under ``--attention-impl
  fairseq`` (the default) and ``sdpa`` (the fast path): graph breaks by the origin of the line that
  caused them, plugin / fairseq. Target: no break from the plugin's code.

A second table counts the kernels of one norm (forward and backward, fp16 and fp32): RMSNorm at most
LayerNorm's + 2, ScaleNorm at most + 3. Usage::

    OMP_NUM_THREADS=1 python benchmarks/gpu_readiness.py --markdown readiness.md
    OMP_NUM_THREADS=1 python benchmarks/gpu_readiness.py --quick     # smoke run: postln, 2 layers
    OMP_NUM_THREADS=1 python benchmarks/gpu_readiness.py --families preln --flags "--norm-type zc-rmsnorm"
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple

from deepinit_tools import harness
from deepinit_tools.bench.readiness_build import (
    SDPA,
    Built,
    batch,
    build,
    fp32_cell,
    norm_kernels,
    one_line,
    plugin,
    reads,
    refused,
    update,
)
from deepinit_tools.bench.readiness_table import (
    OP_TARGETED,
    REFUSED,
    cells,
    markdown,
    model_products_off,
)
from deepinit_tools.harness import counters
from deepinit_tools.harness.fairseq_train import Shape

# --- the measurements of one family ---------------------------------------------------------------


@dataclasses.dataclass
class Family:
    kind: str  # "mt" / "lm"
    name: str
    flags: Tuple[str, ...] = ()  # model flags added to the family's (--flags: an axis value, --norm-type X)

    @property
    def arch(self) -> str:
        return f"{self.name}_iwslt_de_en" if self.kind == "mt" else f"{self.name}_lm_tiny"

    @property
    def label(self) -> str:
        name = " ".join((self.name, *self.flags))
        return name if self.kind == "mt" else f"{name} (LM)"

    @property
    def task(self) -> str | None:
        """Admin's profiling task where omega must be profiled before training."""
        if self.name != "admin":
            return None
        return "translation_admin" if self.kind == "mt" else "language_modeling_admin"


def stock_arch(kind: str) -> str:
    return "transformer" if kind == "mt" else "transformer_lm"


def stock_flags(b: Built) -> List[str]:
    """Stock at the family's norm position (fairseq's transformer_lm is always Pre-LN)."""
    if b.kind == "mt" and (b.args.encoder_normalize_before or b.args.decoder_normalize_before):
        return ["--encoder-normalize-before", "--decoder-normalize-before"]
    return []


def stock_key(b: Built) -> str:
    return f"{b.kind} {' '.join(stock_flags(b))}".strip()


class Measure:
    """Every column of the table for one family (stock's figures cached per stack kind and norm position)."""

    def __init__(self, shape: Shape, explain: bool) -> None:
        self.shape = shape
        self.explain = explain
        self.stock: Dict[str, dict] = {}

    def steady(self, b: Built, kind: str) -> dict:
        """Host reads (CPU) and kernels of the second update (the first warms caches, profiles Admin)."""
        sample = batch(kind)
        update(b, sample, 0)
        cpu = reads(lambda: update(b, sample, 1), meta=False)
        with counters.OpCounter() as k:
            update(b, sample, 2)
        return {"cpu_reads": cpu.count(), "cpu_lines": cpu.lines(), "ops": k.total}

    def meta_run(self, fam_kind: str, arch: str, *extra: str, task: str | None = None) -> dict:
        """Two updates on meta (the second counted); ``error`` if the plugin's code cannot run there."""
        try:
            b = build(fam_kind, arch, self.shape, *extra, task=task, meta=True)
            sample = batch(fam_kind, "meta")
            first = reads(lambda: update(b, sample, 0), meta=True)
            hr = reads(lambda: update(b, sample, 1), meta=True)
        except Exception as e:  # noqa: BLE001  (the row records the failure)
            return {"error": one_line(e)}
        return {"reads": hr.count(), "plugin_reads": hr.count("plugin"), "lines": hr.lines(),
                "first_plugin_reads": first.count("plugin")}  # fmt: skip

    def stock_figures(self, b: Built) -> dict:
        key = stock_key(b)
        if key not in self.stock:
            sb = build(b.kind, stock_arch(b.kind), self.shape, *stock_flags(b))
            fig = self.steady(sb, b.kind)
            fig["meta"] = self.meta_run(b.kind, stock_arch(b.kind), *stock_flags(b))
            self.stock[key] = fig
        return self.stock[key]

    def family(self, fam: Family) -> dict:
        b = build(fam.kind, fam.arch, self.shape, *fam.flags, task=fam.task)
        row: Dict[str, Any] = {"row": fam.label, "kind": fam.kind, "arch": fam.arch}
        row.update(self.steady(b, fam.kind))
        stock = self.stock_figures(b)
        row["stock"] = {k: stock[k] for k in ("cpu_reads", "ops")}
        row["stock"]["meta_reads"] = stock["meta"].get("reads")
        row["stock_arch"] = " ".join([stock_arch(fam.kind), *stock_flags(b)])
        row["op_ratio"] = row["ops"] / stock["ops"]
        row["op_targeted"] = fam.name in OP_TARGETED
        row["meta"] = self.meta_run(fam.kind, fam.arch, *fam.flags, task=fam.task)
        row.update(self.attention(fam))
        row["fp32_mm"] = {f"{impl} {mode}".removeprefix("fairseq "): self.fp32_matmuls(fam, mode == "checkpoint", impl)
                          for impl in ("fairseq", "sdpa") for mode in ("plain", "checkpoint")}  # fmt: skip
        if self.explain:
            row["breaks"] = self.breaks(fam)
        return row

    def attention(self, fam: Family) -> dict:
        """SDPA calls of one update under ``--attention-impl sdpa``: self-attention reach, decoder causality
        (:data:`REFUSED` both where the family refuses ``sdpa`` in one line)."""
        try:
            b = build(fam.kind, fam.arch, self.shape, *fam.flags, "--attention-impl", "sdpa", task=fam.task)
        except Exception as e:
            if refused(e, SDPA):
                return {"sdpa": REFUSED, "causal": REFUSED}
            raise
        sample = batch(fam.kind)
        update(b, sample, 0)
        with counters.AttentionCalls(b.model) as calls:
            update(b, sample, 1)
        self_calls, decoder = calls.self_attention(), calls.self_attention("decoder")
        causal = [c for c in decoder if c.path == "sdpa" and c.is_causal and not c.square_mask]
        return {
            "sdpa": (sum(c.path == "sdpa" for c in self_calls), len(self_calls)),
            "causal": (len(causal), len(decoder)),
        }

    def fp32_matmuls(self, fam: Family, checkpoint: bool, impl: str = "fairseq") -> int | str:
        """Matrix products of one update not in bf16 under CPU bf16 autocast (forward under autocast)."""
        extra = ("--attention-impl", impl, *(("--checkpoint-activations",) if checkpoint else ()))
        try:
            b = build(fam.kind, fam.arch, self.shape, *fam.flags, *extra, task=fam.task)
            sample = batch(fam.kind)
            update(b, sample, 0)  # through the task: Admin profiles its omega here
            update(b, sample, 1, autocast=True)
            with counters.MatmulDtypeAudit() as audit:  # bf16 expected
                update(b, sample, 2, autocast=True)
        except Exception as e:  # noqa: BLE001
            return fp32_cell(e, checkpoint, impl)
        return sum(model_products_off(audit, b.model, checkpoint).values())  # less mHC's fp32 mapping

    def breaks(self, fam: Family) -> dict:
        """Graph breaks of the training-mode forward, by origin: ``--attention-impl fairseq`` and ``sdpa``."""
        return {impl: self._breaks(fam, impl) for impl in ("fairseq", "sdpa")}

    def _breaks(self, fam: Family, impl: str) -> dict:
        try:
            b = build(fam.kind, fam.arch, self.shape, *fam.flags, "--attention-impl", impl, task=fam.task)
        except Exception as e:
            if impl == "sdpa" and refused(e, SDPA):
                return {"refused": True}
            raise
        sample = batch(fam.kind)
        if fam.task:  # Admin: profile first (the forward refuses to train an unprofiled omega)
            update(b, sample, 0)
        b.model.train()
        try:
            graphs, found = counters.graph_breaks(b.model, **sample["net_input"])
        except Exception as e:  # noqa: BLE001
            return {"error": one_line(e)}
        by: Dict[str, int] = {}
        for br in found:
            by[br.origin] = by.get(br.origin, 0) + 1
        plugin = sorted({f"{br.where}: {br.reason[:120]}" for br in found if br.origin == "plugin"})
        return {"graphs": graphs, "by_origin": by, "plugin": plugin}

    # --- the special rows ----------------------------------------------------------------------

    def matt_decoding(self, steps: int = 4, beam: int = 2) -> dict:
        """MAtt's incremental decoding (beam search's decoder calls and reorders), on meta and the CPU,
        against stock's; reads per decoding step."""

        def run(arch: str, meta: bool) -> counters.HostReads:
            b = build("mt", arch, self.shape, meta=meta)
            sample = batch("mt", "meta" if meta else "cpu")
            return reads(lambda: decode(b, sample, steps, beam), meta=meta)

        row: Dict[str, Any] = {"row": "matt decoding", "kind": "special"}
        try:
            meta = run("matt_iwslt_de_en", True)
            row["meta"] = {"reads": meta.count(), "plugin_reads": meta.count("plugin"), "lines": meta.lines()}
        except Exception as e:  # noqa: BLE001
            row["meta"] = {"error": one_line(e)}
        cpu = run("matt_iwslt_de_en", False)
        stock_meta, stock_cpu = run("transformer", True), run("transformer", False)
        row.update(per_step=steps, cpu_reads=cpu.count() / steps, cpu_lines=cpu.lines())
        row["stock"] = {"cpu_reads": stock_cpu.count() / steps, "meta_reads": stock_meta.count() / steps}
        if "reads" in row["meta"]:
            row["meta"]["reads"] /= steps
        return row

    def admin_profiling(self) -> dict:
        """``--task translation_admin``'s first update: profiling (one read of the profile) and the step."""
        row: Dict[str, Any] = {"row": "admin profiling", "kind": "special"}
        try:
            b = build("mt", "admin_iwslt_de_en", self.shape, task="translation_admin", meta=True)
            sample = batch("mt", "meta")
            hr = reads(lambda: update(b, sample, 0), meta=True)
            row["meta"] = {"reads": hr.count(), "plugin_reads": hr.count("plugin"), "lines": hr.lines()}
        except Exception as e:  # noqa: BLE001
            row["meta"] = {"error": one_line(e)}
        b = build("mt", "admin_iwslt_de_en", self.shape, task="translation_admin")
        sample = batch("mt")
        cpu = reads(lambda: update(b, sample, 0), meta=False)
        row.update(cpu_reads=cpu.count(), cpu_lines=cpu.lines())
        return row

    def diagnostics(self, family: str = "twt") -> dict:
        """The diagnostics criterion (interval 2): a plain update (1) and a diagnostic one (2), on meta."""
        extra = ("--criterion", "label_smoothed_cross_entropy_diagnostics", "--diagnostics-interval", "2")
        row: Dict[str, Any] = {"row": f"diagnostics ({family})", "kind": "special"}
        arch = f"{family}_iwslt_de_en"
        try:
            b = build("mt", arch, self.shape, *extra, meta=True)
            sample = batch("mt", "meta")
            plain = reads(lambda: update(b, sample, 0), meta=True)
            diag = reads(lambda: update(b, sample, 1), meta=True)
            row["meta"] = {"reads": plain.count(), "plugin_reads": plain.count("plugin"), "lines": plain.lines(),
                           "diagnostic_reads": diag.count(), "diagnostic_lines": diag.lines()}  # fmt: skip
        except Exception as e:  # noqa: BLE001
            row["meta"] = {"error": one_line(e)}
        b = build("mt", arch, self.shape, *extra)
        sample = batch("mt")
        plain = reads(lambda: update(b, sample, 0), meta=False)
        diag = reads(lambda: update(b, sample, 1), meta=False)
        row.update(cpu_reads=plain.count(), cpu_lines=plain.lines(), cpu_diagnostic_reads=diag.count())
        return row


def decode(b: Built, sample: dict, steps: int, beam: int) -> None:
    """What fairseq's SequenceGenerator asks of the model: the encoder once, then per step one
    incremental decoder call and the reorder of the decoder's state and the encoder output."""
    import torch

    model = b.model.eval()
    net = sample["net_input"]
    bsz = net["src_tokens"].size(0)
    device = net["src_tokens"].device
    model.decoder.set_beam_size(beam)
    with torch.no_grad():
        enc = model.encoder(net["src_tokens"], src_lengths=net["src_lengths"])
        expand = torch.arange(bsz, device=device).repeat_interleave(beam)
        enc = model.encoder.reorder_encoder_out(enc, expand)
        tokens = torch.full((bsz * beam, 1), b.task.target_dictionary.eos(), dtype=torch.long, device=device)
        state: Dict[str, Dict[str, Any]] = torch.jit.annotate(Dict[str, Dict[str, Any]], {})
        # a fixed reorder (each sentence's beams swap), so that no index depends on the scores
        order = torch.arange(bsz * beam, device=device).view(bsz, beam).flip(1).reshape(-1)
        for _ in range(steps):
            out, _ = model.decoder(tokens, encoder_out=enc, incremental_state=state)
            tokens = torch.cat([tokens, out[:, -1].argmax(-1, keepdim=True)], dim=1)
            model.decoder.reorder_incremental_state_scripting(state, order)
            enc = model.encoder.reorder_encoder_out(enc, order)
            tokens = tokens.index_select(0, order)


def build_parser() -> harness.Parser:
    p = harness.Parser(prog="gpu_readiness.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: the postln family, 2 layers, no LM, no explain")
    p.add_argument("--families", help="comma-separated families (default: every one of the plugin)")
    p.add_argument("--no-lm", action="store_true", help="leave out the decoder-only (LM) rows (default: included)")
    p.add_argument("--no-special", action="store_true", help="leave out MAtt decoding, Admin profiling, diagnostics")
    p.add_argument("--no-explain", action="store_true", help="skip torch._dynamo.explain (the slowest column)")
    p.add_argument("--flags", default="", help="model flags added to every family's, e.g. '--norm-type zc-rmsnorm'")
    p.add_argument(
        "--shape", type=_shape, help="LAYERSxDIMxFFNxHEADS of every model (default: 6x32x64x2; quick 2x32x64x2)"
    )
    p.add_argument("--json", type=Path, help="write every figure here (default: none)")
    p.add_argument("--markdown", type=Path, help="write the tables here (default: none)")
    return p


def _shape(text: str) -> Shape:
    return Shape.parse(text)


def main(argv: List[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    plugin()
    from fairseq_deepinit.architectures import FAMILIES
    from fairseq_deepinit.lm.architectures import LM_FAMILIES

    shape = opts.shape or Shape(2 if opts.quick else 6, 32, 64, 2)
    names = opts.families.split(",") if opts.families else (["postln"] if opts.quick else list(FAMILIES))
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        harness.fail(f"--families: unknown {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    flags = tuple(opts.flags.split())
    fams = [Family("mt", n, flags) for n in names]
    if not (opts.no_lm or opts.quick):
        fams += [Family("lm", n, flags) for n in names if n in LM_FAMILIES]
    m = Measure(shape, explain=not (opts.no_explain or opts.quick))
    rows = []
    for fam in fams:
        try:
            row = m.family(fam)
        except Exception as e:  # noqa: BLE001  (a family that does not build: recorded, the others run)
            row = {"row": fam.label, "kind": fam.kind, "arch": fam.arch, "error": one_line(e)}
        rows.append(row)
        print(" | ".join(cells(row)), flush=True)
    if not opts.no_special:
        specials = [m.matt_decoding(), m.admin_profiling(), m.diagnostics()]
        if not opts.quick:
            specials.append(m.diagnostics("rezero"))
        for row in specials:
            rows.append(row)
            print(" | ".join(cells(row)), flush=True)
    norms = norm_kernels()
    meta = harness.environment("cpu", "gpu_readiness.py", argv)
    meta["shape"] = str(shape)
    text = markdown(rows, norms, meta)
    print("\n" + text)
    harness.write_json(opts.json, {"shape": str(shape), "rows": rows, "norms": norms}, meta)
    harness.write_markdown(opts.markdown, text)
    return 0
