"""The arguments ``fairseq-train`` resolves for a family's architecture, before any run: what a tool asks of a
family without data or a model (the export table's routes, the task ``deepinit-compare`` trains a candidate
under). ``<family>_<size>``; the default sizes are ``iwslt_de_en`` (translation) and ``lm_tiny`` (a language
model): a family's axes are the same at every size."""

from __future__ import annotations

import argparse
from typing import Sequence

from fairseq import options as fairseq_options

from . import options
from .lm.model import resolve_lm_args
from .spec import ModelSpec


def resolved_args(
    family: str, extra: Sequence[str] = (), lm: bool = False, size: str | None = None
) -> argparse.Namespace:
    """The arguments fairseq-train resolves for ``--arch <family>_<size>`` and the options ``extra`` (the
    language model's resolution for ``lm``), with the resolved values stored as the model's build stores them."""
    task = ["--task", "language_modeling"] if lm else ["--task", "translation", "-s", "src", "-t", "tgt"]
    arch = f"{family}_{size or ('lm_tiny' if lm else 'iwslt_de_en')}"
    parser = fairseq_options.get_training_parser()
    args = fairseq_options.parse_args_and_arch(parser, ["/nonexistent", *task, "--arch", arch, *extra])
    if lm:
        resolve_lm_args(args)
    else:
        options.resolve_and_validate(args)
    return args


def family_spec(family: str, extra: Sequence[str] = (), lm: bool = False, size: str | None = None) -> ModelSpec:
    """The :class:`~fairseq_deepinit.spec.ModelSpec` of :func:`resolved_args`."""
    return options.spec_of(resolved_args(family, extra, lm, size))
