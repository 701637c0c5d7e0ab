"""``--task translation_admin``: fairseq's translation task that profiles Admin's omega in training.

The lifecycle (profiling on the first ``train_step`` of every rank, ``--admin-profile-only`` /
``--admin-profile-path``, resumed runs) is :class:`.profiling_task.AdminProfilingMixin`'s; this
module adds how the batches of a translation task are merged into one profiling batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from ..training.autocast import AutocastConfig, AutocastTaskMixin
from .profiling_task import AdminProfilingMixin, rows_within
from .residual import TRANSLATION_TASK as TASK_NAME


def _pad_to(tokens: torch.Tensor, width: int, pad: int, left: bool) -> torch.Tensor:
    if tokens.size(1) == width:
        return tokens
    fill = tokens.new_full((tokens.size(0), width - tokens.size(1)), pad)
    return torch.cat([fill, tokens] if left else [tokens, fill], dim=1)


def _trim(tokens: torch.Tensor, width: int, left: bool) -> torch.Tensor:
    return tokens[:, tokens.size(1) - width :] if left else tokens[:, :width]


def merge_and_cap(
    net_inputs: List[dict], pad: int, left_pad_source: bool, left_pad_target: bool, max_tokens: int
) -> Tuple[dict, int]:
    """One profiling batch from several ``net_input`` dicts: concatenated, then cut to ``max_tokens``.

    Sentences are kept in order while ``rows * max(source length, target length)`` (the padded size
    fairseq's ``--max-tokens`` bounds) stays within ``max_tokens``; at least one is always kept.
    Returns the batch (padding trimmed to the kept sentences) and the number of sentences dropped.
    """
    src_w = max(n["src_tokens"].size(1) for n in net_inputs)
    tgt_w = max(n["prev_output_tokens"].size(1) for n in net_inputs)
    src = torch.cat([_pad_to(n["src_tokens"], src_w, pad, left_pad_source) for n in net_inputs])
    prev = torch.cat([_pad_to(n["prev_output_tokens"], tgt_w, pad, left_pad_target) for n in net_inputs])
    src_len = src.ne(pad).sum(1)
    tgt_len = prev.ne(pad).sum(1)
    keep, (src_w, tgt_w) = rows_within(max_tokens, src_len, tgt_len)
    total = src.size(0)
    src, prev, src_len = src[:keep], prev[:keep], src_len[:keep]
    src = _trim(src, src_w, left_pad_source)
    prev = _trim(prev, tgt_w, left_pad_target)
    return {"src_tokens": src, "src_lengths": src_len, "prev_output_tokens": prev}, total - keep


@dataclass
class TranslationAdminConfig(TranslationConfig, AutocastConfig):
    """fairseq's translation options plus ``--autocast-bf16`` (profiling itself always runs in fp32)."""


@register_task(TASK_NAME, dataclass=TranslationAdminConfig)
class TranslationAdminTask(AdminProfilingMixin, AutocastTaskMixin, TranslationTask):
    """Translation with Admin profiling before the first update (:mod:`.profiling_task`)."""

    task_name, arch_hint, plain_task, row_word = TASK_NAME, "admin_<size>", "translation", "sentences"

    def merge_profiling_inputs(self, net_inputs: List[dict], max_tokens: int) -> Tuple[dict, int]:
        pad = self.source_dictionary.pad()
        return merge_and_cap(net_inputs, pad, self.cfg.left_pad_source, self.cfg.left_pad_target, max_tokens)
