"""``deepinit-export-admin-lm ADMIN_LM.pt OUT.pt``: Admin's omega folded into a stock ``transformer_lm`` checkpoint.

The Admin language-model form of ``deepinit-export CHECKPOINT OUT --to fairseq`` (:mod:`fairseq_deepinit.export`),
kept with its command line and messages (refuses a checkpoint that is not Admin, and a translation model). The
fold is the translation one (:func:`fairseq_deepinit.admin.fold.fold_state_dict`) over the one decoder stack;
the stored model arguments are exactly the fields of fairseq's ``TransformerLanguageModelConfig``
(:func:`fairseq_deepinit.export.to_fairseq.export_lm_args`), so stock ``fairseq-eval-lm`` /
``fairseq-interactive`` load the result without ``--user-dir``.
"""

from __future__ import annotations

import argparse
import sys
from typing import List

from ..admin.export import export_parser, run_export
from ..admin.fold import check_exportable
from ..export import run
from ..export.to_fairseq import LM_STOCK, export_lm_args

STOCK_NAME = LM_STOCK

__all__ = ["build_parser", "export_lm_args", "export_lm_checkpoint", "main"]


def export_lm_checkpoint(src: str, dst: str, check: bool = True, tolerance: float = 1e-4, force: bool = False) -> dict:
    """Fold ``src`` (an Admin ``deepinit_lm`` checkpoint) into ``dst``; returns a summary."""
    return run.export_fairseq(src, dst, check, tolerance, stacks="lm", require=check_exportable, force=force)


def build_parser() -> argparse.ArgumentParser:
    """``deepinit-export-admin-lm``'s options (also walked by tests/test_tools.py)."""
    return export_parser(
        "deepinit-export-admin-lm",
        "Fold Admin's omega into a stock fairseq 'transformer_lm' checkpoint that fairseq-eval-lm loads "
        "without --user-dir (Liu et al. 2020, appendix C). deepinit-export --to fairseq does the same for every "
        "foldable family.",
        "an Admin language-model checkpoint (--arch admin_lm*)",
        "where to write the transformer_lm checkpoint",
    )


def main(argv: List[str] | None = None) -> int:
    return run_export(build_parser(), export_lm_checkpoint, argv)


if __name__ == "__main__":
    sys.exit(main())
