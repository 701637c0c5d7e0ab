"""CPU stand-ins for what a GPU suffers from: host reads, kernel launches, matmul dtypes, SDPA calls,
graph breaks; each measured without a GPU, each reusable in tests and in ``benchmarks/gpu_readiness.py``.

- :class:`HostReads` (a ``TorchDispatchMode``): every op that makes the host wait for device data
  (``.item()`` / ``bool()`` / ``float()`` -> ``_local_scalar_dense``, ``torch.equal``, ``nonzero``,
  boolean-mask indexing, ``unique``, a device-to-host copy ...), with the line of Python that asked
  for it and whose code that line is (:func:`origin`: ``plugin``, ``fairseq``, ``torch``, ``other``).
  On the CPU every tensor but those the host made itself stands for a device tensor; on the
  ``meta`` device (which, like CUDA, refuses ``.item()`` and a non-scalar CPU operand)
  ``stand_in=True`` answers each read with ones instead of failing, so one run lists every read,
  copies to the host included (a CPU tensor's ``.cpu()`` / ``.tolist()`` is not an op: the CPU
  cannot see those);
- :func:`counting` / :class:`KernelCount`: aten ops that launch a kernel (views and aliases
  excluded), the unit of a GPU's per-op overhead; a call that the CPU decomposes and CUDA runs fused
  (``F.rms_norm``, ``F.scaled_dot_product_attention``: :data:`FUSED_FUNCTIONS`) counts once forward
  and once backward;
- :func:`auditing_matmuls` / :class:`MatmulDtypeAudit`: matrix products of a forward and backward by
  result dtype, fused attention as one product in its inputs' dtype (under
  ``torch.autocast("cpu", torch.bfloat16)`` every one should be bf16);
- :class:`AttentionPaths`: per call of a fairseq ``MultiheadAttention`` module, whether it reached
  the plugin's ``F.scaled_dot_product_attention`` call (``--attention-impl sdpa``), with ``is_causal``
  and the shape of any mask it passed;
- :func:`graph_breaks`: ``torch._dynamo.explain`` of a call, each break with its reason and origin;
- :func:`to_meta`: a model's parameters and buffers on the ``meta`` device (shapes kept, data dropped).

Nothing here imports the plugin; a caller passes the model and the batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import traceback
import weakref
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# --- where a line of code comes from --------------------------------------------------------------

_HERE = str(Path(__file__).resolve())
_TORCH = str(Path(torch.__file__).resolve().parent)


def origin(filename: str) -> str:
    """``plugin`` (fairseq_deepinit), ``fairseq``, ``torch`` or ``other`` (tests, benchmarks, Python)."""
    path = filename.replace("\\", "/")
    if "/fairseq_deepinit/" in path:
        return "plugin"
    if "/fairseq/" in path or "/fairseq_cli/" in path:
        return "fairseq"
    if path.startswith(_TORCH.replace("\\", "/")) or "/torch/" in path:
        return "torch"
    return "other"


def _user_frame(frames: Sequence[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame outside torch and this module: the code that asked for the op."""
    for frame in reversed(frames):
        if frame.filename == _HERE or origin(frame.filename) == "torch" or frame.filename.startswith("<"):
            continue
        return frame
    return None


def _where(frame: traceback.FrameSummary | None) -> str:
    if frame is None:
        return "?"
    path = Path(frame.filename)
    parts = path.parts
    for anchor in ("fairseq_deepinit", "fairseq", "benchmarks", "tests"):
        if anchor in parts:
            path = Path(*parts[parts.index(anchor) :])
            break
    return f"{path.as_posix()}:{frame.lineno} ({frame.name})"


@dataclasses.dataclass(frozen=True)
class Event:
    """One op of interest: the aten op, whose code asked for it, and the line (``file:line (function)``)."""

    op: str
    origin: str
    where: str


def _event(op: str) -> Event:
    frame = _user_frame(traceback.extract_stack()[:-2])
    return Event(op, origin(frame.filename) if frame else "torch", _where(frame))


def _op_name(func) -> str:
    return func._schema.name.split("::", 1)[-1]


# --- host reads (device syncs) --------------------------------------------------------------------

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
        name = _op_name(func)
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
            self.events.append(_event(name))
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


# --- fused calls -----------------------------------------------------------------------------------

# calls that the CPU decomposes into many ops (or runs through a math fallback, upcast to fp32) and
# CUDA runs as one kernel forward and one backward, in the dtype of their inputs: (module, attribute,
# name). They are replaced while counting (looked up at call time: the plugin's ``F.<name>`` and
# fairseq's ``F.multi_head_attention_forward`` both reach the replacement).
FUSED_FUNCTIONS = (
    (torch.nn.functional, "scaled_dot_product_attention", "scaled_dot_product_attention"),
    (torch.nn.functional, "rms_norm", "rms_norm"),
    (torch, "rms_norm", "rms_norm"),
)


