"""The autocast state of the running code, captured once and entered again later.

Code that runs a computation a second time, after the ``with torch.autocast(...)`` block of the
first run has been left, must run it under the same state or it computes another function: the
recompute of an activation-checkpointed layer (:mod:`fairseq_deepinit.training.activation_checkpoint`) and the
divergence guard's replay of a failed step (:mod:`fairseq_deepinit.diagnostics.criterion`). This is what
``torch.utils.checkpoint`` does for its own recompute (torch 2.13
``torch/utils/checkpoint.py:215-231`` ``_get_autocast_kwargs`` and ``:310-313``): per device type,
``enabled``, ``dtype`` and ``cache_enabled``, for the CPU and for the device of the tensors involved,
so that a CUDA run restores CUDA autocast and a CPU run CPU autocast, without naming a device here.
Only public torch functions are used (all present since torch 2.4).
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, NamedTuple, Tuple

import torch


class _DeviceAutocast(NamedTuple):
    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool


class AutocastState(NamedTuple):
    """Per device type: is autocast on, in which dtype, with the weight-cast cache or not."""

    devices: Tuple[_DeviceAutocast, ...]

    @classmethod
    def capture(cls, tensors: Iterable[object] = ()) -> AutocastState:
        """The current state for the CPU and for every device type among ``tensors`` (non-tensors ignored)."""
        types = {"cpu"}
        types.update(t.device.type for t in tensors if isinstance(t, torch.Tensor))
        cache = torch.is_autocast_cache_enabled()
        return cls(
            tuple(
                _DeviceAutocast(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d), cache)
                for d in sorted(types)
                if torch.amp.is_autocast_available(d)  # "meta" has no autocast
            )
        )

    @property
    def enabled(self) -> bool:
        return any(d.enabled for d in self.devices)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Run the body under this state (on every captured device type, switched on or off as captured)."""
        with contextlib.ExitStack() as stack:
            for d in self.devices:
                stack.enter_context(
                    torch.autocast(d.device_type, dtype=d.dtype, enabled=d.enabled, cache_enabled=d.cache_enabled)
                )
            yield

    def describe(self) -> str:
        """``"autocast cpu bfloat16"``, or ``"no autocast"``."""
        on = [f"{d.device_type} {str(d.dtype).replace('torch.', '')}" for d in self.devices if d.enabled]
        return f"autocast {', '.join(on)}" if on else "no autocast"
