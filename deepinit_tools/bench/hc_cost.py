#!/usr/bin/env python
"""What hyper-connections and Attention Residuals cost against Pre-LN, side by side: time, memory and kernels of one
training update.

Cases (one shape, one batch, the recipes' dropouts): ``preln`` (the baseline), ``hc`` (dynamic, ``n`` streams),
``hc-static``, ``mhc`` (Megatron-LM's rule, Sinkhorn's backward recomputed from its logits) and ``mhc-autograd``
(the same model with autograd keeping every Sinkhorn iterate, what the recompute saves), the default set; with
``--cases``, also ``attnres`` (Full Attention Residuals) and ``blockattnres`` (Block, 2 layers per block). Each is
built as fairseq-train builds it and takes fairseq training updates (forward, loss, backward, Adam step;
:mod:`deepinit_tools.bench.readiness_build`). Printed per case, and as a ratio to ``preln``:

- update time: ``--rounds`` interleaved rounds of ``--updates`` updates (:func:`harness.interleave`), the
  median of the per-round paired ratios (> 1: slower than Pre-LN), wall clock and this process's CPU time;
- saved activations: the bytes autograd keeps for the backward of one forward and loss (``saved_tensors_hooks``,
  each storage once, parameters left out): deterministic, the streams' ``n``-fold width shows here first;
- peak memory: the RSS growth of one update in a forked child after an unmeasured one
  (:func:`harness.cpu_peak_in_fork`): activations, gradients and the optimizer's temporaries;
- kernels: the aten operators of one update (``deepinit_tools/harness/op_counters.py``), what a GPU launches.

No target is asserted: this prints ratios. Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hc_cost.py                     # 6+6 layers, d 256, ~2 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hc_cost.py --kind lm --shape 6x64x256x4
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hc_cost.py --cases preln,attnres,blockattnres
"""

from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Tuple

from deepinit_tools import harness
from deepinit_tools.bench import readiness_build as rb
from deepinit_tools.harness import counters
from deepinit_tools.harness.fairseq_train import Shape

CASES = {
    "preln": ("preln", ()),
    "hc": ("hc", ()),
    "hc-static": ("hc", ("--no-hc-dynamic",)),
    "mhc": ("mhc", ()),
    "mhc-autograd": ("mhc", ()),  # Sinkhorn's iterates kept by autograd (set after the build)
    "attnres": ("attnres", ()),
    "blockattnres": ("blockattnres", ()),
}
DEFAULT_CASES = ("preln", "hc", "hc-static", "mhc", "mhc-autograd")
STREAM_FAMILIES = ("hc", "mhc")  # the families --streams applies to


def batch(kind: str, bsz: int, length: int) -> dict:
    """``bsz`` sentences of ``length`` tokens (source and target alike), no padding."""
    import torch

    d = rb.dictionary()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(d.nspecial, len(d), (bsz, length), generator=g)
    target = torch.cat([tokens[:, 1:], torch.full((bsz, 1), d.eos())], dim=1)
    prev = torch.cat([torch.full((bsz, 1), d.eos()), tokens[:, :-1]], dim=1)
    net = {"src_tokens": prev, "src_lengths": torch.full((bsz,), length)}
    if kind == "mt":
        src = torch.randint(d.nspecial, len(d), (bsz, length), generator=g)
        net = {"src_tokens": src, "src_lengths": torch.full((bsz,), length), "prev_output_tokens": prev}
    return {"id": torch.arange(bsz), "net_input": net, "target": target, "ntokens": bsz * length, "nsentences": bsz}


def build(kind: str, case: str, shape: Shape, streams: int) -> rb.Built:
    family, extra = CASES[case]
    arch = f"{family}_iwslt_de_en" if kind == "mt" else f"{family}_lm_tiny"
    flags = ("--hc-streams", str(streams), *extra) if family in STREAM_FAMILIES else extra
    b = rb.build(kind, arch, shape, *flags)
    if case == "mhc-autograd":
        for m in b.model.modules():
            if hasattr(m, "recompute"):
                m.recompute = False
    return b


def autograd_saved_bytes(run: Callable[[], object], exclude: set) -> int:
    """Bytes autograd saves while ``run()`` builds its graph (each storage once, ``exclude``'s storages left out)."""
    import torch

    seen: Dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return sum(seen.values())


def saved_bytes(b: rb.Built, sample: dict) -> int:
    """Bytes autograd saves for the backward of one forward and loss (each storage once, no parameters)."""
    params = {p.untyped_storage().data_ptr() for p in b.model.parameters()}
    b.model.train()
    return autograd_saved_bytes(lambda: b.criterion(b.model, sample)[0], params)