@contextlib.contextmanager
def _replaced(owner: Any, attr: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    real = getattr(owner, attr)
    setattr(owner, attr, make(real))
    try:
        yield
    finally:
        setattr(owner, attr, real)


class _Tally(TorchDispatchMode):
    """A dispatch mode that counts ops, can be paused, and takes a fused call as one op each way."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = 0

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def fused(self, name: str, dtype: torch.dtype) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class _FusedOnce(torch.autograd.Function):
    """Runs a decomposed fused call with counting paused; counts it once forward, once backward."""

    @staticmethod
    def forward(ctx, tally: _Tally, name: str, call: Callable, *tensors):
        with tally.pause(), torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
            out = call(leaves)
        tally.fused(name, out.dtype)
        ctx.tally, ctx.name, ctx.out, ctx.leaves = tally, name, out, leaves
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        wanted = [leaf for leaf in ctx.leaves if leaf.requires_grad]
        with ctx.tally.pause():
            grads = iter(torch.autograd.grad(ctx.out, wanted, grad, allow_unused=True))
        ctx.tally.fused(ctx.name + "_backward", grad.dtype)
        return (None, None, None, *[next(grads) if leaf.requires_grad else None for leaf in ctx.leaves])


def _fused_call(tally: _Tally, name: str, real: Callable, args: tuple, kwargs: dict):
    if tally.paused:
        return real(*args, **kwargs)
    flat, spec = tree_flatten((args, kwargs))
    slots = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    if not torch.is_grad_enabled() or not any(flat[i].requires_grad for i in slots):
        with tally.pause():
            out = real(*args, **kwargs)
        tally.fused(name, out.dtype)
        return out

    def call(tensors: List[torch.Tensor]):
        values = list(flat)
        for i, t in zip(slots, tensors, strict=True):
            values[i] = t
        a, k = spec.unflatten(values)
        return real(*a, **k)

    return _FusedOnce.apply(tally, name, call, *[flat[i] for i in slots])


@contextlib.contextmanager
def _with_fused(tally: _Tally) -> Iterator[Any]:
    with contextlib.ExitStack() as stack:
        for owner, attr, name in FUSED_FUNCTIONS:

            def make(real, name=name):
                return functools.wraps(real)(lambda *a, **k: _fused_call(tally, name, real, a, k))

            stack.enter_context(_replaced(owner, attr, make))
        stack.enter_context(tally)
        yield tally


# --- kernel launches ------------------------------------------------------------------------------

# ops that launch no kernel: views, aliases, allocations without a fill, host-side scalars
_NO_KERNEL = frozenset(
    {"detach", "alias", "lift_fresh", "lift_fresh_copy", "empty", "empty_like", "empty_strided",
     "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "set_", "resize_"}
)  # fmt: skip


class KernelCount(_Tally):
    """Counts the aten ops that launch a kernel, by name (module docstring); use with :func:`counting`."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view:
            name = _op_name(func)
            if name not in _NO_KERNEL:
                self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    def fused(self, name: str, dtype: torch.dtype) -> None:
        self.counts[name] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def counting() -> contextlib.AbstractContextManager[KernelCount]:
    """``with counting() as k: ...``: kernel launches of the block, fused calls counted once."""
    return _with_fused(KernelCount())


# --- matmul dtypes ----------------------------------------------------------------------------------

MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_addmm_activation", "mv"})


def is_matmul(name: str) -> bool:
    """Matrix products and every scaled-dot-product-attention kernel (forward and backward)."""
    return name in MATMUL_OPS or "scaled_dot_product" in name or "flash_attention" in name


class MatmulDtypeAudit(_Tally):
    """Matrix products by ``(op, result dtype)``, with the line that asked for each non-``expect`` one.

    Use with :func:`auditing_matmuls`, which takes ``F.scaled_dot_product_attention`` as one product in
    the dtype of its inputs (the CPU's math fallback upcasts bf16 to fp32 inside; CUDA's kernels do not).
    """

    def __init__(self, expect: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.expect = expect
        self.counts: Counter[tuple] = Counter()
        self.off: Counter[str] = Counter()  # "origin op where" of products in another dtype

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = _op_name(func)
        if not self.paused and is_matmul(name):
            result = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(result, torch.Tensor):
                self._add(name, result.dtype)
        return out

    def fused(self, name: str, dtype: torch.dtype) -> None:
        if is_matmul(name):
            self._add(name, dtype)

    def _add(self, name: str, dtype: torch.dtype) -> None:
        self.counts[(name, dtype)] += 1
        if dtype != self.expect:
            ev = _event(name)
            self.off[f"{ev.origin} {name} {ev.where}"] += 1

    def total(self, dtype: torch.dtype | None = None) -> int:
        return sum(n for (_, d), n in self.counts.items() if dtype is None or d == dtype)

    def other(self) -> int:
        """Matrix products not in the expected dtype."""
        return self.total() - self.total(self.expect)


def auditing_matmuls(expect: torch.dtype = torch.bfloat16) -> contextlib.AbstractContextManager[MatmulDtypeAudit]:
    """``with auditing_matmuls() as audit: ...``: matrix products of the block by dtype."""
    return _with_fused(MatmulDtypeAudit(expect))


# --- attention calls --------------------------------------------------------------------------------


@dataclasses.dataclass
class AttentionPath:
    """One forward of an attention module and the SDPA call it made (if any)."""

    module: str
    self_attention: bool
    sdpa: bool = False  # the plugin's F.scaled_dot_product_attention call ran for it
    is_causal: bool = False
    mask_shape: tuple | None = None


def _in_plugin_sdpa() -> bool:
    """Whether the current Python stack is inside the plugin's own SDPA forward (not torch's F.mha)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_sdpa_forward" and origin(frame.f_code.co_filename) == "plugin":
            return True
        frame = frame.f_back
    return False


class AttentionPaths:
    """Records, per call of every fairseq ``MultiheadAttention`` in ``model``, the SDPA call it made.

    Use as a context manager around forwards of ``model``: hooks on the attention modules and a
    recorder in front of ``F.scaled_dot_product_attention`` while it is open.
    """

    def __init__(self, model: nn.Module) -> None:
        from fairseq.modules.multihead_attention import MultiheadAttention

        self.modules = {m: n for n, m in model.named_modules() if isinstance(m, MultiheadAttention)}
        self.calls: List[AttentionPath] = []
        self._stack: List[AttentionPath] = []
        self._exit = contextlib.ExitStack()

    def __enter__(self) -> AttentionPaths:
        for module, name in self.modules.items():
            self._exit.callback(module.register_forward_pre_hook(self._push(name)).remove)
            self._exit.callback(module.register_forward_hook(self._pop).remove)
        self._exit.enter_context(_replaced(torch.nn.functional, "scaled_dot_product_attention", self._recorder))
        return self

    def __exit__(self, *exc) -> None:
        self._exit.close()

    def _push(self, name: str):
        def hook(module, inputs) -> None:
            call = AttentionPath(name.replace("._checkpoint_wrapped_module", ""), bool(module.self_attention))
            self.calls.append(call)
            self._stack.append(call)

        return hook

    def _pop(self, module, inputs, output) -> None:
        if self._stack:
            self._stack.pop()

    def _recorder(self, real: Callable) -> Callable:
        @functools.wraps(real)
        def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
            if self._stack and _in_plugin_sdpa():
                call = self._stack[-1]
                call.sdpa, call.is_causal = True, bool(is_causal)
                call.mask_shape = tuple(attn_mask.shape) if isinstance(attn_mask, torch.Tensor) else None
            return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

        return sdpa

    def self_attention(self, stack: str | None = None) -> List[AttentionPath]:
        """The self-attention calls (of ``stack``: ``encoder`` / ``decoder``, by module name)."""
        return [c for c in self.calls if c.self_attention and (stack is None or c.module.split(".", 1)[0] == stack)]


# --- graph breaks -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    reason: str
    origin: str
    where: str


def graph_breaks(fn: Callable, *args, **kwargs) -> tuple[int, List[GraphBreak]]:
    """``torch._dynamo.explain(fn)(*args, **kwargs)``: the number of graphs and every break, by origin.

    A break's origin is the innermost frame of its user stack outside torch: the code whose line
    dynamo could not put into the graph.
    """
    import torch._dynamo

    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args, **kwargs)
    breaks = []
    for br in explained.break_reasons:
        frame = _user_frame(list(br.user_stack or []))
        reason = " ".join(str(br.reason).split())
        breaks.append(GraphBreak(reason[:300], origin(frame.filename) if frame else "torch", _where(frame)))
    torch._dynamo.reset()
    return explained.graph_count, breaks


# --- the meta device --------------------------------------------------------------------------------


def to_meta(module: nn.Module) -> nn.Module:
    """``module`` with every parameter and buffer on ``meta`` (same shapes and dtypes, no data), in place."""
    return module.to_empty(device="meta")


def tensors_to(sample: Any, device: str | torch.device) -> Any:
    """Every tensor in a (nested) sample moved to ``device``; everything else kept."""
    if isinstance(sample, torch.Tensor):
        return sample.to(device)
    if isinstance(sample, dict):
        return {k: tensors_to(v, device) for k, v in sample.items()}
    if isinstance(sample, (list, tuple)):
        return type(sample)(tensors_to(v, device) for v in sample)
    return sample


__all__ = [
    "AttentionPath", "AttentionPaths", "Event", "FUSED_FUNCTIONS", "GraphBreak", "HostReads", "KernelCount",
    "MATMUL_OPS", "MatmulDtypeAudit", "READ_OPS", "auditing_matmuls", "counting", "graph_breaks", "is_matmul", "origin",
    "tensors_to", "to_meta",
]  # fmt: skip
