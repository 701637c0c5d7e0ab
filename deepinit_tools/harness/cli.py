"""Command-line conventions shared by the benchmark scripts.

Every option's ``--help`` shows its default (``ArgumentDefaultsHelpFormatter``), and bad input
gets one line on stderr and exit status 1 (argparse's own is a usage block and status 2).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the docstring's layout and appends ``(default: X)`` to every option's help that does
    not state its default itself (options whose default depends on other options do)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line and exit with status 1."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        fail(f"{self.prog}: {message}")


def fail(message: str) -> NoReturn:
    """One line on stderr, exit status 1."""
    print(f"error: {message}".replace("\n", " "), file=sys.stderr)
    sys.exit(1)


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    return _int(text, lambda v: v > 0, "a positive integer")


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int(text, lambda v: v >= 0, "an integer >= 0")


def _int(text: str, ok: Callable[[int], bool], what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers, e.g. ``1,32,128``."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be positive")
    return values
