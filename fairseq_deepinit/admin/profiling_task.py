"""The profiling lifecycle that ``--task translation_admin`` and ``--task language_modeling_admin`` share.

Admin (Liu et al. 2020, sec. 4.3) sets omega from the residual-branch variances on the first
training batch. fairseq's trainer hands every batch, on every rank, to ``task.train_step`` before
anything is updated, so the first call is where a profiling task profiles: one extra forward pass
(no gradient) on that batch (optionally merged with the next ``--admin-profile-batches - 1`` training
batches of the rank, and with every other rank's, :mod:`.gather`), cut to ``--admin-profile-max-tokens``,
the same omega set on every rank, logged, and then the ordinary training step. Each residual
module's ``profiled`` buffer is in the checkpoint, so a resumed run, or one whose omega came from
``--admin-profile-path``, does not profile again.

Two-step workflow: ``--admin-profile-only --admin-profile-path P.json`` writes the profile (JSON:
per sub-layer variances and omega) and stops before the first update; a later run with
``--admin-profile-path P.json`` loads it when the model is built (and checks that it fits).

:class:`AdminProfilingMixin` holds all of it; a task supplies only how several batches' ``net_input``
are merged into one profiling batch (:meth:`AdminProfilingMixin.merge_profiling_inputs`) and the
names its messages use.
"""

from __future__ import annotations

import logging
import os
from typing import List, Tuple

import torch
from fairseq import utils

from ..errors import AdminConfigError
from .gather import gather_net_inputs
from .profile_file import apply_profile, check_profile_destination, load_profile, save_profile
from .profiling import data_parallel_group, log_profile, profile_model, refresh_master_params, world_size
from .residual import admin_residuals, is_profiled, omega_parameters, unwrap_model

logger = logging.getLogger(__name__)


def rows_within(max_tokens: int, *lengths: torch.Tensor) -> Tuple[int, List[int]]:
    """How many leading rows keep ``rows * longest row`` (the padded size fairseq's ``--max-tokens``
    bounds) within ``max_tokens`` (at least one), and the longest of each of ``lengths`` over those
    rows; ``lengths``: one length per row for each side (source, target). One read from the device."""
    longest = torch.stack(lengths).amax(0)
    padded = torch.cummax(longest, 0).values * torch.arange(1, longest.size(0) + 1, device=longest.device)
    keep = (padded <= max_tokens).sum().clamp(min=1)  # padded size never decreases with more rows
    last = (keep - 1).view(1)  # an index tensor, not a Python int: no read yet
    widths = [torch.cummax(side, 0).values.index_select(0, last).squeeze(0) for side in lengths]
    values = torch.stack([keep, *widths]).tolist()
    return int(values[0]), [int(w) for w in values[1:]]


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_writing_rank() -> bool:
    """Rank 0 writes the profile (every rank computes the same one)."""
    return not _distributed() or torch.distributed.get_rank() == 0


class AdminProfilingMixin:
    """Admin profiling before the first update, for a fairseq task (see the module docstring).

    Put it first in the bases (``class T(AdminProfilingMixin, AutocastTaskMixin, TranslationTask)``)
    and set :attr:`task_name`, :attr:`arch_hint`, :attr:`plain_task` and :attr:`row_word`.
    """

    task_name = "?"  # --task NAME, for messages
    arch_hint = "admin_<size>"  # an --arch with Admin residuals, for the build-time message
    plain_task = "translation"  # the --task to use without profiling
    row_word = "sentences"  # what one row of a profiling batch is called in the log

    _admin_ready = False
    _iterator_calls: list = []  # (dataset, args, kwargs) of get_batch_iterator, newest last; per instance once set

    def merge_profiling_inputs(self, net_inputs: List[dict], max_tokens: int) -> Tuple[dict, int]:
        """One profiling batch from several ``net_input`` dicts, cut to ``max_tokens``; (batch, rows dropped)."""
        raise NotImplementedError

    def build_model(self, cfg, from_checkpoint: bool = False):
        model = super().build_model(cfg, from_checkpoint)
        # the model's resolved options (fairseq-hydra-train's cfg is the YAML's, unresolved: model_config.py)
        args = getattr(model, "args", None) or cfg
        if not admin_residuals(model):
            raise AdminConfigError(
                f"--task {self.task_name} profiles Admin's omega, but --arch {getattr(args, 'arch', '?')} has none. "
                f"Use --arch {self.arch_hint} (or --init-scheme admin / --residual-scale admin), "
                f"or --task {self.plain_task}."
            )
        path = getattr(args, "admin_profile_path", None)
        if path and args.admin_profile_only and not from_checkpoint and is_writing_rank():
            # a destination that cannot be written fails now, before any data is loaded or profiled
            check_profile_destination(path)
        if path and not args.admin_profile_only and not from_checkpoint:
            profile = load_profile(path)
            apply_profile(model, profile, args.admin_formula, path)
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
            # the twin iterator's DataLoader draws its seed from torch's generator: the profiling pass's dropout
            # and the training after it must see the generator as fairseq left it (as with one batch)
            with torch.random.fork_rng(devices=[]):
                net_inputs += self._following_batches(sample, args.admin_profile_batches - 1)
        group = data_parallel_group()
        per_rank = len(net_inputs)
        net_inputs = gather_net_inputs(net_inputs, group, world_size(group))  # every rank: the same batches
        net_input, dropped = self.merge_profiling_inputs(net_inputs, args.admin_profile_max_tokens)
        if dropped:
            logger.info(
                f"admin: profiling batch cut to {net_input['src_tokens'].size(0)} {self.row_word} "
                f"(--admin-profile-max-tokens {args.admin_profile_max_tokens}; {dropped} dropped)"
            )
        profile = profile_model(model, net_input, args.admin_formula, group=group)
        log_profile(profile, f"profiling {len(net_inputs)} batch(es) ({per_rank} per rank)")
        refresh_master_params(optimizer, omega_parameters(model))
        if args.admin_profile_only:
            self._write_profile_and_stop(profile, args.admin_profile_path)

    def _write_profile_and_stop(self, profile: dict, path: str) -> None:
        if is_writing_rank():
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
                out.append(utils.apply_to_sample(lambda t: t.to(device), batch)["net_input"])
            if len(out) < count:
                logger.warning(f"admin: only {len(out) + 1} training batches on this rank to profile on")
            return out
        raise AdminConfigError(
            "--admin-profile-batches > 1 needs the training iterator that fairseq-train builds; it was not "
            "found. Use --admin-profile-batches 1 (the paper's setting)."
        )
