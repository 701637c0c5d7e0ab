"""Host reads of device data: every op that makes the host wait for a GPU, with the line that asked.

:class:`HostReads` (a ``TorchDispatchMode``) records ``.item()`` / ``bool()`` / ``float()``
(``_local_scalar_dense``), ``torch.equal``, ``nonzero``, boolean-mask indexing, ``unique``, a
device-to-host copy ... each with whose code asked for it (:func:`harness.origins.origin`: ``plugin``,
``fairseq``, ``torch``, ``other``). On the CPU every tensor but those the host made itself stands
for a device tensor; on the ``meta`` device (which, like CUDA, refuses ``.item()`` and a non-scalar
CPU operand) ``stand_in=True`` answers each read with ones instead of failing, so one run lists
every read, copies to the host included (a CPU tensor's ``.cpu()`` / ``.tolist()`` is not an op: the
CPU cannot see those). On CUDA, ``torch.cuda.set_sync_debug_mode`` sees the real syncs
(``benchmarks/gpu_smoke.py``).
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from typing import Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .origins import Event, event, op_name

# ops whose result the host must wait for: a value, or an output size that depends on the data
READ_OPS = frozenset(
    {
        "_local_scalar_dense",  # .item(), bool(), float(), int(), Python control flow on a tensor
        "item", "is_nonzero", "equal", "allclose",
        "nonzero", "nonzero_numpy", "argwhere", "masked_select",
        "unique_consecutive", "_unique", "_unique2", "unique_dim", "unique_dim_consecutive",
        "bincount", "histc",
    }
)  # fmt: skip
_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
_COPY_OPS = frozenset({"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize"})


def _is_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ())


def _copy_to_host(name: str, args, kwargs) -> bool:
    """A copy out of a device tensor into host memory (the ``.cpu()`` / ``.tolist()`` of a CUDA tensor)."""
    if name == "_to_copy":
        device = kwargs.get("device")
        return args[0].device.type != "cpu" and device is not None and torch.device(device).type == "cpu"
    if name == "copy_":
        return args[0].device.type == "cpu" and isinstance(args[1], torch.Tensor) and args[1].device.type != "cpu"
    return False


# ops that make a tensor out of host data: Python numbers (``torch.tensor(...)``) or a shape
_HOST_MADE = frozenset({"lift_fresh", "lift_fresh_copy", "_shape_as_tensor", "scalar_tensor"})


class HostReads(TorchDispatchMode):
    """Records every host read of device data while active (module docstring).

    Which tensors are device tensors: on CUDA or ``meta``, every tensor not on the CPU. With
    ``cpu_is_device`` (the CPU standing in for a device) also every CPU tensor except those the host
    made itself and what is computed from those alone: ``torch.tensor`` of Python numbers, and
    tensors that C++ code creates without a device (``shape_as_tensor``, which fairseq's positional
    embedding compares on every call: reading those waits for nothing on a GPU either).

    ``events``: one :class:`Event` per read, in order. With ``stand_in=True`` a read of a ``meta``
    tensor (which has no data) returns ones, True, or an empty selection, so the run goes on.
    """

    def __init__(self, cpu_is_device: bool = True, stand_in: bool = False) -> None:
        super().__init__()
        self.cpu_is_device = cpu_is_device
        self.stand_in = stand_in
        self.events: List[Event] = []
        self._host: Dict[int, weakref.ref] = {}  # id -> weakref of CPU tensors made on the host

    def _is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _is_device(self, t: torch.Tensor) -> bool:
        if t.device.type != "cpu":
            return True
        return self.cpu_is_device and not self._is_host(t)

    def _mark_host(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                key = id(t)
                self._host[key] = weakref.ref(t, functools.partial(self._forget, key))

    def _forget(self, key: int, _ref) -> None:
        self._host.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if tensors:
            host = name in _HOST_MADE or not any(self._is_device(t) for t in tensors)
        else:  # a factory: Python passes a device, C++ internals making host tensors do not
            host = name in _HOST_MADE or "device" not in kwargs
        read = name in READ_OPS
        read = read or (name in _INDEX_OPS and _is_bool_index(args))
        read = read or (name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) == 1)
        read = read or (name in _COPY_OPS and _copy_to_host(name, args, kwargs))
        if read and not host:
            self.events.append(event(name))
            if self.stand_in and any(t.device.type == "meta" for t in tensors):
                return _stand_in(name, func, args, kwargs)
        out = func(*args, **kwargs)
        if host and self.cpu_is_device:
            self._mark_host(out)
        return out

    def count(self, origin_: str | None = None) -> int:
        return sum(1 for e in self.events if origin_ is None or e.origin == origin_)

    def by_origin(self) -> Dict[str, int]:
        return dict(Counter(e.origin for e in self.events))

    def lines(self) -> Dict[str, int]:
        """``{"origin op file:line (function)": count}``, for a report or an assertion message."""
        return dict(Counter(f"{e.origin} {e.op} {e.where}" for e in self.events))


def _stand_in(name: str, func, args, kwargs):
    """What a read of a meta tensor returns under ``stand_in``: ones (data), True, an empty selection."""
    x = args[0]
    if name in ("_local_scalar_dense", "item"):
        return True if x.dtype == torch.bool else (1.0 if x.dtype.is_floating_point else 1)
    if name in ("is_nonzero", "equal", "allclose"):
        return True
    if name == "_to_copy":
        return torch.ones(x.shape, dtype=kwargs.get("dtype") or x.dtype, device="cpu")
    if name == "copy_":
        return x.fill_(1)
    if name in ("nonzero", "argwhere"):
        return torch.zeros((0, x.dim()), dtype=torch.long, device=x.device)
    if name in _INDEX_OPS and name.startswith("index_put"):
        return x
    # boolean indexing, masked_select, unique ...: an empty selection of the right rank
    return x.new_empty((0,) + tuple(x.shape[1:]) if name == "index" else (0,))


__all__ = ["READ_OPS", "HostReads"]
