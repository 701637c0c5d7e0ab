"""Kernels of one optimizer step and of one whole update, and the host reads of an update, per optimizer, counted on
the CPU (:class:`~deepinit_tools.harness.op_counters.OpCounter`, :class:`~deepinit_tools.harness.host_reads.HostReads`:
what a GPU would launch and wait for), on the tiny Pre-LN models of :mod:`deepinit_tools.harness.tiny` at two
depths: fairseq's ``adam`` (a loop over tensors), the plugin's ``adam_foreach`` and ``muon`` (Newton-Schulz in
bfloat16 as released, and ``--muon-ns-fp32``)."""

from __future__ import annotations

import json
import sys
from typing import Any, List, Tuple

from .. import harness
from ..harness.host_reads import HostReads
from ..harness.op_counters import OpCounter

OPTIMIZERS = {
    "adam": ["--optimizer", "adam"],
    "adam_foreach": ["--optimizer", "adam_foreach"],
    "muon": ["--optimizer", "muon"],
    "muon (NS fp32)": ["--optimizer", "muon", "--muon-ns-fp32"],
}
MODELS = {
    "translation 2+2": ("mt", []),
    "translation 6+6": ("mt", ["--encoder-layers", "6", "--decoder-layers", "6"]),
    "LM 6": ("lm", ["--decoder-layers", "6"]),
    "LM 24": ("lm", ["--decoder-layers", "24"]),
}


def plugin() -> Tuple[Any, Any]:
    """The tiny trainers' module and the plugin's ``innermost`` (the torch optimizer inside fairseq's wrappers),
    imported here, once: they load fairseq and register the plugin."""
    from fairseq_deepinit.training.param_groups import innermost

    from ..harness import tiny

    return tiny, innermost


def measure(kind: str, cli: List[str]) -> dict:
    """Counts for one model and optimizer: the step alone, then a whole update (forward, backward, step)."""
    tiny, innermost = plugin()
    t = tiny.tiny_trainer(kind, *cli)
    tiny_sample = tiny.tiny_sample
    t.train_step([tiny_sample(kind, 0)])  # the optimizer's lazy state
    with OpCounter() as step:
        innermost(t._optimizer).optimizer.step()
    with HostReads(cpu_is_device=True) as reads:
        t.train_step([tiny_sample(kind, 1)])
    with OpCounter() as update:
        t.train_step([tiny_sample(kind, 2)])
    return {"tensors": sum(1 for _ in t._model.parameters()), "step": step.total, "update": update.total,
            "host_reads": len(reads.events)}  # fmt: skip


def main(argv: List[str] | None = None) -> int:
    p = harness.Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="also write the figures to this file")
    a = p.parse_args(argv)
    rows = []
    print("| model | tensors | optimizer | kernels per step | x adam_foreach | kernels per update | host reads |")
    print("|---|---|---|---|---|---|---|")
    for model, (kind, dims) in MODELS.items():
        figures = {name: measure(kind, [*dims, *flags]) for name, flags in OPTIMIZERS.items()}
        base = figures["adam_foreach"]["step"]
        for name, f in figures.items():
            rows.append({"model": model, "optimizer": name, **f})
            print(f"| {model} | {f['tensors']} | {name} | {f['step']} | {f['step'] / base:.1f} | {f['update']} "
                  f"| {f['host_reads']} |")  # fmt: skip
    if a.json:
        with open(a.json, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
