"""``deepinit-export-admin ADMIN.pt OUT.pt``: Admin's omega folded into a stock Post-LN ``transformer`` checkpoint.

The Admin-only form of ``deepinit-export CHECKPOINT OUT --to fairseq`` (:mod:`fairseq_deepinit.export`, which
does the work and exports every other foldable family too), kept with its command line and messages:
it refuses a checkpoint that is not Admin, and a language model (``deepinit-export-admin-lm``,
:mod:`fairseq_deepinit.lm.export`). The fold (Liu et al. 2020, appendix C) is
:func:`fairseq_deepinit.admin.fold.fold_state_dict`, whose docstring has the derivation. Stock
``fairseq-generate`` loads the result without ``--user-dir`` under torch >= 2.6 (no ``argparse.Namespace`` in
it); unless ``--no-check``, the written file is reloaded as fairseq loads it and its log-probabilities are
compared with the Admin model's (``--tolerance``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, List

import torch
from omegaconf import OmegaConf

from ..export import cli, run
from ..export.source import build_plugin_model
from ..export.to_fairseq import build_stock, compare
from .fold import check_exportable, export_args, fold_state_dict

__all__ = ["check_exportable", "export_args", "export_checkpoint", "fold_state_dict", "main", "verify"]


def export_checkpoint(src: str, dst: str, check: bool = True, tolerance: float = 1e-4, force: bool = False) -> dict:
    """Fold ``src`` (an Admin translation checkpoint) into ``dst``; returns a summary (changes, check result)."""
    return run.export_fairseq(src, dst, check, tolerance, stacks="translation", require=check_exportable, force=force)


def verify(admin_sd, admin_args, plain_sd, plain_args: dict, tolerance: float, seed: int = 0) -> float:
    """Build both models in float64 (the plugin's with ``admin_sd``, fairseq's of ``plain_args`` with ``plain_sd``),
    run them on one random padded batch and compare log-probabilities (refused above ``tolerance``)."""
    del seed  # one fixed batch (export.to_fairseq._random_batch)
    plugin = build_plugin_model(admin_sd, admin_args, torch.float64)
    stock = build_stock(OmegaConf.create(plain_args), plugin, {k: v.to(torch.float64) for k, v in plain_sd.items()})
    return compare(plugin, stock, tolerance)


def export_parser(prog: str, description: str, checkpoint_help: str, output_help: str) -> argparse.ArgumentParser:
    """The command line every Admin export tool shares: CHECKPOINT OUTPUT [--no-check] [--tolerance] [--force]."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("checkpoint", help=checkpoint_help)
    parser.add_argument("output", help=output_help)
    parser.add_argument(
        "--no-check", action="store_true", help="skip building both models and comparing outputs (default: compare)"
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-4,
        help="largest allowed |log-prob difference|, a finite number >= 0 (default: %(default)s)",
    )
    cli.add_force(parser)
    return parser


def run_export(parser: argparse.ArgumentParser, export: Callable[..., dict], argv: List[str] | None) -> int:
    """Parse ``argv``, run ``export(checkpoint, output, check=, tolerance=, force=)``; a plugin error is one line,
    exit 1."""
    return cli.run_command(
        parser,
        lambda a: export(a.checkpoint, a.output, check=not a.no_check, tolerance=a.tolerance, force=a.force),
        argv,
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``deepinit-export-admin``."""
    return export_parser(
        "deepinit-export-admin",
        "Fold Admin's omega into a plain Post-LN fairseq 'transformer' checkpoint (Liu et al. 2020, "
        "appendix C) that stock fairseq-generate loads without --user-dir. deepinit-export --to fairseq does "
        "the same for every foldable family.",
        "an Admin checkpoint written by fairseq-train (--arch admin_*)",
        "where to write the plain transformer checkpoint",
    )


def main(argv: List[str] | None = None) -> int:
    return run_export(build_parser(), export_checkpoint, argv)


if __name__ == "__main__":
    sys.exit(main())
