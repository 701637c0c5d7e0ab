"""``--task language_modeling_admin``: fairseq's language-modeling task that profiles Admin's omega.

The decoder-only counterpart of ``--task translation_admin`` (:mod:`fairseq_deepinit.admin.task`,
whose docstring describes the workflow): on the first ``train_step`` of the run, on every rank, one
extra forward pass (no gradient) over the first training batch, cut to ``--admin-profile-max-tokens``
(optionally merged with the rank's next ``--admin-profile-batches - 1`` batches), sets omega from the
residual-branch variances summed over all ranks (Liu et al. 2020, sec. 4.3; the released code's
recurrence by default, :func:`fairseq_deepinit.admin.profile_model`). A language model has one
stack, so the recurrence runs once, over its ``2 N`` sub-layers (self-attention, FFN), starting at
omega_1 = 1: this project's decoder-only form of Admin (docs/lm.md). The ``profiled`` flags travel in
the checkpoint; ``--admin-profile-only`` / ``--admin-profile-path`` work as under translation.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import List, Tuple

import torch
from fairseq import utils
from fairseq.tasks import register_task
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

from ..admin import (
    PROFILING_TASKS,
    admin_residuals,
    apply_profile,
    check_profile_destination,
    is_profiled,
    load_profile,
    log_profile,
    omega_parameters,
    profile_model,
    refresh_master_params,
    save_profile,
    unwrap_model,
)
from ..errors import AdminConfigError
from ..training.autocast import AutocastConfig, AutocastTaskMixin

logger = logging.getLogger(__name__)

TASK_NAME = "language_modeling_admin"
PROFILING_TASKS.add(TASK_NAME)


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
    padded = torch.cummax(lengths, 0).values * torch.arange(1, src.size(0) + 1, device=src.device)
    keep = max(1, int((padded <= max_tokens).sum()))
    total = src.size(0)
    src, lengths = src[:keep], lengths[:keep]
    return {"src_tokens": src[:, : int(lengths.max())], "src_lengths": lengths}, total - keep


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _is_writing_rank() -> bool:
    return not _distributed() or torch.distributed.get_rank() == 0


@dataclass
class LanguageModelingAdminConfig(LanguageModelingConfig, AutocastConfig):
    """fairseq's language-modeling options plus ``--autocast-bf16`` (profiling itself runs in fp32)."""


@register_task(TASK_NAME, dataclass=LanguageModelingAdminConfig)
class LanguageModelingAdminTask(AutocastTaskMixin, LanguageModelingTask):
    """Language modeling with Admin profiling before the first update (module docstring)."""

    def __init__(self, args, dictionary, output_dictionary=None, targets=None) -> None:
        super().__init__(args, dictionary, output_dictionary, targets)
        self._admin_ready = False
        self._iterator_calls: list = []

    def build_model(self, cfg, from_checkpoint: bool = False):
        model = super().build_model(cfg, from_checkpoint)
        if not admin_residuals(model):
            raise AdminConfigError(
                f"--task {TASK_NAME} profiles Admin's omega, but --arch {getattr(cfg, 'arch', '?')} has none. Use "
                "--arch admin_lm<size> (or --init-scheme admin / --residual-scale admin), or --task language_modeling."
            )
        path = getattr(cfg, "admin_profile_path", None)
        if path and cfg.admin_profile_only and not from_checkpoint and _is_writing_rank():
            check_profile_destination(path)
        if path and not cfg.admin_profile_only and not from_checkpoint:
            profile = load_profile(path)
            apply_profile(model, profile, cfg.admin_formula, path)
            log_profile(profile, f"profile {path} (a checkpoint, if resumed from, overrides it)")
        return model

    def begin_epoch(self, epoch: int, model) -> None:
        """After any checkpoint is loaded: a profile-only run over a profiled checkpoint stops here."""
        super().begin_epoch(epoch, model)
        if not self._admin_ready:
            self._refuse_profile_only_after_resume(unwrap_model(model))

    def _refuse_profile_only_after_resume(self, inner) -> None:
        if is_profiled(inner) and inner.args.admin_profile_only:
            raise AdminConfigError(
                "--admin-profile-only: this run resumed from a checkpoint whose omega is already set, so there is "
                "nothing to profile. Use an empty --save-dir for the profiling run."
            )

    def get_batch_iterator(self, dataset, *args, **kwargs):
        self._iterator_calls = (self._iterator_calls + [(dataset, args, kwargs)])[-4:]
        return super().get_batch_iterator(dataset, *args, **kwargs)

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False, **kwargs):
        if not self._admin_ready:
            inner = unwrap_model(model)
            if is_profiled(inner):
                self._refuse_profile_only_after_resume(inner)
                logger.info("admin: omega already set (checkpoint or --admin-profile-path); not profiling")
            else:
                self._profile(sample, inner, optimizer)
            self._admin_ready = True
        return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad=ignore_grad, **kwargs)

    def _profile(self, sample: dict, model, optimizer) -> None:
        args = model.args
        net_inputs = [sample["net_input"]]
        if args.admin_profile_batches > 1:
            net_inputs += self._following_batches(sample, args.admin_profile_batches - 1)
        net_input, dropped = merge_and_cap_lm(net_inputs, self.source_dictionary.pad(), args.admin_profile_max_tokens)
        if dropped:
            logger.info(
                f"admin: profiling batch cut to {net_input['src_tokens'].size(0)} rows "
                f"(--admin-profile-max-tokens {args.admin_profile_max_tokens}; {dropped} dropped)"
            )
        profile = profile_model(model, net_input, args.admin_formula)
        log_profile(profile, f"profiling {len(net_inputs)} batch(es) per rank")
        refresh_master_params(optimizer, omega_parameters(model))
        if args.admin_profile_only:
            if _is_writing_rank():
                if os.path.exists(args.admin_profile_path):
                    logger.info(f"admin: replacing the existing profile {args.admin_profile_path}")
                save_profile(profile, args.admin_profile_path)
            if _distributed():
                torch.distributed.barrier()
            logger.info(f"admin: profile written to {args.admin_profile_path}; --admin-profile-only: stopping")
            raise SystemExit(0)

    def _following_batches(self, sample: dict, count: int) -> List[dict]:
        """The ``count`` batches this rank sees after ``sample``, from a twin of its training iterator."""
        first_ids = sample["id"].cpu()
        device = sample["net_input"]["src_tokens"].device
        for dataset, args, kwargs in reversed(self._iterator_calls):
            twin = super().get_batch_iterator(
                dataset, *args, **{**kwargs, "disable_iterator_cache": True, "num_workers": 0}
            )
            itr = twin.next_epoch_itr(shuffle=True, set_dataset_epoch=False)
            first = next(itr, None)
            if first is None or not torch.equal(first["id"].cpu(), first_ids):
                continue
            out = []
            for batch in itr:
                if len(out) == count:
                    break
                out.append(utils.apply_to_sample(lambda t: t.to(device), batch)["net_input"])
            if len(out) < count:
                logger.warning(f"admin: only {len(out) + 1} training batches on this rank to profile on")
            return out
        raise AdminConfigError(
            "--admin-profile-batches > 1 needs the training iterator that fairseq-train builds; it was not found. "
            "Use --admin-profile-batches 1 (the paper's setting)."
        )
