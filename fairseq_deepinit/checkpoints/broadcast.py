"""The checkpoint state rank 0 hands to the other ranks on resume, loaded without widening what a file may hold.

fairseq 0.12.3's ``Trainer.load_checkpoint`` (``fairseq/trainer.py``, lines 497-520) reads the checkpoint
file on rank 0 only (``checkpoint_utils.load_checkpoint_to_cpu``, under the plugin's ``weights_only``
policy: tensors, plain containers and ``argparse.Namespace``, :mod:`.compat`) and sends the state to the
other ranks with ``distributed_utils.broadcast_object``. That pickles the non-tensor part with
``torch.save`` and unpickles it on every other rank with a bare ``torch.load(buffer)``
(``_broadcast_object_slow``, ``fairseq/distributed/utils.py``, line 805), which torch >= 2.6 runs with
``weights_only=True``. By then the state holds more than the file did: ``load_checkpoint_to_cpu`` has
turned the saved arguments into an omegaconf ``DictConfig`` (``state["cfg"]``), and ``broadcast_object``
has replaced every tensor with a fairseq ``_TensorPlaceholder``. So every rank but 0 stopped with
``UnpicklingError: ... Unsupported global: GLOBAL omegaconf.dictconfig.DictConfig``, and no multi-rank run
could resume (``--load-checkpoint-on-all-dp-ranks``, which reads the file on every rank, was the only way).

:func:`broadcast_object_slow` replaces ``_broadcast_object_slow``: on the receiving ranks the same
``torch.load`` runs with ``weights_only`` still on, inside ``torch.serialization.safe_globals`` of
:data:`BROADCAST_GLOBALS` (omegaconf's config containers and value nodes, the plain types their metadata
names, fairseq's placeholder): what fairseq itself adds in memory after rank 0's safe load. The bytes
come from rank 0 of the same job, never from a file: the allow-list of checkpoint files stays
``argparse.Namespace`` only (a file that pickles a ``DictConfig`` is still refused), and the context
removes its additions when the load returns. Rank 0's side, and every other use of ``torch.load``, is
unchanged. For a stock model the change is the same: only the receiving ranks' unpickling differs, and
only in what it accepts. A state holding something else (an enum of another plugin's config, say) stops
the receiving rank with one line that names it and the flag that avoids the broadcast.
"""

from __future__ import annotations

import argparse
import collections
import pickle
import typing
from typing import Any, Callable, Dict, List

import torch
from fairseq.distributed import utils as distributed_utils
from omegaconf import DictConfig, ListConfig, base, nodes

from ..errors import CheckpointFileError

_ORIGINAL: Dict[str, Callable] = {}


def _value_nodes() -> List[type]:
    """Every concrete value-node class of omegaconf (``AnyNode``, ``StringNode``, ``IntegerNode``, ...)."""
    out = []
    for name in dir(nodes):
        cls = getattr(nodes, name)
        if isinstance(cls, type) and issubclass(cls, nodes.ValueNode) and cls is not nodes.ValueNode:
            out.append(cls)
    return sorted(out, key=lambda c: c.__qualname__)


# what fairseq adds to a loaded checkpoint state before broadcasting it (get_unsafe_globals_in_checkpoint on
# the broadcast buffer of a deepinit and a stock checkpoint lists these; tests/test_multirank.py re-checks it)
BROADCAST_GLOBALS: List[Any] = [
    DictConfig,
    ListConfig,
    base.Metadata,
    base.ContainerMetadata,
    *_value_nodes(),
    typing.Any,
    collections.defaultdict,
    dict,
    list,
    tuple,
    set,
    int,
    float,
    str,
    bool,
    distributed_utils._TensorPlaceholder,
]


def _added_globals() -> List[Any]:
    """:data:`BROADCAST_GLOBALS` minus what the process already allows (``safe_globals`` removes on exit
    what it added: it must never take ``argparse.Namespace`` off the permanent list)."""
    permanent = set(torch.serialization.get_safe_globals()) | {argparse.Namespace}
    return [g for g in BROADCAST_GLOBALS if g not in permanent]


def broadcast_object_slow(obj: Any, src_rank: int, group: object, dist_device: torch.device) -> Any:
    """fairseq's ``distributed_utils._broadcast_object_slow`` (``fairseq/distributed/utils.py``, line 784)
    whose receiving ranks accept, besides a checkpoint file's types, the ones fairseq adds in memory."""
    original = _ORIGINAL["_broadcast_object_slow"]
    if distributed_utils.get_rank(group) == src_rank or not hasattr(torch.serialization, "safe_globals"):
        return original(obj, src_rank, group, dist_device)
    try:
        with torch.serialization.safe_globals(_added_globals()):
            return original(obj, src_rank, group, dist_device)
    except pickle.UnpicklingError as e:
        what = str(e).strip().splitlines()
        raise CheckpointFileError(
            f"rank {distributed_utils.get_global_rank()} could not take the checkpoint state rank {src_rank} "
            f"loaded: it holds a type outside the checkpoint allow-list and omegaconf's config classes "
            f"({what[0][:200] if what else type(e).__name__}). Add --load-checkpoint-on-all-dp-ranks (every rank "
            "then reads the checkpoint file itself)"
        ) from None


def install() -> None:
    """Replace ``distributed_utils._broadcast_object_slow`` (idempotent). ``broadcast_object`` and
    ``broadcast_tensors`` look the name up in their module at every call, so both use the replacement."""
    if _ORIGINAL:
        return
    _ORIGINAL["_broadcast_object_slow"] = distributed_utils._broadcast_object_slow
    distributed_utils._broadcast_object_slow = broadcast_object_slow
