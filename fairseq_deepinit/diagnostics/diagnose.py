"""``deepinit-diagnose``: measure at initialisation (or on a checkpoint) what the papers plot.

::

    deepinit-diagnose DATA --arch postln_iwslt_de_en --encoder-layers 18 --decoder-layers 18 \\
        --output-dir diag/postln18 [--measure grad,flow,norm,change,scalenorm] [fairseq-train options]
    deepinit-diagnose DATA --checkpoint checkpoints/checkpoint_best.pt --output-dir diag/trained
    deepinit-diagnose --compare diag/postln18 diag/dsinit18 --output-dir diag/compare

Bad input (an option out of range, a data folder or split that does not exist, an ``--output-dir``
that cannot be a folder, a split with no sentence short enough for ``--max-tokens``) ends the command
with one line, ``deepinit-diagnose: error: ...``, and exit status 1 (argparse's own errors: status 2).

Writes ``diagnostics.json`` and PNG plots (matplotlib, Agg backend) into ``--output-dir``:

- ``grad_norm.png``: gradient norm of every encoder and decoder layer (DS-Init, Zhang et al. 2019, Fig. 1);
- ``gradient_flow.png``: beta_LN, beta_RC, beta and Var(r) of every sub-layer, with the per-type means
  of DS-Init's Table 1 in the JSON (definitions: :mod:`fairseq_deepinit.diagnostics`);
- ``norm_input.png``: mean l2 norm of the input of every normalisation layer (T-Fixup, Huang et al. 2020, Fig. 3);
- ``output_change.png``: ``|F(x, W) - F(x, W + delta)|^2`` against depth N for a random delta and for
  one Adam step, encoder and decoder output, with fitted slopes (Admin, Liu et al. 2020, Fig. 4);
- ``scalenorm_g.png``: the learned ScaleNorm g against depth (Transformers without Tears, Fig. 3),
  for models with ``--norm-type scalenorm``.

Every option this command does not know is a ``fairseq-train`` option (model, task, criterion), so a
model is described exactly as for training. Decoder-only language models (``--task language_modeling
--arch <family>_lm*``) have one stack: every measurement and plot is then the decoder's, and the
output-change sweep sets ``--decoder-layers``. Measurements use the first ``--num-batches`` batches of
``--subset`` (``--max-tokens`` each), in training mode (dropout as configured) for gradients, and with
dropout off for the output change.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from typing import List, Sequence

from .. import errors
from ..errors import DeepInitConfigError
from . import depth_diagnose, plots
from .hooks import residual_parameters, scalenorm_gains
from .measure import Setup, measure_gradients, measure_output_change, parse_depths

logger = logging.getLogger(__name__)

MEASURES = ("grad", "flow", "norm", "change", "scalenorm", *depth_diagnose.MEASURES)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        # 0 would measure no change at all (and fit a flat line with R^2 = 1); nan/inf no number
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepinit-diagnose",
        description="Measure gradient norms per layer (DS-Init Fig. 1), beta_LN/beta_RC/Var(r) (DS-Init Table 1), "
        "norm-layer input norms (T-Fixup Fig. 3), output change against depth (Admin Fig. 4) and ScaleNorm g "
        "(TwT Fig. 3). Unknown options are passed to fairseq-train's parser (--arch, --encoder-layers, ...).",
        allow_abbrev=False,
    )
    p.add_argument("data", nargs="?", help="fairseq-preprocess output folder (not needed with --compare)")
    p.add_argument("--output-dir", required=True, help="where diagnostics.json and the PNG plots go")
    p.add_argument("--checkpoint", help="measure a trained checkpoint (default: none, a freshly initialised model)")
    p.add_argument(
        "--measure",
        default=None,
        help=f"comma-separated subset of {','.join(MEASURES)} (default: all; without 'change' for --checkpoint)",
    )
    p.add_argument("--subset", default="train", help="data split to take batches from (default: train)")
    p.add_argument(
        "--num-batches",
        type=_positive_int,
        default=1,
        help="batches to pool for gradients and statistics (default %(default)s)",
    )
    p.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=4096,
        help="tokens per batch; longer sentences are skipped, as fairseq-train does (default 4096)",
    )
    p.add_argument(
        "--seed", type=int, default=1, help="seed of the model initialisation and the batch order (default %(default)s)"
    )
    p.add_argument(
        "--depths", default="2,4,8,16", help="layers per stack for the output-change sweep (default 2,4,8,16)"
    )
    p.add_argument("--repeats", type=_positive_int, default=3, help="initialisations averaged per depth (default 3)")
    p.add_argument(
        "--perturb-scale", type=_positive_float, default=1e-4, help="std of the random perturbation (default 1e-4)"
    )
    p.add_argument(
        "--adam-lr", type=_positive_float, default=1e-5, help="learning rate of the one Adam step (default 1e-5)"
    )
    p.add_argument(
        "--change-batches",
        type=_positive_int,
        default=1,
        help="batches the output change is measured on (default %(default)s)",
    )
    p.add_argument("--label", help="name of this run in plots and in --compare (default: the model description)")
    p.add_argument(
        "--compare",
        nargs="+",
        metavar="RUN_DIR",
        help="overlay the results of earlier runs (default: none, measure a model)",
    )
    p.add_argument(
        "--training-log",
        metavar="LOG",
        help="plot the diagnostics criterion's statistics over depth and its counters over updates from a "
        "fairseq-train log (--log-format json or simple) instead of measuring a model (default: none)",
    )
    return p


def _measures(spec: str | None, checkpoint: bool) -> List[str]:
    if spec is None:
        return [m for m in MEASURES if not (checkpoint and m == "change")]
    chosen = [m.strip() for m in spec.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(MEASURES))
    if unknown:
        raise DeepInitConfigError(f"unknown --measure {', '.join(unknown)}; choose from {', '.join(MEASURES)}")
    if not chosen:
        raise DeepInitConfigError(f"--measure {spec!r} names nothing to measure; choose from {', '.join(MEASURES)}")
    if checkpoint and "change" in chosen:
        raise DeepInitConfigError(
            "--measure change sweeps depths from freshly built models; it cannot use --checkpoint. Drop one of them."
        )
    return chosen


def _check_output_dir(path: str) -> None:
    """Refuse, before any work, an ``--output-dir`` that cannot be a folder (it is created at the end)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise DeepInitConfigError(f"--output-dir {path} is a file; give a folder (created if missing)")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):  # the deepest part that exists (the root always does)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise DeepInitConfigError(f"--output-dir {path} cannot be created: {existing} is a file; give another folder")


