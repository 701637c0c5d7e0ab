"""``--task language_modeling_admin``: fairseq's language-modeling task that profiles Admin's omega.

The decoder-only counterpart of ``--task translation_admin``: both share the profiling lifecycle of
:class:`fairseq_deepinit.admin.profiling_task.AdminProfilingMixin` (on the first ``train_step`` of
the run, on every rank, one extra forward pass without gradient over the first training batch, cut
to ``--admin-profile-max-tokens``, optionally merged with the rank's next
``--admin-profile-batches - 1`` batches, sets omega from the residual-branch variances summed over
all ranks; Liu et al. 2020, sec. 4.3, the released code's recurrence by default). This module adds
how language-modeling batches are merged. A language model has one stack, so the recurrence runs
once, over its ``2 N`` sub-layers (self-attention, FFN), starting at omega_1 = 1: this project's
decoder-only form of Admin (docs/lm.md). The ``profiled`` flags travel in the checkpoint;
``--admin-profile-only`` / ``--admin-profile-path`` work as under translation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch
from fairseq.tasks import register_task
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

from ..admin.profiling_task import AdminProfilingMixin, rows_within
from ..admin.residual import LM_TASK as TASK_NAME
from ..training.autocast import AutocastConfig, AutocastTaskMixin


def merge_and_cap_lm(net_inputs: List[dict], pad: int, max_tokens: int) -> Tuple[dict, int]:
    """One profiling batch from language-modeling ``net_input`` dicts (right-padded ``src_tokens``).

    Rows are kept in order while ``rows * longest row`` (the padded size ``--max-tokens`` bounds)
    stays within ``max_tokens``; at least one is kept. Returns the batch and the rows dropped.
    """
    width = max(n["src_tokens"].size(1) for n in net_inputs)
    rows = []
    for n in net_inputs:
        tokens = n["src_tokens"]
        if tokens.size(1) < width:
            tokens = torch.cat([tokens, tokens.new_full((tokens.size(0), width - tokens.size(1)), pad)], dim=1)
        rows.append(tokens)
    src = torch.cat(rows)
    lengths = src.ne(pad).sum(1)
    keep, (width,) = rows_within(max_tokens, lengths)
    total = src.size(0)
    src, lengths = src[:keep], lengths[:keep]
    return {"src_tokens": src[:, :width], "src_lengths": lengths}, total - keep


@dataclass
class LanguageModelingAdminConfig(LanguageModelingConfig, AutocastConfig):
    """fairseq's language-modeling options plus ``--autocast-bf16`` (profiling itself runs in fp32)."""


@register_task(TASK_NAME, dataclass=LanguageModelingAdminConfig)
class LanguageModelingAdminTask(AdminProfilingMixin, AutocastTaskMixin, LanguageModelingTask):
    """Language modeling with Admin profiling before the first update (module docstring)."""

    task_name, arch_hint, plain_task, row_word = TASK_NAME, "admin_lm<size>", "language_modeling", "rows"

    def merge_profiling_inputs(self, net_inputs: List[dict], max_tokens: int) -> Tuple[dict, int]:
        return merge_and_cap_lm(net_inputs, self.source_dictionary.pad(), max_tokens)
