"""``deepinit-export CHECKPOINT OUT --to fairseq|ctranslate2|huggingface``: the command line (:mod:`.run` works).

A refused family or option, a bad checkpoint, output or option is one line on stderr
(``deepinit-export: error: ...``) and exit status 1, before anything is written; an existing output is
refused unless ``--force`` (:func:`.output.check_destination`).

An :class:`Alias` is the same command under another name, ``--to fairseq`` fixed and what it takes narrowed
(:class:`.run.Only`): ``deepinit-export-admin`` (:mod:`fairseq_deepinit.admin.export`) and
``deepinit-export-admin-lm`` (:mod:`fairseq_deepinit.lm.export`) are ``main(argv, alias)``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from typing import Callable, List

from .. import errors
from .route import FAIRSEQ, TARGETS
from .run import QUANTIZATIONS, Only, export

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Alias:
    """``deepinit-export --to fairseq`` under the name ``prog``, taking only what ``only`` says, with its own
    description and help for the two positional arguments."""

    prog: str
    description: str
    checkpoint_help: str
    output_help: str
    only: Only


def build_parser(alias: Alias | None = None) -> argparse.ArgumentParser:
    """``deepinit-export``'s command line, or an alias's (no ``--to``, ``--quantization``, ``--data``)."""
    if alias is not None:
        parser = argparse.ArgumentParser(prog=alias.prog, description=alias.description)
        parser.add_argument("checkpoint", help=alias.checkpoint_help)
        parser.add_argument("output", help=alias.output_help)
        return _check_options(parser)
    parser = argparse.ArgumentParser(
        prog="deepinit-export",
        description="Export a checkpoint of a deepinit model (translation or language model; fairseq-train or "
        "fairseq-hydra-train) to a stock fairseq transformer / transformer_lm checkpoint that fairseq loads without "
        "--user-dir, to a CTranslate2 model folder, or to a Hugging Face transformers model folder (FSMT, M2M100 or "
        "XGLM). Families that cannot be exported exactly are refused in one line (docs/export.md has the table).",
    )
    parser.add_argument(
        "checkpoint", help="a checkpoint written by fairseq-train / fairseq-hydra-train with the plugin"
    )
    parser.add_argument(
        "output", help="--to fairseq: the checkpoint file to write; --to ctranslate2 / huggingface: the model folder"
    )
    parser.add_argument("--to", required=True, choices=TARGETS, help="the target: fairseq, ctranslate2 or huggingface")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="ctranslate2: store the weights quantized (checked in float32 first; default: float32)",
    )
    parser.add_argument(
        "--data",
        metavar="DIR",
        help="ctranslate2, huggingface: the fairseq-preprocess folder with the model's dictionaries (default: the "
        "training's data folder stored in the checkpoint)",
    )
    return _check_options(parser)


def _check_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--no-check``, ``--tolerance``, ``--force``: every form of the command has them."""
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
    if "arch" in summary:
        what = f"arch {summary['arch']}"
    elif "hf_class" in summary:
        tokenizer = (
            "with the tokenizer" if summary["tokenizer"] else "token ids only (no tokenizer: README.md says why)"
        )
        what = f"transformers {summary['hf_class']}, {tokenizer}"
    else:
        what = f"CTranslate2 model ({summary['quantization']})"
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


def main(argv: List[str] | None = None, alias: Alias | None = None) -> int:
    """``deepinit-export argv`` (or ``alias``'s command); the exit status."""

    def work(a: argparse.Namespace) -> dict:
        if alias is not None:
            return export(
                a.checkpoint,
                a.output,
                FAIRSEQ,
                check=not a.no_check,
                tolerance=a.tolerance,
                force=a.force,
                only=alias.only,
            )
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

    return run_command(build_parser(alias), work, argv)


if __name__ == "__main__":
    sys.exit(main())
