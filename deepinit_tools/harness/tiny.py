"""A tiny model (Pre-LN unless told) in a fairseq ``Trainer``, and random batches for it: what the optimizer tests,
``benchmarks/optimizer_kernels.py`` and gpu_smoke.py's training rows step (translation 2+2 layers or a 6-layer
language model, d 64)."""

from __future__ import annotations

from typing import Callable, List

import torch
from fairseq import options, tasks
from fairseq.data import Dictionary
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.trainer import Trainer
from torch import nn

import fairseq_deepinit  # noqa: F401  (registers the plugin's architectures, tasks and optimizers)

# d=64, FFN 128, 2 heads, 2+2 layers
TINY_DIMS: List[str] = [
    "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
    "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--encoder-layers", "2", "--decoder-layers", "2",
]  # fmt: skip


def make_dictionary(n_symbols: int = 50) -> Dictionary:
    """A fairseq dictionary of ``n_symbols`` words ``w0 ...`` after the four specials."""
    d = Dictionary()
    for i in range(n_symbols):
        d.add_symbol(f"w{i}")
    d.finalize(padding_factor=8)
    return d


def tiny_batch(n_symbols: int = 50, bsz: int = 3, src_len: int = 7, tgt_len: int = 6, seed: int = 0) -> dict:
    """A random ``net_input`` of a translation model over :func:`make_dictionary` (no padding)."""
    g = torch.Generator().manual_seed(seed)
    lo = 4  # after bos, pad, eos, unk
    src = torch.randint(lo, lo + n_symbols, (bsz, src_len), generator=g)
    prev = torch.randint(lo, lo + n_symbols, (bsz, tgt_len), generator=g)
    return {"src_tokens": src, "src_lengths": torch.full((bsz,), src_len), "prev_output_tokens": prev}


def tiny_sample(kind: str, seed: int = 0) -> dict:
    """A fairseq training sample of :func:`tiny_batch` for ``kind`` (``mt`` or ``lm``): the targets are the
    inputs shifted by one."""
    net = tiny_batch(seed=seed)
    if kind == "lm":
        net = {"src_tokens": net["prev_output_tokens"], "src_lengths": torch.full((3,), 6)}
    target = torch.roll(net.get("prev_output_tokens", net["src_tokens"]), -1, 1)
    return {"net_input": net, "target": target, "ntokens": target.numel(), "nsentences": 3, "id": torch.arange(3)}


def tiny_trainer(kind: str, *cli: str, family: str = "preln", cpu: bool = True,
                 before: Callable[[nn.Module], None] | None = None) -> Trainer:  # fmt: skip
    """A fairseq ``Trainer`` for a tiny model of ``family`` (``kind`` ``mt``: translation 2+2 layers, ``lm``: a
    6-layer language model; no dropout, lr 1e-2, label-smoothed cross-entropy) with the options ``cli``
    (``--optimizer`` among them; a ``--task`` there replaces the kind's); on the CPU, or where fairseq puts it
    (CUDA when visible) with ``cpu=False``; ``before(model)`` runs on the built model before the trainer takes it."""
    if kind == "mt":
        argv = ["--task", "translation", "--arch", f"{family}_iwslt_de_en", "-s", "src", "-t", "tgt", *TINY_DIMS]
    else:
        argv = ["--task", "language_modeling", "--arch", f"{family}_lm_tiny"]
    args = options.parse_args_and_arch(options.get_training_parser(), ["/nonexistent", *argv, "--dropout", "0",
        "--attention-dropout", "0", "--lr", "1e-2", *(["--cpu"] if cpu else []), "--seed", "1",
        "--criterion", "label_smoothed_cross_entropy", *cli])  # fmt: skip
    d = make_dictionary(50)
    task = tasks.TASK_REGISTRY[args.task](args, d, d)
    torch.manual_seed(1)
    model = task.build_model(args)
    if before is not None:
        before(model)
    return Trainer(convert_namespace_to_omegaconf(args), task, model, task.build_criterion(args))
