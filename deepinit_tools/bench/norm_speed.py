#!/usr/bin/env python
"""ScaleNorm, RMSNorm, DyT and Derf against LayerNorm, side by side: speed per call and kernels per call.

One norm module per case, forward + backward on a ``(T, B, d)`` input (fairseq's layout) with a
fixed cotangent, ``--calls`` calls per trial, ``--rounds`` interleaved rounds (the start rotating,
:func:`harness.interleave`). Printed: calls/s per case (median [min-max] over rounds) and the paired
per-round ratio to LayerNorm (> 1: faster than LayerNorm), on the wall clock and on this process's
CPU time; and the aten operators of one forward + backward as CUDA would launch them (counted on the
``meta`` device, where the modules take their non-CPU path; a fused ``F.rms_norm`` counts once each
way: ``deepinit_tools/harness/op_counters.py``). No target is asserted: this prints ratios.

Cases: ``layernorm`` (fairseq's LayerNorm), ``scalenorm`` and ``rmsnorm`` (the plugin's modules as
they run on ``--device``: on the CPU ScaleNorm takes its hand-written autograd function), and
``scalenorm-rms-norm`` (ScaleNorm as the one ``F.rms_norm`` call it is off the CPU, here on
``--device``: on the CPU torch decomposes it), ``dyt`` and ``derf`` (point-wise, no reduction:
``fairseq_deepinit/modules/dyt.py``).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/norm_speed.py                       # CPU, ~1 min
    .venv/bin/python benchmarks/norm_speed.py --device cuda --dtype fp16 --shape 128x64x1024
"""

from __future__ import annotations

from deepinit_tools import harness
from deepinit_tools.harness.op_counters import OpCounter

DTYPES = ("fp32", "fp16", "bf16")


def plugin():
    """Every import from fairseq_deepinit in this script (one place, for the package's re-layout)."""
    from fairseq_deepinit.modules import dyt, norms

    return norms, dyt


def parse_shape(text: str) -> tuple:
    try:
        t, b, d = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--shape {text!r}: expected TxBxD, e.g. 64x32x512") from None
    if min(t, b, d) <= 0:
        raise ValueError(f"--shape {text!r}: every size must be positive")
    return t, b, d


def cases(d: int):
    import torch.nn as nn

    norms, dyt = plugin()

    class ScaleNormAsRmsNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = norms.ScaleNorm(d)

        def forward(self, x):
            return norms.scalenorm_as_rms_norm(x, self.inner.g, self.inner.eps)

    return {
        "layernorm": lambda: norms.build_norm("layernorm", d),
        "scalenorm": lambda: norms.ScaleNorm(d),
        "rmsnorm": lambda: norms.RMSNorm(d),
        "scalenorm-rms-norm": ScaleNormAsRmsNorm,
        "dyt": lambda: dyt.DyT(d),
        "derf": lambda: dyt.Derf(d),
    }


def main(argv=None) -> None:
    parser = harness.Parser(description=__doc__)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="fp32", choices=DTYPES, help="input and parameter dtype")
    parser.add_argument("--shape", default="64x32x512", help="TxBxD of the input (fairseq's (T, B, C) layout)")
    parser.add_argument("--calls", type=harness.positive_int, default=20, help="forward+backward calls per trial")
    parser.add_argument("--rounds", type=harness.positive_int, default=15, help="interleaved rounds")
    parser.add_argument("--warmup", type=harness.nonnegative_int, default=2, help="untimed trials per case first")
    args = parser.parse_args(argv)
    try:
        t, b, d = parse_shape(args.shape)
    except ValueError as e:
        harness.fail(str(e))

    import torch

    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        harness.fail(f"--device {args.device}: use cpu, or cuda on a machine with a GPU")
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    builders = cases(d)
    torch.manual_seed(0)
    x0 = torch.randn(t, b, d, device=device, dtype=dtype)
    dy = torch.randn(t, b, d, device=device, dtype=dtype)
    modules = {name: build().to(device=device, dtype=dtype) for name, build in builders.items()}

    def trial(module):
        def run() -> float:
            for _ in range(args.calls):
                x = x0.detach().requires_grad_()
                torch.autograd.backward(module(x), dy)
            return float(args.calls)

        return run

    rounds = harness.interleave(
        {name: trial(m) for name, m in modules.items()},
        args.rounds,
        warmup=args.warmup,
        clocks=harness.Clocks(sync=sync),
    )

    ops = {}
    for name, build in builders.items():
        m = build().to(device="meta", dtype=dtype)
        xm = torch.empty(t, b, d, device="meta", dtype=dtype).requires_grad_()
        dym = torch.empty(t, b, d, device="meta", dtype=dtype)
        with OpCounter() as counter:
            torch.autograd.backward(m(xm), dym)
        ops[name] = counter.total

    meta = harness.environment(args.device, "norm_speed.py", argv)
    rows = []
    for name in modules:
        rate = harness.Stat.of(rounds.rates(name))
        wall = harness.Stat.of(rounds.ratios(name, "layernorm"))
        cpu = harness.Stat.of(rounds.ratios(name, "layernorm", clock="cpu"))
        rows.append([name, rate.text("{:.0f}"), wall.text(), cpu.text(), ops[name], ops[name] - ops["layernorm"]])
    header = ["norm", "calls/s", "speed vs LayerNorm (wall)", "speed vs LayerNorm (CPU time)", "ops (CUDA)", "vs LN"]
    print(harness.provenance(meta))
    print(
        f"Shape {t}x{b}x{d} ({args.dtype}), forward + backward, {args.calls} calls per trial, {args.rounds} rounds; "
        "ratios: median [min-max] of per-round paired ratios, > 1 is faster than LayerNorm."
    )
    print(harness.markdown_table(header, rows, right=(1, 4, 5)))
