"""The command line of ``benchmarks/gpu_session.py`` (docs/benchmarks.md, "GPU session").

Three uses::

    gpu_session.py prepare                       # here: the data the device call carries, and its size
    gpu_session.py --out-dir $OUT --t0 $T0       # on the device: the stages (default: the first draw's)
    gpu_session.py --device cpu --quick --out-dir /tmp/out     # the rehearsal, on the CPU
    gpu_session.py --plan                        # what each stage is expected to take on an H100
    gpu_session.py paste FOLDER                  # here: the returned files into the docs
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Sequence

from deepinit_tools import harness
from deepinit_tools.matrix import regimes as rg
from deepinit_tools.paths import REPO
from deepinit_tools.session import data as data_mod
from deepinit_tools.session.stages import DEFAULT_BUDGET_MIN, FIRST, SECOND, STAGES, Budget, parse_stages

QUICK_DIMS, DEVICE_DIMS = (32, 64, 2), (256, 1024, 4)


def build_parser() -> harness.Parser:
    pos = harness.positive_int
    p = harness.Parser(prog="gpu_session.py", description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--stages", default="first", help=f"comma-separated stages, in order; 'first' = {','.join(FIRST)}, "
        f"'second' = {','.join(SECOND)} (all: {', '.join(STAGES)})")  # fmt: skip
    add("--budget-min", type=float, default=DEFAULT_BUDGET_MIN, help="wall-clock minutes of the session, from --t0")
    add("--t0", type=float, help="Unix time the device command started (date +%%s; default: now)")
    add("--device", choices=("cuda", "cpu"), default="cuda", help="where every stage runs")
    add("--quick", action="store_true", help="the CPU rehearsal's sizes (with --device cpu)")
    add("--out-dir", type=Path, default=REPO / "work-data" / "gpu-session" / "out",
        help="what the session returns (the device's $OUT): at most 7 files")  # fmt: skip
    add("--work-dir", type=Path, default=Path("/tmp/gpu-session"), help="the stages' own files (cleared per stage)")
    add("--carry", type=Path, default=REPO / ".carry", help="the prepared data (`prepare`)")
    add("--smoke-only", default="", help="smoke test: these architectures only (default: every one)")
    add("--methods", default=",".join(rg.MAIN_METHODS), help="cells: the methods, each in its paper's regime")
    add("--jobs", type=int, default=0, help="cells trained at once (default 0: all of them)")
    add("--dim", type=pos, help="cells' width (default 256; --quick 32)")
    add("--ffn", type=pos, help="cells' FFN width (default 1024; --quick 64)")
    add("--heads", type=pos, help="cells' attention heads (default 4; --quick 2)")
    add("--patience", type=pos, default=3, help="cells: epochs without a better dev loss before a cell stops")
    add("--max-epochs", type=pos, default=50, help="cells: epoch cap")
    add("--decode-s", type=float, help="cells: seconds kept for test decoding (default: 45 + 2.5 x layers on "
        "CUDA, 20 + 10 a cell on the CPU)")  # fmt: skip
    add("--plan", action="store_true", help="print what each stage is expected to take on an H100, and exit")
    add("--rehearsal", type=Path, help="--plan: a rehearsal's output folder, its measured minutes shown beside")
    return p


def parse(argv: Sequence[str]):
    p = build_parser()
    a = p.parse_args(argv)
    try:
        a.stage_list = parse_stages(a.stages)
    except ValueError as e:
        p.error(str(e))
    if a.quick and a.device != "cpu":
        p.error("--quick is the CPU rehearsal: add --device cpu")
    if a.budget_min <= 0 or a.jobs < 0:
        p.error("--budget-min must be positive and --jobs at least 0")
    unknown = [m for m in a.methods.split(",") if m not in rg.MAIN_METHODS]
    if unknown:
        p.error(f"--methods: {', '.join(unknown)} not among the papers' methods {', '.join(rg.MAIN_METHODS)}")
    a.methods = a.methods.split(",")
    dims = QUICK_DIMS if a.quick else DEVICE_DIMS
    a.dim, a.ffn, a.heads = (v if v is not None else d for v, d in zip((a.dim, a.ffn, a.heads), dims, strict=True))
    if a.dim % a.heads:
        p.error(f"--heads {a.heads} must divide --dim {a.dim}")
    a.t0 = a.t0 if a.t0 is not None else time.time()
    return a


def prepare_main(argv: Sequence[str]) -> int:
    p = harness.Parser(prog="gpu_session.py prepare", description="Prepare the data the device call carries.")
    p.add_argument("--carry", type=Path, default=REPO / ".carry", help="where the data goes (git-ignored)")
    p.add_argument("--multi30k-dir", help="Multi30k's raw gzip files (default: $MULTI30K_DIR, ../shared, download)")
    a = p.parse_args(argv)
    from deepinit_tools import multi30k

    try:
        made = data_mod.prepare(a.carry, a.multi30k_dir)
    except multi30k.Multi30kError as e:
        harness.fail(str(e))
    for what, path in made.items():
        print(f"{what}: {path}")
    sizes = data_mod.carried_bytes()
    print("carried by the device call: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items()))
    if not (REPO / ".device" / "whl").is_dir():
        harness.fail("no .device/whl: run `bash ../shared/tools/device-wheels.sh` first (the fairseq wheels)")
    if sizes["total"] > data_mod.CARRY_LIMIT:
        harness.fail(f"{sizes['total'] / 2**20:.1f} MiB to carry, over the device's 64 MiB: remove untracked files")
    return 0


def paste_main(argv: Sequence[str]) -> int:
    from deepinit_tools.matrix.common import MatrixError
    from deepinit_tools.session.paste import PasteError, paste

    p = harness.Parser(prog="gpu_session.py paste", description="A session's returned files into the docs.")
    p.add_argument("folder", type=Path, help="the folder the device call's files came back in (files_at)")
    p.add_argument("--docs-dir", type=Path, default=REPO / "docs", help="the docs to write into")
    p.add_argument("--allow-cpu", action="store_true", help="paste a CPU rehearsal too (tests)")
    a = p.parse_args(argv)
    try:
        for line in paste(a.folder, a.docs_dir, a.allow_cpu):
            print(line)
    except (PasteError, MatrixError) as e:
        harness.fail(str(e))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "prepare":
        return prepare_main(argv[1:])
    if argv and argv[0] == "paste":
        return paste_main(argv[1:])
    a = parse(argv)
    budget = Budget(a.t0, a.budget_min, quick=a.quick)
    if a.plan:
        from deepinit_tools.bench.gpu_smoke import SETUPS, architectures
        from deepinit_tools.session.plan import plan

        # a training row (3 updates of a 2+2-layer d-64 model, no decoding) as half an architecture row
        rows = 2 * len(architectures()) + len(SETUPS)
        print(plan(a.stage_list, budget, rows, a.jobs or len(a.methods), a.rehearsal))
        return 0
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            harness.fail("--device cuda: no CUDA device is visible to torch (the rehearsal: --device cpu --quick)")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    from deepinit_tools.session.driver import Session

    return Session(a.stage_list, budget, a, argv).run()
