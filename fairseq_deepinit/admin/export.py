"""``deepinit-export-admin ADMIN.pt OUT.pt``: Admin's omega folded into a stock Post-LN ``transformer`` checkpoint.

An alias of ``deepinit-export CHECKPOINT OUT --to fairseq`` (:func:`fairseq_deepinit.export.cli.main`, the same
code path), narrowed by :data:`ONLY` to Admin translation models: it refuses a checkpoint that is not Admin,
one whose fold to a stock transformer the export refuses, and a language model (``deepinit-export-admin-lm``,
:mod:`fairseq_deepinit.lm.export`). The fold (Liu et al. 2020, appendix C) is
:func:`fairseq_deepinit.export.omega.fold_state_dict`, whose docstring has the derivation. Stock
``fairseq-generate`` loads the result without ``--user-dir`` under torch >= 2.6 (no ``argparse.Namespace`` in
it); unless ``--no-check``, the written file is reloaded as fairseq loads it and its log-probabilities are
compared with the Admin model's (``--tolerance``).
"""

from __future__ import annotations

import argparse
import sys
from typing import List

import torch
from omegaconf import OmegaConf

from ..errors import AdminExportError
from ..export import cli, run
from ..export.omega import export_args, fold_state_dict
from ..export.route import classify
from ..export.source import build_plugin_model
from ..export.to_fairseq import build_stock, compare

__all__ = ["ONLY", "check_exportable", "export_args", "export_checkpoint", "fold_state_dict", "main", "verify"]

#: Admin's residual scaling (the fold of its omega); the commands' name for it in their messages
ADMIN = "admin"
#: what ``deepinit-export-admin`` takes: Admin translation models
ONLY = run.Only(lm=False, other="deepinit-export-admin-lm", residual=ADMIN, label="Admin", error=AdminExportError)
ALIAS = cli.Alias(
    "deepinit-export-admin",
    "Fold Admin's omega into a plain Post-LN fairseq 'transformer' checkpoint (Liu et al. 2020, appendix C) that "
    "stock fairseq-generate loads without --user-dir. An alias of deepinit-export --to fairseq, which does the same "
    "for every foldable family.",
    "an Admin checkpoint written by fairseq-train (--arch admin_*)",
    "where to write the plain transformer checkpoint",
    ONLY,
)


def check_exportable(args) -> None:
    """Refuse, with :class:`~fairseq_deepinit.errors.AdminExportError`, resolved model arguments that are not an
    Admin model a stock transformer can hold (:func:`fairseq_deepinit.export.run.check_only`)."""
    run.check_only(classify(args), ONLY)


def export_checkpoint(src: str, dst: str, check: bool = True, tolerance: float = 1e-4, force: bool = False) -> dict:
    """Fold ``src`` (an Admin translation checkpoint) into ``dst``; returns a summary (changes, check result)."""
    return run.export_fairseq(src, dst, check, tolerance, only=ONLY, force=force)


def verify(admin_sd, admin_args, plain_sd, plain_args: dict, tolerance: float, seed: int = 0) -> float:
    """Build both models in float64 (the plugin's with ``admin_sd``, fairseq's of ``plain_args`` with ``plain_sd``),
    run them on one random padded batch and compare log-probabilities (refused above ``tolerance``)."""
    del seed  # one fixed batch (export.to_fairseq._random_batch)
    plugin = build_plugin_model(admin_sd, admin_args, torch.float64)
    stock = build_stock(OmegaConf.create(plain_args), plugin, {k: v.to(torch.float64) for k, v in plain_sd.items()})
    return compare(plugin, stock, tolerance)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``deepinit-export-admin``."""
    return cli.build_parser(ALIAS)


def main(argv: List[str] | None = None) -> int:
    return cli.main(argv, ALIAS)


if __name__ == "__main__":
    sys.exit(main())
