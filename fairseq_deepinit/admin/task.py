"""``--task translation_admin``: fairseq's translation task that profiles Admin's omega in training.

Admin (Liu et al. 2020, sec. 4.3) sets omega from the residual-branch variances on the first
training batch. fairseq's trainer hands every batch, on every rank, to ``task.train_step`` before
anything is updated, so the first call is where this task profiles: it runs one extra forward pass
(no gradient) on that batch, cut to ``--admin-profile-max-tokens`` (optionally merged with the next
``--admin-profile-batches - 1`` training batches of the rank), sets omega on every rank from the
statistics summed over all ranks, logs it, and then does the ordinary training step. Each residual
module's ``profiled`` buffer is in the checkpoint, so a resumed run, or one whose omega came from
``--admin-profile-path``, does not profile again.

Two-step workflow: ``--admin-profile-only --admin-profile-path P.json`` writes the profile (JSON:
per sub-layer variances and omega) and stops before the first update; a later run with
``--admin-profile-path P.json`` loads it when the model is built (and checks that it fits).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import List, Tuple

import torch
from fairseq import utils
from fairseq.tasks import register_task
from fairseq.tasks.translation import TranslationConfig, TranslationTask

from ..errors import AdminConfigError
from ..training.autocast import AutocastConfig, AutocastTaskMixin
from .profile_file import apply_profile, check_profile_destination, load_profile, save_profile
from .profiling import log_profile, profile_model, refresh_master_params
from .residual import PROFILING_TASKS, admin_residuals, is_profiled, omega_parameters, unwrap_model

logger = logging.getLogger(__name__)

TASK_NAME = "translation_admin"
PROFILING_TASKS.add(TASK_NAME)


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
    longest = torch.maximum(torch.cummax(src_len, 0).values, torch.cummax(tgt_len, 0).values)
    padded = longest * torch.arange(1, src.size(0) + 1, device=src.device)
    keep = max(1, int((padded <= max_tokens).sum()))  # padded size never decreases with more rows
    total = src.size(0)
    src, prev, src_len, tgt_len = src[:keep], prev[:keep], src_len[:keep], tgt_len[:keep]
    src = _trim(src, int(src_len.max()), left_pad_source)
    prev = _trim(prev, int(tgt_len.max()), left_pad_target)
    return {"src_tokens": src, "src_lengths": src_len, "prev_output_tokens": prev}, total - keep


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _is_writing_rank() -> bool:
    """Rank 0 writes the profile (every rank computes the same one)."""
    return not _distributed() or torch.distributed.get_rank() == 0


@dataclass
class TranslationAdminConfig(TranslationConfig, AutocastConfig):
    """fairseq's translation options plus ``--autocast-bf16`` (profiling itself always runs in fp32)."""


