"""What z-loss and QK-Clip cost a training update, side by side with the same Pre-LN model without them.

Each case is fairseq's ``Trainer`` (built in-process as fairseq-train builds it, so that the plugin's hook
on ``Trainer._build_optimizer`` attaches QK-Clip's step) running ``train_step`` on one fixed batch:

- ``preln``: ``--arch preln_<size>``, ``--criterion label_smoothed_cross_entropy``;
- ``z-loss``: the same with ``--criterion label_smoothed_cross_entropy_zloss --z-loss``;
- ``qk-clip``: the same as ``preln`` with ``--qk-clip`` (every attention measured, the clip after each step).

Printed per case and model kind (translation, language model): updates/s (median [min-max] over
``--rounds`` interleaved rounds, :func:`harness.interleave`), the paired per-round ratio to ``preln`` (> 1:
faster) on the wall clock and in CPU time, the aten kernels of one update (``OpCounter``, fused calls once, as
CUDA launches them) and its host reads of device data with the CPU standing in for the device
(``HostReads``). No target is asserted: this prints ratios.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/stabiliser_cost.py                        # CPU, ~2 min
    OMP_NUM_THREADS=1 python benchmarks/stabiliser_cost.py --attention-impl sdpa
"""

from __future__ import annotations

from typing import Any, Dict, List

from deepinit_tools import fairseq_argv as fa
from deepinit_tools import harness
from deepinit_tools.harness import counters
from deepinit_tools.harness.fairseq_train import Shape

CASES = {
    "preln": [],
    "z-loss": ["--criterion", "label_smoothed_cross_entropy_zloss", "--z-loss"],
    "qk-clip": ["--qk-clip"],
}


def plugin() -> Any:
    """The plugin (imported here, once: it registers its models, criteria and its trainer hook)."""
    import fairseq_deepinit

    return fairseq_deepinit


def trainer(kind: str, shape: Shape, impl: str, extra: List[str]):
    """fairseq's ``Trainer`` for one case, on the CPU, its optimizer built."""
    import torch
    from fairseq import options, tasks
    from fairseq.data import Dictionary
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    plugin()
    if kind == "mt":
        argv = ["--task", "translation", "-s", "src", "-t", "tgt", "--arch", "preln_iwslt_de_en", *shape.flags()]
    else:
        argv = ["--task", "language_modeling", "--arch", "preln_lm_tiny", "--tokens-per-sample", "64",
                *fa.dims(shape.layers, shape.dim, shape.ffn, shape.heads, ("decoder",))]  # fmt: skip
    argv = ["/nonexistent", *argv, *fa.ADAM, "--lr", "1e-3", "--cpu", "--attention-impl", impl,
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", *extra]  # fmt: skip
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    d = Dictionary()
    for i in range(1000):
        d.add_symbol(f"w{i}")
    d.finalize(padding_factor=8)
    task = tasks.TASK_REGISTRY[args.task](args, d, d)
    torch.manual_seed(1)
    model = task.build_model(args)
    t = Trainer(convert_namespace_to_omegaconf(args), task, model, task.build_criterion(args))
    t.optimizer  # noqa: B018  (built: the plugin's hooks attach here)
    return t


def batch(kind: str, bsz: int, length: int) -> dict:
    """``bsz`` sentences of ``length`` tokens (no padding), targets the inputs shifted."""
    import torch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 1000, (bsz, length + 1), generator=g)
    prev, target = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    lengths = torch.full((bsz,), length)
    if kind == "mt":
        src = torch.randint(4, 1000, (bsz, length), generator=g)
        net = {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev}
    else:
        net = {"src_tokens": prev, "src_lengths": lengths}
    return {"id": torch.arange(bsz), "net_input": net, "target": target, "ntokens": target.numel(), "nsentences": bsz}


def measure(kind: str, shape: Shape, impl: str, sample: dict, rounds: int, updates: int) -> Dict[str, list]:
    """Every case's row for one model kind."""
    from fairseq.logging import metrics

    built = {name: trainer(kind, shape, impl, extra) for name, extra in CASES.items()}

    def trial(t):
        def run() -> float:
            with metrics.aggregate(new_root=True):
                for _ in range(updates):
                    t.train_step([sample])
            return float(updates)

        return run

    timed = harness.interleave({n: trial(t) for n, t in built.items()}, rounds, warmup=1)
    rows = {}
    for name, t in built.items():
        with metrics.aggregate(new_root=True):
            with counters.OpCounter() as ops:
                t.train_step([sample])
            with counters.HostReads(cpu_is_device=True) as reads:
                t.train_step([sample])
        rows[name] = [
            harness.Stat.of(timed.rates(name)).text("{:.2f}"),
            harness.Stat.of(timed.ratios(name, "preln")).text(),
            harness.Stat.of(timed.ratios(name, "preln", clock="cpu")).text(),
            ops.total,
            len(reads.events),
        ]
    return rows


def main(argv=None) -> None:
    parser = harness.Parser(description=__doc__)
    parser.add_argument("--shape", type=Shape.parse, default=Shape(6, 64, 256, 4), help="LAYERSxDIMxFFNxHEADS")
    parser.add_argument("--attention-impl", default="fairseq", choices=("fairseq", "sdpa"), help="attention path")
    parser.add_argument("--batch", default="16x32", help="SENTENCESxTOKENS of the batch")
    parser.add_argument("--rounds", type=harness.positive_int, default=7, help="interleaved rounds")
    parser.add_argument("--updates", type=harness.positive_int, default=3, help="updates per trial")
    parser.add_argument("--no-lm", action="store_true", help="translation only")
    args = parser.parse_args(argv)
    try:
        bsz, length = (int(v) for v in args.batch.lower().split("x"))
    except ValueError:
        harness.fail(f"--batch {args.batch!r}: expected SENTENCESxTOKENS, e.g. 16x32")
    meta = harness.environment("cpu", "stabiliser_cost.py", argv)
    print(harness.provenance(meta))
    print(f"Shape {args.shape}, batch {bsz}x{length}, --attention-impl {args.attention_impl}, {args.updates} "
          f"updates per trial, {args.rounds} rounds; ratios: median [min-max] of per-round paired ratios to preln, "
          "> 1 is faster.")  # fmt: skip
    header = ["model", "case", "updates/s", "vs preln (wall)", "vs preln (CPU time)", "ops/update", "host reads"]
    table = []
    for kind in ("mt",) if args.no_lm else ("mt", "lm"):
        rows = measure(kind, args.shape, args.attention_impl, batch(kind, bsz, length), args.rounds, args.updates)
        table += [[{"mt": "translation", "lm": "LM"}[kind], name, *row] for name, row in rows.items()]
    print(harness.markdown_table(header, table, right=(2, 5, 6)))