def _make_output_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise DeepInitConfigError(
            f"--output-dir {path} cannot be created ({e.strerror or e}); give another folder"
        ) from e


def run(opts: argparse.Namespace, fairseq_argv: List[str]) -> dict:

    measures = _measures(opts.measure, bool(opts.checkpoint))
    if "change" in measures:
        parse_depths(opts.depths)  # refused before any model is built
    _check_output_dir(opts.output_dir)
    setup = Setup(opts, fairseq_argv)
    n_tokens = sum(int(b["ntokens"]) for b in setup.batches[: opts.num_batches])
    result: dict = {
        "label": opts.label or setup.describe(),
        "model": setup.describe(),
        "arch": getattr(setup.args, "arch", None),
        "encoder_layers": getattr(setup.args, "encoder_layers", None),
        "decoder_layers": getattr(setup.args, "decoder_layers", None),
        "checkpoint": opts.checkpoint,
        "data": opts.data,
        "batches": {"count": min(opts.num_batches, len(setup.batches)), "target_tokens": n_tokens},
        "command": ["deepinit-diagnose", *sys.argv[1:]],
        "plots": [],
    }
    if any(m in measures for m in ("grad", "flow", "norm")):
        result.update(measure_gradients(setup, measures))
    if "scalenorm" in measures:
        gains = scalenorm_gains(setup.model)
        result["scalenorm_g"] = gains if gains else None
    result["residual_parameters"] = {
        sub: {k: p.detach().double().mean().item() for k, p in params.items()}
        for sub, params in residual_parameters(setup.model).items()
    }
    if "change" in measures:
        result["output_change"] = measure_output_change(setup)
    if "depth" in measures:
        result["depth"] = depth_diagnose.measure_depth(setup.model, setup.batches[: opts.num_batches])
    if "removal" in measures:
        batches = setup.batches[: opts.num_batches]
        result["layer_removal"] = depth_diagnose.measure_removal(setup.model, setup.criterion, batches)
    out = opts.output_dir
    _make_output_dir(out)
    if "grad_norm" in result:
        result["plots"].append(plots.plot_grad_norm([result], os.path.join(out, "grad_norm.png")))
    if "gradient_flow" in result:
        result["plots"].append(plots.plot_gradient_flow(result, os.path.join(out, "gradient_flow.png")))
    if result.get("norm_input"):
        result["plots"].append(plots.plot_norm_input(result, os.path.join(out, "norm_input.png")))
    if "output_change" in result:
        result["plots"].append(plots.plot_output_change([result], os.path.join(out, "output_change.png")))
    if result.get("scalenorm_g"):
        result["plots"].append(plots.plot_scalenorm(result, os.path.join(out, "scalenorm_g.png")))
    result["plots"] += depth_diagnose.plot(result, out)
    with open(os.path.join(out, "diagnostics.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(summary(result))
    return result


def compare(opts: argparse.Namespace) -> List[str]:
    """Overlay gradient norms and output changes of several earlier runs (their ``diagnostics.json``)."""
    runs = []
    for d in opts.compare:
        path = os.path.join(d, "diagnostics.json") if os.path.isdir(d) else d
        if not os.path.isfile(path):
            raise DeepInitConfigError(f"--compare: {path} not found (run deepinit-diagnose first)")
        with open(path) as f:
            runs.append(json.load(f))
    _check_output_dir(opts.output_dir)
    _make_output_dir(opts.output_dir)
    written = []
    with_grad = [r for r in runs if "grad_norm" in r]
    if with_grad:
        written.append(plots.plot_grad_norm(with_grad, os.path.join(opts.output_dir, "grad_norm.png")))
    with_change = [r for r in runs if "output_change" in r]
    if with_change:
        written.append(plots.plot_output_change(with_change, os.path.join(opts.output_dir, "output_change.png")))
    if not written:
        raise DeepInitConfigError("--compare: none of the runs has gradient norms or output changes")
    for p in written:
        print(p)
    return written


def summary(result: dict) -> str:
    lines = [f"deepinit-diagnose: {result['label']}"]
    if "grad_norm" in result:
        for stack in ("encoder", "decoder"):
            v = result["grad_norm"][stack]
            if v:
                lines.append(f"  grad norm {stack} layers 1..{len(v)}: " + " ".join(f"{x:.3g}" for x in v))
    if "gradient_flow" in result:
        lines.append("  DS-Init Table 1 (mean per sub-layer type): beta_LN beta_RC beta Var(r)")
        for t, row in result["gradient_flow"]["per_type"].items():
            lines.append(f"    {t:<22} {row['beta_ln']:.3f} {row['beta_rc']:.3f} {row['beta']:.3f} {row['var_r']:.3f}")
    if "output_change" in result:
        oc = result["output_change"]
        for kind in ("random", "adam"):
            for stack, fit in oc[kind]["fit"].items():
                lines.append(
                    f"  output change {kind:<6} {stack}: slope {fit['slope']:.3g}/layer, relative slope "
                    f"{fit['relative_slope']:.3g}, exponent {fit['exponent']:.2f} (R2 linear {fit['r2_linear']:.2f},"
                    f" log {fit['r2_log']:.2f})"
                )
    lines += depth_diagnose.summary_lines(result)
    if result.get("plots"):
        lines.append("  plots: " + ", ".join(result["plots"]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # the console command: fairseq's imports leave the root logger at DEBUG
        argv = sys.argv[1:]
        logging.basicConfig(
            format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
            level=os.environ.get("LOGLEVEL", "INFO").upper(),
            stream=sys.stdout,
            force=True,
        )
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
    parser = build_parser()
    opts, rest = parser.parse_known_args(list(argv))
    if opts.compare and (rest or opts.data):
        parser.error("--compare takes run folders only; drop the data folder and the model options")
    if opts.training_log and (rest or opts.data or opts.compare):
        parser.error("--training-log takes a log only; drop the data folder, the model options and --compare")
    if not (opts.compare or opts.training_log) and not opts.data:
        parser.error("the data folder is required (the output of fairseq-preprocess)")
    try:
        if opts.training_log:
            _check_output_dir(opts.output_dir)
            records = depth_diagnose.read_training_log(opts.training_log)  # refused before a folder is made
            _make_output_dir(opts.output_dir)
            for path in depth_diagnose.plot_training_log(opts.training_log, opts.output_dir, records):
                print(path)
        elif opts.compare:
            compare(opts)
        else:
            run(opts, rest)
    except Exception as e:
        if not errors.is_plugin_error(e):
            raise
        print(f"{parser.prog}: error: {getattr(e, 'message', None) or errors.one_line(e)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
