"""``deepinit-export-admin-lm ADMIN_LM.pt OUT.pt``: Admin's omega folded into a stock ``transformer_lm`` checkpoint.

An alias of ``deepinit-export CHECKPOINT OUT --to fairseq`` (:func:`fairseq_deepinit.export.cli.main`, the same
code path), narrowed by :data:`ONLY` to Admin language models (it refuses a checkpoint that is not Admin, and a
translation model). The fold is the translation one (:func:`fairseq_deepinit.export.omega.fold_state_dict`) over
the one decoder stack; the stored model arguments are exactly the fields of fairseq's
``TransformerLanguageModelConfig`` (:func:`fairseq_deepinit.export.to_fairseq.export_lm_args`), so stock
``fairseq-eval-lm`` / ``fairseq-interactive`` load the result without ``--user-dir``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import List

from ..admin.export import ONLY as ADMIN_ONLY
from ..export import cli, run
from ..export.to_fairseq import LM_STOCK, export_lm_args

STOCK_NAME = LM_STOCK

__all__ = ["ONLY", "build_parser", "export_lm_args", "export_lm_checkpoint", "main"]

#: what ``deepinit-export-admin-lm`` takes: Admin language models
ONLY = replace(ADMIN_ONLY, lm=True, other="deepinit-export-admin")
ALIAS = cli.Alias(
    "deepinit-export-admin-lm",
    "Fold Admin's omega into a stock fairseq 'transformer_lm' checkpoint that fairseq-eval-lm loads without "
    "--user-dir (Liu et al. 2020, appendix C). An alias of deepinit-export --to fairseq, which does the same for "
    "every foldable family.",
    "an Admin language-model checkpoint (--arch admin_lm*)",
    "where to write the transformer_lm checkpoint",
    ONLY,
)


def export_lm_checkpoint(src: str, dst: str, check: bool = True, tolerance: float = 1e-4, force: bool = False) -> dict:
    """Fold ``src`` (an Admin ``deepinit_lm`` checkpoint) into ``dst``; returns a summary."""
    return run.export_fairseq(src, dst, check, tolerance, only=ONLY, force=force)


def build_parser() -> argparse.ArgumentParser:
    """``deepinit-export-admin-lm``'s options (also walked by tests/test_tools.py)."""
    return cli.build_parser(ALIAS)


def main(argv: List[str] | None = None) -> int:
    return cli.main(argv, ALIAS)


if __name__ == "__main__":
    sys.exit(main())