def vs(value: float, reference: float) -> str:
    """``value / reference``, or ``-`` where the reference measured nothing (a toy shape's update can fit in
    pages the process already holds: no RSS growth to divide by)."""
    return f"{value / reference:.2f}" if reference > 0 else "-"


def parse(argv: List[str] | None, description: str) -> Tuple[argparse.Namespace, Shape, int, int]:
    """The command line of the hyper-connection benchmarks (this one and ``mhc_precision.py``): ``(args, shape,
    sentences, tokens)``, the plugin imported."""
    parser = harness.Parser(description=description)
    parser.add_argument("--kind", default="mt", choices=("mt", "lm"), help="translation (mt) or decoder-only (lm)")
    parser.add_argument("--shape", default="6x256x1024x4", help="LAYERSxDIMxFFNxHEADS (each stack)")
    parser.add_argument("--streams", type=harness.positive_int, default=4, help="the expansion rate n")
    parser.add_argument("--batch", default="16x32", help="SENTENCESxTOKENS of the batch")
    parser.add_argument("--updates", type=harness.positive_int, default=2, help="updates per timed trial")
    parser.add_argument("--rounds", type=harness.positive_int, default=7, help="interleaved rounds")
    parser.add_argument(
        "--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, from {', '.join(CASES)} (preln always)"
    )
    args = parser.parse_args(argv)
    cases = ["preln"] + [c for c in args.cases.split(",") if c and c != "preln"]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        harness.fail(f"--cases: unknown {', '.join(unknown)}; choose from {', '.join(CASES)}")
    args.cases = cases
    try:
        shape = Shape.parse(args.shape)
        bsz, length = (int(v) for v in args.batch.lower().split("x"))
    except ValueError as e:
        harness.fail(f"--shape / --batch: {e}")
    rb.plugin()
    return args, shape, bsz, length


def main(argv: List[str] | None = None) -> None:
    args, shape, bsz, length = parse(argv, __doc__)
    sample = batch(args.kind, bsz, length)
    built = {case: build(args.kind, case, shape, args.streams) for case in args.cases}
    for b in built.values():  # a warm-up update each (first-call costs, Adam's state)
        rb.update(b, sample, 0)

    peak = {}
    for case, b in built.items():  # forked children first: nothing multi-threaded has run in this process
        peak[case] = harness.cpu_peak_in_fork(lambda measured, b=b: rb.update(b, sample, 1))
    saved = {case: saved_bytes(b, sample) for case, b in built.items()}
    ops = {}
    for case, b in built.items():
        with counters.OpCounter() as k:
            rb.update(b, sample, 2)
        ops[case] = k.total

    def trial(b):
        def run() -> float:
            for i in range(args.updates):
                rb.update(b, sample, 3 + i)
            return float(args.updates)

        return run

    rounds = harness.interleave({c: trial(b) for c, b in built.items()}, args.rounds, warmup=1)
    params = {c: sum(p.numel() for p in b.model.parameters()) for c, b in built.items()}

    meta = harness.environment("cpu", "hc_cost.py", argv)
    rows = []
    for case in args.cases:
        slower = harness.Stat.of([1 / r for r in rounds.ratios(case, "preln")])
        slower_cpu = harness.Stat.of([1 / r for r in rounds.ratios(case, "preln", clock="cpu")])
        rows.append([
            case, f"{params[case] / 1e6:.2f}M", harness.Stat.of(rounds.rates(case)).text("{:.2f}"),
            slower.text(), slower_cpu.text(), f"{saved[case] / 2**20:.1f}", vs(saved[case], saved["preln"]),
            f"{peak[case]:.1f}", vs(peak[case], peak["preln"]), ops[case], vs(ops[case], ops["preln"]),
        ])  # fmt: skip
    header = ["case", "params", "updates/s", "time vs Pre-LN (wall)", "(CPU time)", "saved MiB", "vs Pre-LN",
              "peak RSS MiB", "vs Pre-LN", "ops/update", "vs Pre-LN"]  # fmt: skip
    print(harness.provenance(meta))
    stacks = "encoder and decoder" if args.kind == "mt" else "decoder"
    streams = f" n = {args.streams} streams;" if any(CASES[c][0] in STREAM_FAMILIES for c in args.cases) else ""
    print(
        f"{args.kind}: {shape.layers} layers per stack ({stacks}), d {shape.dim}, FFN {shape.ffn}, {shape.heads} "
        f"heads;{streams} batch {bsz} x {length} tokens; fp32, dropouts 0.1, Adam; "
        f"{args.updates} updates per trial, {args.rounds} rounds. Ratios: median [min-max] of per-round paired "
        "ratios of time per update (> 1: slower than Pre-LN)."
    )
    print(harness.markdown_table(header, rows, right=tuple(range(1, len(header)))))
