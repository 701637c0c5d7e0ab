"""fp32 against bf16 autocast for the quickstart's model on the CPU (docs/quickstart.md, "Precision").

Each round trains the quickstart's configuration (``scripts/quickstart.sh``: ``twt_iwslt_de_en``, d=128,
FFN 512, 4 heads, 2+2 layers, Adam lr 2e-3 with 200 warm-up updates, 1,024-token batches, seed 1) for
``--updates`` updates once in fp32 and once with ``--task translation_deepinit --autocast-bf16``, the order
rotating from round to round, as real fairseq-train processes whose meters read the process's CPU clock
(other jobs on a shared machine do not inflate it). Same seed, so the same batches in the same order.

Reported per precision (median [min-max] over rounds): updates per CPU second (fairseq's ``ups`` over the
log intervals, the first one, which holds the start-up, dropped), the bf16 / fp32 ratio of that speed
paired within each round, the training loss of the last log interval and the dev loss after the last
update. Data: the quickstart's binarised corpus (run ``bash scripts/quickstart.sh`` first) or ``--data``.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quickstart_precision.py --updates 300 --repeats 3
    ... benchmarks/quickstart_precision.py --layers 6        # the same with 6+6 layers
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List

from deepinit_tools import fairseq_argv as fa
from deepinit_tools import harness
from deepinit_tools.harness.fairseq_tools import run_tool, train_inner
from deepinit_tools.paths import REPO, USER_DIR

DATA = REPO / "work-data" / "bible-s-k" / "bpe8000-len80" / "bin"
PRECISIONS = ("fp32", "bf16")


def cpu_bf16() -> str:
    """The plugin's verdict on this CPU's bf16 (its one import from ``fairseq_deepinit``)."""
    from fairseq_deepinit.training.cpu_bf16 import native_bf16

    native, why = native_bf16()
    return f"{'native' if native else 'not native'}: {why}"


def train_argv(opts, precision: str) -> List[str]:
    """The quickstart's fairseq-train flags (``scripts/quickstart.sh``) for ``--updates`` updates."""
    task = fa.precision_flags("bf16") if precision == "bf16" else ["--task", "translation"]
    argv = [
        opts.data, "--user-dir", USER_DIR, *task, "-s", "de", "-t", "en", "--arch", "twt_iwslt_de_en",
        *fa.dims(opts.layers, opts.dim, opts.ffn, opts.heads), "--share-all-embeddings", *fa.ADAM,
        "--clip-norm", "1.0", "--lr", "2e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "200",
        "--warmup-init-lr", "1e-7", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--dropout", "0.1", "--max-tokens", opts.max_tokens, "--max-update", opts.updates, "--seed", "1",
        "--required-batch-size-multiple", "1", "--no-save", "--cpu", "--num-workers", "0",
        "--log-format", "simple", "--log-interval", opts.log_interval,
    ]  # fmt: skip
    return [str(a) for a in argv]


def run(opts, precision: str, log: Path) -> Dict[str, float]:
    """One training run: updates per CPU second, last interval's train loss, dev loss at the end."""
    out = run_tool("train", train_argv(opts, precision), log=log, clock="cpu").output
    inner = train_inner(out)
    if len(inner) < 2 or int(inner[-1]["num_updates"]) != opts.updates:
        raise SystemExit(f"{precision}: expected {opts.updates} updates in log intervals of {opts.log_interval}: {log}")
    dev = re.findall(r"valid on 'valid' subset \| loss ([\d.]+)", out)
    return {
        "ups": harness.median([r["ups"] for r in inner[1:]]),
        "train_loss": inner[-1]["loss"],
        "dev_loss": float(dev[-1]) if dev else float("nan"),
    }


def parser() -> harness.Parser:
    p = harness.Parser(description=__doc__)
    p.add_argument("--data", type=Path, default=DATA, help="binarised de-en corpus (the quickstart's)")
    p.add_argument("--updates", type=harness.positive_int, default=300, help="updates per training run")
    p.add_argument("--repeats", type=harness.positive_int, default=3, help="rounds (fp32 and bf16 once each)")
    p.add_argument("--log-interval", type=harness.positive_int, default=25, help="fairseq's --log-interval")
    p.add_argument("--layers", type=harness.positive_int, default=2, help="layers per stack")
    p.add_argument("--dim", type=harness.positive_int, default=128, help="model width")
    p.add_argument("--ffn", type=harness.positive_int, default=512, help="FFN width")
    p.add_argument("--heads", type=harness.positive_int, default=4, help="attention heads")
    p.add_argument("--max-tokens", type=harness.positive_int, default=1024, help="tokens per batch")
    p.add_argument("--work", type=Path, default=REPO / "work-data" / "quickstart_precision", help="logs")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--markdown", type=Path, help="write the table here")
    return p


def main(argv: List[str] | None = None) -> int:
    opts = parser().parse_args(argv)
    if opts.updates % opts.log_interval or opts.updates < 2 * opts.log_interval:
        harness.fail(
            f"--updates {opts.updates} must be a multiple of --log-interval {opts.log_interval}, twice or more"
        )
    if not (opts.data / "dict.de.txt").is_file():
        harness.fail(f"no binarised corpus in {opts.data}: run bash scripts/quickstart.sh first, or pass --data")
    opts.work.mkdir(parents=True, exist_ok=True)
    meta = harness.environment("cpu", "quickstart_precision.py", argv)
    bf16 = cpu_bf16()
    runs: Dict[str, List[Dict[str, float]]] = {p: [] for p in PRECISIONS}
    for r in range(opts.repeats):
        for precision in harness.rotation(PRECISIONS, r):
            runs[precision].append(run(opts, precision, opts.work / f"{precision}.{r}.log"))
            print(f"round {r + 1}/{opts.repeats} {precision}: {runs[precision][-1]}", flush=True)
    ratio = harness.Stat.of(harness.paired_ratios([x["ups"] for x in runs["bf16"]], [x["ups"] for x in runs["fp32"]]))
    rows = []
    for p in PRECISIONS:
        ups = harness.Stat.of([x["ups"] for x in runs[p]])
        rows.append([
            p, ups.text("{:.2f}"), ratio.text("{:.2f}") if p == "bf16" else "1",
            harness.Stat.of([x["train_loss"] for x in runs[p]]).text("{:.3f}"),
            harness.Stat.of([x["dev_loss"] for x in runs[p]]).text("{:.3f}"),
        ])  # fmt: skip
    shape = f"{opts.layers}+{opts.layers} layers, d={opts.dim}, FFN {opts.ffn}, {opts.heads} heads"
    header = ["precision", "updates / CPU s", "bf16 / fp32", f"train loss @{opts.updates}", f"dev loss @{opts.updates}"]
    table = harness.markdown_table(header, rows, right=(1, 2, 3, 4))
    text = f"{harness.provenance(meta)}\nModel: {shape}; CPU bf16 {bf16}.\n\n{table}\n"
    print(text)
    harness.write_markdown(opts.markdown, text)
    harness.write_json(opts.json, {"runs": runs, "cpu_bf16": bf16, "shape": shape}, meta)
    return 0
