"""What ``deepinit-diagnose`` measures, and on what: the model, task, criterion and batches built as
fairseq-train builds them (:class:`Setup`), gradients and norm inputs from one pooled backward pass
(:func:`measure_gradients`), and the output change against depth (:func:`measure_output_change`).
The command itself (options, output files, plots, comparison) is :mod:`.diagnose`.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
from typing import Dict, List, Sequence

import numpy as np
import torch

from .. import admin, errors, options
from ..checkpoints.integrity import inspect_checkpoint
from ..errors import DeepInitConfigError
from . import plots
from .hooks import NormInputStatistics
from .stats import GradientFlow, fit_growth, grad_norms_per_layer, output_change, per_type_means, stack_layers

logger = logging.getLogger(__name__)


def parse_depths(spec: str) -> List[int]:
    try:
        depths = sorted({int(d) for d in spec.split(",") if d.strip()})
    except ValueError:
        raise DeepInitConfigError(f"--depths must be comma-separated integers, got {spec!r}") from None
    if len(depths) < 2 or depths[0] < 1:
        raise DeepInitConfigError(f"--depths needs at least two different depths >= 1 to fit a slope, got {spec!r}")
    return depths


def _splits(data: str) -> List[str]:
    """The binarised splits in a fairseq-preprocess folder (``train``, ``valid``, ...)."""
    return sorted({f.split(".", 1)[0] for f in os.listdir(data) if f.endswith(".idx")})


# --------------------------------------------------------------------------------------------
# set-up: fairseq task, model, criterion, batches
# --------------------------------------------------------------------------------------------


class Setup:
    """Everything a measurement needs, built the way fairseq-train builds it."""

    def __init__(self, opts: argparse.Namespace, fairseq_argv: List[str]) -> None:
        from fairseq import checkpoint_utils, options, tasks
        from fairseq.dataclass.utils import convert_namespace_to_omegaconf

        if not opts.data or not os.path.isdir(opts.data):
            raise DeepInitConfigError(f"data folder {opts.data!r} not found (give the output of fairseq-preprocess)")
        self.opts = opts
        if opts.checkpoint:
            if os.path.isdir(opts.checkpoint):
                inside = os.path.join(opts.checkpoint, "checkpoint_best.pt")
                raise DeepInitConfigError(
                    f"--checkpoint {opts.checkpoint} is a folder: give a checkpoint file in it ({inside}, ...)"
                )
            if not os.path.isfile(opts.checkpoint):
                raise DeepInitConfigError(f"--checkpoint {opts.checkpoint} does not exist")
            if [a for a in fairseq_argv if a.startswith("--")]:
                raise DeepInitConfigError(
                    "with --checkpoint the model comes from the checkpoint; drop the model "
                    f"options {' '.join(a for a in fairseq_argv if a.startswith('--'))}"
                )
            try:
                models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
                    [opts.checkpoint], arg_overrides={"data": opts.data}
                )
            except FileNotFoundError as e:  # the checkpoint's task reads files this data folder does not have
                trained = getattr(inspect_checkpoint(opts.checkpoint).model_args, "task", None) or "its task"
                raise DeepInitConfigError(
                    f"--checkpoint {opts.checkpoint} was trained with --task {trained}, which cannot read {opts.data} "
                    f"({errors.one_line(e)}); give the data folder the checkpoint was trained on"
                ) from None
            self.args = cfg.model
            self.model = models[0]
            self.task = task
            self.criterion = task.build_criterion(cfg.criterion)
        else:
            parser = options.get_training_parser()
            argv = [opts.data, *fairseq_argv, "--max-tokens", str(opts.max_tokens), "--seed", str(opts.seed)]
            self.args = options.parse_args_and_arch(parser, argv)
            cfg = convert_namespace_to_omegaconf(self.args)
            self.task = tasks.setup_task(cfg.task)
            self.criterion = self.task.build_criterion(cfg.criterion)
            self.model = None
        try:
            self.task.load_dataset(opts.subset, combine=False, epoch=1)
        except FileNotFoundError as e:  # fairseq's tasks: "Dataset not found: <split> (<folder>)"
            raise DeepInitConfigError(
                f"--subset {opts.subset}: no such split in {opts.data} ({errors.one_line(e)}); the splits there: "
                f"{', '.join(_splits(opts.data)) or 'none'}"
            ) from e
        self.batches = self._batches(max(opts.num_batches, opts.change_batches))
        if self.model is None:
            self.model = self.build(None, opts.seed)

    def _batches(self, count: int) -> List[dict]:
        from fairseq import utils

        dataset = self.task.dataset(self.opts.subset)
        itr = self.task.get_batch_iterator(
            dataset=dataset,
            max_tokens=self.opts.max_tokens,
            # as fairseq-train (Trainer.get_train_iterator): no sentence longer than --max-tokens
            max_positions=utils.resolve_max_positions(self.task.max_positions(), (1024, 1024), self.opts.max_tokens),
            ignore_invalid_inputs=True,
            seed=self.opts.seed,
            num_workers=0,
        ).next_epoch_itr(shuffle=True)
        batches = []
        for sample in itr:
            if sample and "net_input" in sample:
                batches.append(sample)
            if len(batches) == count:
                break
        if not batches:
            # a sentence pair is kept when both sides fit (translation: sizes has a column per side)
            sizes = np.asarray(dataset.sizes)
            shortest = int((sizes.max(axis=1) if sizes.ndim == 2 else sizes).min()) if len(dataset) else None
            why = (
                f"the shortest of its {len(dataset)} sentences has {shortest} tokens, more than --max-tokens "
                f"{self.opts.max_tokens}; raise --max-tokens"
                if shortest is not None and shortest > self.opts.max_tokens
                else "every sentence is skipped; raise --max-tokens or give another --subset"
            )
            raise DeepInitConfigError(f"no batch in subset {self.opts.subset!r} of {self.opts.data}: {why}")
        return batches

    def build(self, layers: int | None, seed: int):
        """A freshly initialised model (``layers`` per stack if given), Admin omega profiled when needed."""
        args = copy.deepcopy(self.args)
        if layers is not None:
            args.decoder_layers = layers
            if not self.decoder_only:
                args.encoder_layers = layers
        torch.manual_seed(seed)
        model = self.task.build_model(args)
        _profile_admin(model, args, self.batches[0])
        return model

    @property
    def decoder_only(self) -> bool:
        """A language model (one stack, the decoder), from the architecture or the built model."""
        from fairseq.models import ARCH_MODEL_REGISTRY, FairseqLanguageModel

        if getattr(self, "model", None) is not None:
            return isinstance(self.model, FairseqLanguageModel)
        model_cls = ARCH_MODEL_REGISTRY.get(getattr(self.args, "arch", None))
        return model_cls is not None and issubclass(model_cls, FairseqLanguageModel)

    def loss(self, model, batch: dict, total_sample_size: float) -> torch.Tensor:
        loss, _, _ = self.criterion(model, batch)
        return loss / total_sample_size

    def sample_size(self, batches: Sequence[dict]) -> float:
        key = "target" if getattr(self.criterion, "sentence_avg", False) else "ntokens"
        return float(sum(b[key].size(0) if key == "target" else b[key] for b in batches))

    def describe(self) -> str:
        try:
            return options.describe(self.args).replace("deepinit: ", "")
        except AttributeError:
            return str(getattr(self.args, "arch", "model"))


def _profile_admin(model, args, batch: dict) -> None:
    """Admin's omega is set from a profiling forward pass before training (Liu et al. 2020, sec. 4.3);
    measure the model as fairseq-train would train it, so profile it here as ``--task translation_admin`` does."""
    if admin.admin_residuals(model) and not admin.is_profiled(model):
        model.train()
        admin.profile_model(model, batch["net_input"], getattr(args, "admin_formula", "code"))


# --------------------------------------------------------------------------------------------
# measurements
# --------------------------------------------------------------------------------------------


def measure_gradients(setup: Setup, measures: Sequence[str]) -> dict:
    """Gradient norm per layer, gradient flow and norm-input statistics from one pooled backward pass."""

    model = setup.model
    batches = setup.batches[: setup.opts.num_batches]
    total = setup.sample_size(batches)
    model.train()
    model.zero_grad()
    flow = GradientFlow(model) if "flow" in measures else None
    norms = NormInputStatistics(model) if "norm" in measures else None
    torch.manual_seed(setup.opts.seed)
    loss_sum = 0.0
    for s in (flow, norms):
        if s is not None:
            s.attach()
    try:
        for batch in batches:
            loss = setup.loss(model, batch, total)
            loss.backward()
            loss_sum += loss.item()
    finally:
        for s in (flow, norms):
            if s is not None:
                s.detach()
    out: dict = {"loss_per_token": loss_sum}
    if "grad" in measures:
        per_layer = grad_norms_per_layer(model)
        out["grad_norm"] = {
            "per_layer": per_layer,
            "encoder": stack_layers(per_layer, "encoder"),
            "decoder": stack_layers(per_layer, "decoder"),
        }
    if flow is not None:
        per_sub = flow.results()
        out["gradient_flow"] = {"per_sublayer": per_sub, "per_type": per_type_means(per_sub, plots.FLOW_KEYS)}
    if norms is not None:
        out["norm_input"] = norms.statistics()
    model.zero_grad()
    return out


def measure_output_change(setup: Setup) -> dict:
    """Admin Fig. 4: output change against depth, averaged over ``--repeats`` initialisations, with fits."""

    opts = setup.opts
    depths = parse_depths(opts.depths)
    batches = setup.batches[: opts.change_batches]
    total = setup.sample_size(batches)
    pad = setup.task.source_dictionary.pad()
    result: dict = {"depths": depths, "repeats": opts.repeats, "positions": "non-padding target/source positions"}
    stacks = ("decoder",) if setup.decoder_only else ("encoder", "decoder")
    for kind, scale in (("random", opts.perturb_scale), ("adam", opts.adam_lr)):
        curves: Dict[str, List[float]] = {k: [] for k in stacks}
        for n in depths:
            acc = dict.fromkeys(stacks, 0.0)
            for r in range(opts.repeats):
                model = setup.build(n, opts.seed + r)
                change = output_change(
                    model,
                    batches,
                    kind,
                    scale,
                    seed=1000 + r,
                    loss_fn=lambda m, b: setup.loss(m, b, total),
                    pad=pad,
                )
                for k in acc:
                    acc[k] += change[k] / opts.repeats
            for k in acc:
                curves[k].append(acc[k])
            logger.info(f"output change ({kind}) N={n}: " + ", ".join(f"{k} {v:.4g}" for k, v in acc.items()))
        result[kind] = {
            "scale": scale,
            **curves,
            "fit": {k: fit_growth(depths, v) for k, v in curves.items()},
        }
    return result
