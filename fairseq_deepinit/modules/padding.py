"""Where a task pads the decoder's input: a build-time property of the model's task.

fairseq's translation task (and its subclasses) pads ``prev_output_tokens`` on the left only under
``--left-pad-target`` (fairseq ``tasks/translation.py:204``, ``data/language_pair_dataset.py:98``);
its language-modeling task always pads on the right (``data/monolingual_dataset.py:25,36``; its
inference datasets too, ``tasks/language_modeling.py:303,308``). With right padding, causal
self-attention never lets a real position see a padded one, so the decoder needs no key padding
mask there, and no host read of the tokens to find out whether there is padding
(:meth:`fairseq_deepinit.decoder.DeepInitDecoder.self_attn_padding_mask`).
"""

from __future__ import annotations

from fairseq.tasks.language_modeling import LanguageModelingTask
from fairseq.tasks.translation import TranslationTask

PADDING_SIDES = ("right", "left", "unknown")


def target_padding(task) -> str:
    """Where ``task`` pads the decoder's input: ``"right"``, ``"left"`` or ``"unknown"`` (any other task)."""
    if isinstance(task, TranslationTask):
        return "left" if getattr(task.cfg, "left_pad_target", False) else "right"
    if isinstance(task, LanguageModelingTask):
        return "right"
    return "unknown"
