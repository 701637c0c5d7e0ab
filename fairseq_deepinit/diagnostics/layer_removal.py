"""The loss with one layer removed, an evaluation-time measurement of ``deepinit-diagnose --measure removal``.

lmsdss/LayerNorm-Scaling @ 3ac54dd and pixeli99/MixLN @ ff45826 ship the same ``layer_remove.py:8-27``:
``del model.model.layers[i]``, renumber only ``self_attn.layer_idx`` (the KV-cache slot), save, and
evaluate the shortened model (lm-evaluation-harness). Every other layer keeps its weights and whatever
its construction fixed (LayerNorm Scaling's ``1/sqrt(l)``, DeepNorm's alpha, Admin's omega): the removed
layer becomes the identity on the residual stream. :func:`removed_layer` does the same to a fairseq
stack for the duration of a block (fairseq's stacks iterate ``self.layers``; its per-layer KV caches are
keyed by module, so nothing is renumbered), and :func:`removal_losses` evaluates the model with each
layer of each stack removed in turn, on the same batches, in eval mode (dropout off), with the
criterion's loss reported as fairseq reports validation: ``loss`` summed and divided by the sample
size, ``nll_loss`` by the number of target tokens, both in base 2 (fairseq's criterions'
``reduce_metrics``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, Iterator, List, Sequence

import torch
import torch.nn as nn


@contextlib.contextmanager
def removed_layer(layers: nn.ModuleList, index: int) -> Iterator[nn.Module]:
    """``layers`` without ``layers[index]`` inside the block (the layer is put back at the end)."""
    if not 0 <= index < len(layers):
        raise IndexError(f"layer {index} of a stack of {len(layers)}")
    layer = layers[index]
    del layers[index]
    try:
        yield layer
    finally:
        layers.insert(index, layer)


def evaluate(model: nn.Module, criterion, batches: Sequence[dict]) -> Dict[str, float]:
    """``{"loss", "nll_loss"}`` of ``model`` on ``batches`` as fairseq's validation computes them (base 2)."""
    loss_sum = torch.zeros((), dtype=torch.float64)
    nll_sum = torch.zeros((), dtype=torch.float64)
    sample_size = ntokens = 0.0
    has_nll = True
    model.eval()
    with torch.no_grad():
        for batch in batches:
            _, size, log = criterion(model, batch)
            loss_sum = loss_sum + torch.as_tensor(log["loss"], dtype=torch.float64).cpu()
            if "nll_loss" in log:
                nll_sum = nll_sum + torch.as_tensor(log["nll_loss"], dtype=torch.float64).cpu()
            else:
                has_nll = False
            sample_size += float(size)
            ntokens += float(log.get("ntokens", size))
    loss = loss_sum.item() / max(sample_size, 1.0) / math.log(2)
    # fairseq's cross_entropy logs no nll_loss: its loss is the NLL per token already
    nll = nll_sum.item() / max(ntokens, 1.0) / math.log(2) if has_nll else loss
    return {"loss": loss, "nll_loss": nll}


def stacks(model: nn.Module) -> List[str]:
    """The model's stacks with layers, in forward order (``encoder``, ``decoder``; a language model: ``decoder``)."""
    return [s for s in ("encoder", "decoder") if getattr(getattr(model, s, None), "layers", None) is not None]


def removal_losses(model: nn.Module, criterion, batches: Sequence[dict]) -> dict:
    """The full model's loss and, per stack, the loss with each layer removed (layer 1 first).

    ``{"full": {"loss", "nll_loss"}, "encoder": [{"loss", "nll_loss"}, ...], "decoder": [...]}``.
    """
    was_training = model.training
    out: dict = {"full": evaluate(model, criterion, batches)}
    for stack in stacks(model):
        layers = getattr(model, stack).layers
        out[stack] = []
        for i in range(len(layers)):
            with removed_layer(layers, i):
                out[stack].append(evaluate(model, criterion, batches))
    model.train(was_training)
    return out
