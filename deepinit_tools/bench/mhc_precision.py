#!/usr/bin/env python
"""What mHC's fp32 mapping costs and what it buys under bf16 autocast, measured side by side on the CPU.

mHC's mapping (``fairseq_deepinit/modules/hyper.py``, ``ManifoldHyperConnection.mappings``: the projection, the norm,
the sigmoids and Sinkhorn's 20 row/column normalisations) runs in float32 with autocast off, this project's choice
(docs/schemes.md, "Hyper-connections and mHC", "Precision"). Beside it, the same mapping in bf16, the dtype the
model's products take under ``torch.autocast("cpu", torch.bfloat16)`` (``mapping_dtype = torch.bfloat16`` on every
connection). Printed, fp32 mapping against bf16 mapping:

1. **one training update** of an mHC model (forward and loss under bf16 autocast, backward, Adam:
   :func:`deepinit_tools.bench.readiness_build.update`): time (``--rounds`` interleaved rounds of ``--updates``
   updates, the median [min-max] of per-round paired ratios, wall clock and this process's CPU time; > 1: the
   fp32 mapping is slower), the activations autograd saves for the backward of one forward and loss
   (``saved_tensors_hooks``, each storage once, parameters left out), the peak RSS growth of one update in a
   forked child, and the aten ops of one update (``deepinit_tools/harness/op_counters.py``);
2. **the mapping alone**: forward and backward of one connection's ``mappings`` on the model's streams (the
   batch's tokens, ``n`` streams of width ``d``, float32 as the streams are under autocast), same statistics;
3. **what fp32 buys**: for gating factors ``alpha`` 0.01 (the init) to 1 (logits of std ~1, as training moves
   them), the largest deviation of ``H_pre``, ``H_post`` and ``H_res`` from the same mapping in float64 on the
   same streams and weights, and ``H_res``'s distance from doubly stochastic (largest ``|row sum - 1|`` and
   ``|column sum - 1|``; Sinkhorn ends on a column step, so fp64 columns sum to 1 to rounding).

No target is asserted: this prints ratios. Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mhc_precision.py                  # 6+6 layers, d 256, ~3 min
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mhc_precision.py --kind lm --shape 6x64x256x4 --batch 16x64
"""

from __future__ import annotations

from typing import Dict, List

from deepinit_tools import harness
from deepinit_tools.bench import readiness_build as rb
from deepinit_tools.bench.hc_cost import autograd_saved_bytes, batch, parse, vs
from deepinit_tools.harness import counters
from deepinit_tools.harness.fairseq_train import Shape

CASES = ("fp32 mapping", "bf16 mapping")
ALPHAS = (0.01, 0.1, 1.0)


def set_mapping_dtype(model, dtype) -> int:
    """Every mHC connection of ``model`` computes its mapping in ``dtype`` (None: the default, at least float32);
    returns how many there are."""
    from fairseq_deepinit.modules.hyper import ManifoldHyperConnection

    found = [m for m in model.modules() if isinstance(m, ManifoldHyperConnection)]
    for m in found:
        m.mapping_dtype = dtype
    return len(found)


def build(kind: str, case: str, shape: Shape, streams: int) -> rb.Built:
    import torch

    arch = "mhc_iwslt_de_en" if kind == "mt" else "mhc_lm_tiny"
    b = rb.build(kind, arch, shape, "--hc-streams", str(streams))
    if not set_mapping_dtype(b.model, torch.bfloat16 if case == "bf16 mapping" else None):
        raise RuntimeError(f"{arch}: no mHC connection")
    return b


def update_figures(args, shape: Shape, bsz: int, length: int) -> Dict[str, dict]:
    """Section 1: time, saved activations, peak RSS and ops of one update, per case."""
    import torch

    sample = batch(args.kind, bsz, length)
    built = {case: build(args.kind, case, shape, args.streams) for case in CASES}
    for b in built.values():  # a warm-up update each (first-call costs, Adam's state)
        rb.update(b, sample, 0, autocast=True)
    out: Dict[str, dict] = {case: {} for case in CASES}
    for case, b in built.items():  # forked children first: nothing multi-threaded has run in this process
        out[case]["peak"] = harness.cpu_peak_in_fork(lambda measured, b=b: rb.update(b, sample, 1, autocast=True))
    for case, b in built.items():
        params = {p.untyped_storage().data_ptr() for p in b.model.parameters()}
        b.model.train()

        def forward(b=b):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return b.criterion(b.model, sample)[0]

        out[case]["saved"] = autograd_saved_bytes(forward, params)
        with counters.OpCounter() as k:
            rb.update(b, sample, 2, autocast=True)
        out[case]["ops"] = k.total

    def trial(b):
        def run() -> float:
            for i in range(args.updates):
                rb.update(b, sample, 3 + i, autocast=True)
            return float(args.updates)

        return run

    rounds = harness.interleave({c: trial(b) for c, b in built.items()}, args.rounds, warmup=1)
    for case in CASES:
        out[case]["rate"] = harness.Stat.of(rounds.rates(case))
        out[case]["wall"] = harness.Stat.of([1 / r for r in rounds.ratios(case, CASES[1])])
        out[case]["cpu"] = harness.Stat.of([1 / r for r in rounds.ratios(case, CASES[1], clock="cpu")])
    return out


