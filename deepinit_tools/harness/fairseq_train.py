"""fairseq models built and trained in-process exactly the way ``fairseq-train`` does it.

Parsed arguments -> ``convert_namespace_to_omegaconf`` -> ``task.build_model`` /
``task.build_criterion`` -> fairseq's optimizer (``FP16Optimizer`` for ``--fp16``,
``AMPOptimizer`` for ``--amp``). One step is fairseq's ``Trainer.train_step`` without logging:
zero the gradients, ``task.train_step`` (forward + backward through the criterion),
``multiply_grads``, ``clip_grad_norm``, ``task.optimizer_step``. Used by benchmarks/throughput.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from pathlib import Path
from typing import Any, List

from deepinit_tools import fairseq_argv as fa
from deepinit_tools.paths import USER_DIR

# fp16: fairseq's FP16Optimizer (fp16 weights, fp32 master copy, dynamic loss scale), as --fp16;
# amp: fairseq's --amp; bf16-autocast: the plugin's --task translation_deepinit --autocast-bf16
PRECISIONS = ("fp32", "fp16", "amp", "bf16-autocast")
CUDA_ONLY_PRECISIONS = ("fp16", "amp")  # fairseq has no half-precision training on the CPU


@dataclasses.dataclass(frozen=True)
class Shape:
    """Model dimensions shared by every configuration of one table (identical dims and batch)."""

    layers: int
    dim: int
    ffn: int
    heads: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        """``LAYERSxDIMxFFNxHEADS``, e.g. ``6x256x1024x4``."""
        try:
            layers, dim, ffn, heads = (int(v) for v in text.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"shape {text!r} is not LAYERSxDIMxFFNxHEADS (e.g. 6x256x1024x4)"
            ) from None
        if min(layers, dim, ffn, heads) <= 0 or dim % heads:
            raise argparse.ArgumentTypeError(f"shape {text!r}: all sizes must be positive and heads must divide dim")
        return cls(layers, dim, ffn, heads)

    def __str__(self) -> str:
        return f"{self.layers}x{self.dim}x{self.ffn}x{self.heads}"

    def flags(self) -> List[str]:
        """fairseq-train's dimension flags, both stacks."""
        return fa.dims(self.layers, self.dim, self.ffn, self.heads)


@dataclasses.dataclass(frozen=True)
class Variant:
    """How a model is run: precision, attention implementation (plugin only), torch.compile, optimizer."""

    precision: str = "fp32"
    attention: str = "fairseq"
    compile: bool = False
    optimizer: str = "adam"  # adam_foreach: the plugin's multi-tensor Adam (same update rule)

    def flags(self, plugin: bool) -> List[str]:
        """fairseq-train flags of this variant (``plugin``: the model is the plugin's)."""
        out = fa.precision_flags("bf16" if self.precision == "bf16-autocast" else self.precision)
        if plugin and self.attention != "fairseq":
            out += ["--attention-impl", self.attention]
        if self.optimizer != "adam":
            out += ["--optimizer", self.optimizer]  # a later --optimizer wins in argparse
        return out

    @property
    def label(self) -> str:
        """``fp16``, ``bf16-autocast sdpa compile``..."""
        return " ".join(
            [self.precision, *([self.attention] if self.attention != "fairseq" else [])]
            + (["compile"] if self.compile else [])
            + ([self.optimizer] if self.optimizer != "adam" else [])
        )


def train_argv(
    data: Path, arch: str, flags: tuple, shape: Shape, variant: Variant, plugin: bool, opts: Any
) -> List[str]:
    """fairseq-train arguments (``opts``: max_tokens, seed, device), shared with ``--mode cli``."""
    argv = [
        str(data), "--task", "translation", "-s", "de", "-t", "en", "--arch", arch, *flags, *shape.flags(),
        "--dropout", "0.1", "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        *fa.ADAM, "--lr", "5e-4", "--clip-norm", "0.0",
        "--max-tokens", str(opts.max_tokens), "--seed", str(opts.seed), "--num-workers", "0",
    ]  # fmt: skip
    argv += variant.flags(plugin)  # a later --task wins in argparse
    if plugin or variant.precision == "bf16-autocast" or variant.optimizer != "adam":
        argv += ["--user-dir", USER_DIR]
    if opts.device == "cpu":
        argv.append("--cpu")
    return argv


