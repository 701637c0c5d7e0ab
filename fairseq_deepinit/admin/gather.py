"""Every rank's profiling batches on every rank, in the order one process would have read them.

Admin's statistics count padding positions, as the released code's do (``code`` and ``paper`` alike),
and each rank pads its batch to its own longest sentence. Summing each rank's moments therefore gave
an omega that depended on how the batches were split over the ranks: two ranks with one batch each
set 1.54 where one process profiling the same two batches (``--admin-profile-batches 2``) set 1.28
(``encoder.layers.0.ffn``, 2+2 layers, d=16, the tests' synthetic corpus). :func:`gather_net_inputs`
hands every rank all ranks' batches (their tokens, re-padded as one batch by the task's merge, then cut
to ``--admin-profile-max-tokens``), so every rank profiles the batch that one process reading the same
batches profiles: the released single-process profile is the one-rank case, and W ranks with K batches
each give the profile of one process with ``--admin-profile-batches`` W*K, bit for bit.

fairseq shards an epoch's batches round-robin (``ShardedIterator``: rank r reads batches r, r+W, r+2W,
...), so one process reading batches 0, 1, 2, ... sees rank 0's first, rank 1's first, ..., rank 0's
second: the gathered list is interleaved in that order. Tensors of different shapes travel padded to
the largest shape and are cut back; a rank with fewer batches (its shard ran out) sends empty ones.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist


def _all_gather_padded(tensor: torch.Tensor, group, world: int) -> List[torch.Tensor]:
    """``tensor`` of every rank (shapes may differ; the same number of dimensions), in rank order."""
    shape = torch.tensor(tensor.shape, dtype=torch.long, device=tensor.device)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    sizes = [tuple(s.tolist()) for s in shapes]
    largest = [max(s[d] for s in sizes) for d in range(tensor.dim())]
    padded = tensor.new_zeros(largest)
    padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return [t[tuple(slice(0, n) for n in size)] for t, size in zip(out, sizes, strict=True)]


def gather_net_inputs(net_inputs: List[Dict[str, torch.Tensor]], group, world: int) -> List[Dict[str, torch.Tensor]]:
    """All ranks' ``net_inputs`` (this rank's K batches), interleaved as one process reads them.

    Every rank must call it at the same time with ``net_input`` dicts of the same keys (its task's);
    ``world`` is the size of ``group``. With one rank the list is returned as it is.
    """
    if world <= 1:
        return net_inputs
    keys = sorted(k for k, v in net_inputs[0].items() if torch.is_tensor(v))
    device = net_inputs[0][keys[0]].device
    count = torch.tensor([len(net_inputs)], device=device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    batches = max(int(c.item()) for c in counts)
    gathered: List[Dict[str, torch.Tensor]] = []
    for k in range(batches):
        mine = net_inputs[k] if k < len(net_inputs) else None
        per_key = {}
        for key in keys:
            template = net_inputs[0][key]
            tensor = mine[key] if mine is not None else template.new_zeros((0,) * template.dim())
            per_key[key] = _all_gather_padded(tensor, group, world)
        for r in range(world):
            if k < int(counts[r].item()):
                gathered.append({key: per_key[key][r] for key in keys})
    return gathered
