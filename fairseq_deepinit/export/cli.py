"""``deepinit-export CHECKPOINT OUT --to fairseq|ctranslate2``: the command line (:mod:`.run` does the work).

A refused family or option, a bad checkpoint, output or option is one line on stderr
(``deepinit-export: error: ...``) and exit status 1, before anything is written; an existing output is
refused unless ``--force`` (:func:`.output.check_destination`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable, List

from .. import errors
from .route import TARGETS
from .run import QUANTIZATIONS, export

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepinit-export",
        description="Export a checkpoint of a deepinit model (translation or language model; fairseq-train or "
        "fairseq-hydra-train) to a stock fairseq transformer / transformer_lm checkpoint that fairseq loads without "
        "--user-dir, or to a CTranslate2 model folder. Families that cannot be exported exactly are refused in one "
        "line (docs/export.md has the table).",
    )
    parser.add_argument(
        "checkpoint", help="a checkpoint written by fairseq-train / fairseq-hydra-train with the plugin"
    )
    parser.add_argument("output", help="--to fairseq: the checkpoint file to write; --to ctranslate2: the model folder")
    parser.add_argument("--to", required=True, choices=TARGETS, help="the target: fairseq or ctranslate2")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="ctranslate2: store the weights quantized (checked in float32 first; default: float32)",
    )
    parser.add_argument(
        "--data",
        metavar="DIR",
        help="ctranslate2: the fairseq-preprocess folder with the model's dictionaries (default: the training's data "
        "folder stored in the checkpoint)",
    )
    parser.add_argument(
        "--no-check", action="store_true", help="skip reloading the export and comparing it with the model"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-4,
        help="largest allowed |log-prob difference| of the check, a finite number >= 0 (default: %(default)s)",
    )
    add_force(parser)
    return parser


FORCE_HELP = (
    "replace an existing output (a file, or a CTranslate2 model folder); never the checkpoint being exported, a "
    "folder holding it, or a checkpoint*.pt in its folder (default: an existing output is refused)"
)


def add_force(parser: argparse.ArgumentParser) -> None:
    """``--force`` (:func:`fairseq_deepinit.export.output.check_destination` says what it may replace)."""
    parser.add_argument("--force", action="store_true", help=FORCE_HELP)


def report(prog: str, output: str, summary: dict) -> None:
    """The export's log line: what was written, what was folded, the check's result."""
    route = summary["route"]
    what = f"arch {summary['arch']}" if "arch" in summary else f"CTranslate2 model ({summary['quantization']})"
    changes = ", ".join(f"{k}={v}" for k, v in summary.get("changes", {}).items())
    check = (
        f"max |log-prob difference| on random sentences {summary['max_abs_diff']:.2e}"
        if "max_abs_diff" in summary
        else "not checked"
    )
    if "quantized_max_abs_diff" in summary:
        check += f" (float32), {summary['quantized_max_abs_diff']:.2e} ({summary['quantization']})"
    extra = f"; argument changes: {changes}" if changes else ""
    logger.info(f"{prog}: wrote {output}: {what}; {route.describe()}{extra}; {check}")


def run_command(
    parser: argparse.ArgumentParser, work: Callable[[argparse.Namespace], dict], argv: List[str] | None
) -> int:
    """Parse ``argv``, run ``work(args)``, log its summary; a plugin error (or a missing input) is one line, exit 1."""
    a = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO)
    try:
        summary = work(a)
    except Exception as e:
        if not (errors.is_plugin_error(e) or isinstance(e, FileNotFoundError)):
            raise
        message = getattr(e, "message", None) or errors.one_line(e)
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 1
    report(parser.prog, a.output, summary)
    return 0


def main(argv: List[str] | None = None) -> int:
    def work(a: argparse.Namespace) -> dict:
        return export(
            a.checkpoint,
            a.output,
            a.to,
            quantization=a.quantization,
            data=a.data,
            check=not a.no_check,
            tolerance=a.tolerance,
            force=a.force,
        )

    return run_command(build_parser(), work, argv)


if __name__ == "__main__":
    sys.exit(main())