@register_task(TASK_NAME, dataclass=TranslationAdminConfig)
class TranslationAdminTask(AutocastTaskMixin, TranslationTask):
    """Translation with Admin profiling before the first update (see the module docstring)."""

    def __init__(self, cfg, src_dict, tgt_dict) -> None:
        super().__init__(cfg, src_dict, tgt_dict)
        self._admin_ready = False
        self._iterator_calls: list = []  # (dataset, args, kwargs) of get_batch_iterator, newest last

    def build_model(self, cfg, from_checkpoint: bool = False):
        model = super().build_model(cfg, from_checkpoint)
        if not admin_residuals(model):
            raise AdminConfigError(
                f"--task {TASK_NAME} profiles Admin's omega, but --arch {getattr(cfg, 'arch', '?')} has none. Use "
                f"--arch admin_<size> (or --init-scheme admin / --residual-scale admin), or --task translation."
            )
        path = getattr(cfg, "admin_profile_path", None)
        if path and cfg.admin_profile_only and not from_checkpoint and _is_writing_rank():
            # a destination that cannot be written fails now, before any data is loaded or profiled
            check_profile_destination(path)
        if path and not cfg.admin_profile_only and not from_checkpoint:
            profile = load_profile(path)
            apply_profile(model, profile, cfg.admin_formula, path)
            log_profile(profile, f"profile {path} (a checkpoint, if resumed from, overrides it)")
        return model

    def begin_epoch(self, epoch: int, model) -> None:
        """fairseq's trainer calls this after loading any checkpoint, before the first training batch.

        The earliest point where a resumed model's omega is known: a profile-only run into a save
        dir whose checkpoint is already profiled stops here, before fairseq's training step (whose
        error path would also write a ``crash.pt`` into that save dir).
        """
        super().begin_epoch(epoch, model)
        if not self._admin_ready:
            self._refuse_profile_only_after_resume(unwrap_model(model))

    def _refuse_profile_only_after_resume(self, inner) -> None:
        if is_profiled(inner) and inner.args.admin_profile_only:
            raise AdminConfigError(
                "--admin-profile-only: this run resumed from a checkpoint whose omega is already set, so "
                "there is nothing to profile. Use an empty --save-dir (or --restore-file of a file that "
                "does not exist) for the profiling run."
            )

    def get_batch_iterator(self, dataset, *args, **kwargs):
        self._iterator_calls = (self._iterator_calls + [(dataset, args, kwargs)])[-4:]
        return super().get_batch_iterator(dataset, *args, **kwargs)

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False, **kwargs):
        if not self._admin_ready:
            inner = unwrap_model(model)
            if is_profiled(inner):
                self._refuse_profile_only_after_resume(inner)  # normally already done by begin_epoch
                logger.info("admin: omega already set (checkpoint or --admin-profile-path); not profiling")
            else:
                self._profile(sample, inner, optimizer)
            self._admin_ready = True
        return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad=ignore_grad, **kwargs)

    # ------------------------------------------------------------------------------------------

    def _profile(self, sample: dict, model, optimizer) -> None:
        args = model.args
        net_inputs = [sample["net_input"]]
        if args.admin_profile_batches > 1:
            net_inputs += self._following_batches(sample, args.admin_profile_batches - 1)
        net_input, dropped = merge_and_cap(
            net_inputs,
            self.source_dictionary.pad(),
            self.cfg.left_pad_source,
            self.cfg.left_pad_target,
            args.admin_profile_max_tokens,
        )
        if dropped:
            logger.info(
                f"admin: profiling batch cut to {net_input['src_tokens'].size(0)} sentences "
                f"(--admin-profile-max-tokens {args.admin_profile_max_tokens}; {dropped} dropped)"
            )
        profile = profile_model(model, net_input, args.admin_formula)
        log_profile(profile, f"profiling {len(net_inputs)} batch(es) per rank")
        refresh_master_params(optimizer, omega_parameters(model))
        if args.admin_profile_only:
            self._write_profile_and_stop(profile, args.admin_profile_path)

    def _write_profile_and_stop(self, profile: dict, path: str) -> None:
        if _is_writing_rank():
            if os.path.exists(path):
                logger.info(f"admin: replacing the existing profile {path}")
            save_profile(profile, path)
        if _distributed():
            torch.distributed.barrier()
        logger.info(f"admin: profile written to {path}; --admin-profile-only: stopping before the first update")
        # a clean stop on every rank (status 0); SystemExit is not caught by fairseq's crash handler, and
        # fairseq's prefetching thread is stopped at exit by errors.stop_batch_prefetching (atexit)
        raise SystemExit(0)

    def _following_batches(self, sample: dict, count: int) -> List[dict]:
        """The ``count`` training batches this rank sees after ``sample``, from a twin of its iterator.

        fairseq builds the epoch iterator through ``get_batch_iterator``; an identical one (same
        dataset, seed, epoch, shard; no cache) yields the same batches. The twin whose first batch is
        ``sample`` (same example ids) is the training one.
        """
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
                batch = utils.apply_to_sample(lambda t: t.to(device), batch)
                out.append(batch["net_input"])
            if len(out) < count:
                logger.warning(f"admin: only {len(out) + 1} training batches on this rank to profile on")
            return out
        raise AdminConfigError(
            "--admin-profile-batches > 1 needs the training iterator that fairseq-train builds; it was not "
            "found. Use --admin-profile-batches 1 (the paper's setting)."
        )