def mapping_figures(args, shape: Shape, tokens: int) -> Dict[str, dict]:
    """Section 2: one connection's mapping, forward and backward, per case (streams float32, as under autocast)."""
    import torch

    from fairseq_deepinit.modules.hyper import ManifoldHyperConnection

    torch.manual_seed(0)
    conn = ManifoldHyperConnection(args.streams, shape.dim)
    x = torch.randn(tokens, args.streams, shape.dim, requires_grad=True)
    dtypes = {"fp32 mapping": None, "bf16 mapping": torch.bfloat16}

    def step(case: str):
        conn.mapping_dtype = dtypes[case]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h_pre, h_post, h_res = conn.mappings(x)
        (h_pre.float().sum() + h_post.float().sum() + h_res.float().square().sum()).backward()

    out: Dict[str, dict] = {}
    exclude = {p.untyped_storage().data_ptr() for p in conn.parameters()} | {x.untyped_storage().data_ptr()}
    for case in CASES:
        conn.mapping_dtype = dtypes[case]

        def forward(case=case):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return conn.mappings(x)

        with counters.OpCounter() as k:
            step(case)
        out[case] = {"saved": autograd_saved_bytes(forward, exclude), "ops": k.total}

    def trial(case: str):
        def run() -> float:
            for _ in range(args.updates * 10):
                step(case)
            return float(args.updates * 10)

        return run

    rounds = harness.interleave({c: trial(c) for c in CASES}, args.rounds, warmup=1)
    for case in CASES:
        out[case]["rate"] = harness.Stat.of(rounds.rates(case))
        out[case]["wall"] = harness.Stat.of([1 / r for r in rounds.ratios(case, CASES[1])])
        out[case]["cpu"] = harness.Stat.of([1 / r for r in rounds.ratios(case, CASES[1], clock="cpu")])
    return out


def accuracy_rows(streams: int, dim: int, tokens: int) -> List[list]:
    """Section 3: per alpha and mapping dtype, the deviation from float64 and H_res's doubly-stochastic drift."""
    import torch

    from fairseq_deepinit.modules.hyper import ManifoldHyperConnection

    rows = []
    for alpha in ALPHAS:
        torch.manual_seed(0)
        conn = ManifoldHyperConnection(streams, dim, gating_init=alpha)
        x = torch.randn(tokens, streams, dim).bfloat16().float()  # the streams' values, as bf16 branches make them
        with torch.no_grad():
            conn.mapping_dtype = torch.float64
            ref = conn.mappings(x)
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                conn.mapping_dtype = dtype
                got = [t.double() for t in conn.mappings(x)]
                dev = [float((g - r).abs().max()) for g, r in zip(got, ref, strict=True)]
                h_res = got[2]
                row = float((h_res.sum(-1) - 1).abs().max())
                col = float((h_res.sum(-2) - 1).abs().max())
                spread = float(ref[2].log().std())  # how far H_res is from uniform (0 at J / n)
                rows.append([f"{alpha:g}", f"{spread:.2f}", name, *(f"{v:.1e}" for v in (*dev, row, col))])
    return rows


def main(argv: List[str] | None = None) -> None:
    args, shape, bsz, length = parse(argv, __doc__)
    update = update_figures(args, shape, bsz, length)
    mapping = mapping_figures(args, shape, bsz * length)
    accuracy = accuracy_rows(args.streams, shape.dim, bsz * length)

    meta = harness.environment("cpu", "mhc_precision.py", argv)
    print(harness.provenance(meta))
    stacks = "encoder and decoder" if args.kind == "mt" else "decoder"
    print(
        f"{args.kind}: {shape.layers} layers per stack ({stacks}), d {shape.dim}, FFN {shape.ffn}, "
        f"{shape.heads} heads; "
        f"n = {args.streams} streams; batch {bsz} x {length} tokens; CPU bf16 autocast, dropouts 0.1, Adam; "
        f"{args.updates} updates per trial (the mapping alone: {10 * args.updates} steps), {args.rounds} rounds. "
        "Ratios: fp32 mapping against bf16 mapping, median [min-max] of per-round paired ratios of time (> 1: the "
        "fp32 mapping is slower).\n"
    )
    header = ["what", "case", "per s", "time vs bf16 (wall)", "(CPU time)", "saved MiB", "vs bf16", "peak RSS MiB",
              "vs bf16", "ops", "vs bf16"]  # fmt: skip
    rows = []
    for what, figs in (("one update", update), ("one mapping, fwd+bwd", mapping)):
        base = figs[CASES[1]]
        for case in CASES:
            f = figs[case]
            peak = f.get("peak")
            rows.append([
                what, case, f["rate"].text("{:.2f}"), f["wall"].text(), f["cpu"].text(), f"{f['saved'] / 2**20:.2f}",
                vs(f["saved"], base["saved"]), "-" if peak is None else f"{peak:.1f}",
                "-" if peak is None else vs(peak, base["peak"]), f["ops"], vs(f["ops"], base["ops"]),
            ])  # fmt: skip
    print(harness.markdown_table(header, rows, right=tuple(range(2, len(header)))))
    print()
    print(
        f"Accuracy of the mapping ({bsz * length} tokens, n = {args.streams}, d {shape.dim}; mapping_proj "
        "xavier-uniform, bias 0, all three gating factors alpha; streams N(0, 1) rounded to bf16): largest "
        "deviation from the float64 mapping, and H_res's largest |row sum - 1| and |column sum - 1|.\n"
    )
    header = ["alpha", "std of log H_res (fp64)", "mapping", "H_pre dev", "H_post dev", "H_res dev", "row drift",
              "col drift"]  # fmt: skip
    print(harness.markdown_table(header, accuracy, right=tuple(range(3, len(header)))))


__all__ = ["CASES", "accuracy_rows", "main", "set_mapping_dtype"]