def fairseq_config(argv: List[str]) -> Any:
    """fairseq-train's parsed configuration (argparse, then omegaconf, as fairseq-train)."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    return convert_namespace_to_omegaconf(args)


class Run:
    """One configuration built the way fairseq-train builds it, ready to take training steps."""

    def __init__(self, fcfg: Any, task: Any, variant: Variant, device: str, seed: int) -> None:
        import torch
        from fairseq import optim

        self.task, self.variant = task, variant
        torch.manual_seed(seed)
        model = task.build_model(fcfg.model)
        self.criterion = task.build_criterion(fcfg.criterion).to(device)
        if variant.precision == "fp16":
            model = model.half()
        self.model = model.to(device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.n_params = sum(p.numel() for p in {id(p): p for p in params}.values())
        if variant.precision == "fp16":
            self.optimizer = optim.FP16Optimizer.build_optimizer(fcfg, params)
        elif variant.precision == "amp":
            self.optimizer = optim.AMPOptimizer.build_optimizer(fcfg, params)
        else:
            self.optimizer = optim.build_optimizer(fcfg.optimizer, params)
        self.describe_info = self.describe()
        if variant.compile:
            # dynamic shapes: every Multi30k batch has its own lengths; one graph serves them all
            self.model = torch.compile(self.model, dynamic=True)
        self.updates = 0
        self.overflows = 0
        self.last_loss = math.nan  # fairseq's logged loss (base 2, per target token) of the last step

    def forward_backward(self, sample: dict) -> tuple:
        """Zeroed gradients, then ``task.train_step`` (forward, loss, backward); ``(sample_size, log)``."""
        self.optimizer.zero_grad()
        _, sample_size, log = self.task.train_step(sample, self.model, self.criterion, self.optimizer, self.updates)
        return sample_size, log

    def update(self, sample_size) -> None:
        """The rest of fairseq's step: gradients over the sample size, (no) clipping, the optimizer step."""
        self.optimizer.multiply_grads(1.0 / (sample_size or 1.0))
        self.optimizer.clip_grad_norm(0.0)
        self.task.optimizer_step(self.optimizer, self.model, self.updates)

    def step(self, sample: dict) -> int:
        """fairseq ``Trainer.train_step`` for one batch, without its logging; returns target tokens."""
        try:
            sample_size, log = self.forward_backward(sample)
            self.update(sample_size)
            self.last_loss = float(log["loss"]) / (sample_size or 1.0) / math.log(2)
        except OverflowError:  # fp16 loss-scale overflow: fairseq skips the update too
            self.overflows += 1
        self.updates += 1
        return int(sample["ntokens"])

    def describe(self) -> dict:
        """What was actually built: model class, norm and residual module classes (for checks)."""
        kinds = {type(m).__name__ for m in self.model.modules()}
        norms = set()
        for stack in (getattr(self.model, "encoder", None), self.model.decoder):  # a language model has no encoder
            for layer in getattr(stack, "layers", ()):
                for attr in ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm"):
                    if getattr(layer, attr, None) is not None:
                        norms.add(type(getattr(layer, attr)).__name__)
        return {
            "model_class": type(self.model).__name__,
            "norm_classes": sorted(norms),
            "residual_classes": sorted(k for k in kinds if k.endswith("Residual")),
            "fixnorm": "FixNormEmbedding" in kinds,
        }


def setup_task(fcfg: Any) -> Any:
    """fairseq's task of a parsed configuration (dictionaries loaded)."""
    from fairseq import tasks

    return tasks.setup_task(fcfg.task)


def fixed_batches(task: Any, max_tokens: int, seed: int, n: int) -> list:
    """The first ``n`` batches of seeded shuffled epochs of the train split (on the CPU).

    Epoch after epoch (each shuffled with its own seed, as fairseq-train does) until ``n`` batches:
    every configuration then trains on exactly the same tokens in the same order.
    """
    task.load_dataset("train")
    epochs = task.get_batch_iterator(
        dataset=task.dataset("train"),
        max_tokens=max_tokens,
        max_positions=task.max_positions(),
        ignore_invalid_inputs=True,
        seed=seed,
    )
    batches: list = []
    while len(batches) < n:
        itr = epochs.next_epoch_itr(shuffle=True)
        got = list(itertools.islice(itr, n - len(batches)))
        if not got:
            raise SystemExit(f"no batches of --max-tokens {max_tokens} in the data")
        batches += got
        if itr.has_next():
            break  # (only when n was reached inside the epoch)
    return batches


def to_device(batches: list, device: str) -> list:
    """The batches on ``device`` (moved once, before timing)."""
    if device != "cuda":
        return batches
    from fairseq import utils

    return [utils.move_to_cuda(b) for b in batches]
