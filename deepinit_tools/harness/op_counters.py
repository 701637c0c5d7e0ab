"""What a training step would launch on a GPU, counted on the CPU or the ``meta`` device: aten ops
(kernel launches) and the dtype of every matrix product.

Both counters are ``TorchDispatchMode``\\ s: they see the operators after autocast has chosen their
dtypes and after autograd has expanded the backward, the ones a backend runs, forward and backward
alike (``F.linear`` arrives as ``addmm``, the backward of a Linear as two ``mm``):

- :class:`OpCounter`: aten operators of a block, a stand-in for CUDA kernel launches;
- :class:`MatmulDtypeAudit`: matrix products (and attention kernels) by op and result dtype, with
  the line that asked for each one not in the expected dtype (under
  ``torch.autocast("cpu", torch.bfloat16)`` every one should be bf16).

Counting rules:

1. every aten operator counts once, except those that launch no kernel: views and aliases (an
   operator whose schema returns an alias, ``func.is_view``: ``view``, ``expand``, ``transpose``,
   ``detach`` ...) and the ones in :data:`NO_KERNEL` (allocation without a fill, ``_unsafe_view``);
2. a call of a function in :data:`FUSED` counts as one operator forward and one backward, whatever it
   decomposes into locally, when CUDA would run it as one fused kernel each way, in the dtype of its
   output (the backward in the same dtype). ``F.rms_norm``: torch 2.11-2.13 dispatch it to
   ``aten::_fused_rms_norm`` / ``_fused_rms_norm_backward`` on CUDA when the weight's dtype is the
   input's (or there is no weight), and decompose it everywhere else (CPU, ``meta``, mixed dtypes,
   with a warning): a call the rule does not cover is counted operator by operator.
   ``F.scaled_dot_product_attention``: CUDA runs a call as one flash / memory-efficient / cuDNN kernel each
   way in the inputs' dtype (the efficient kernel takes fp32 and any mask) when its head dimensions admit one
   (:func:`_sdpa_is_fused`), where the CPU may take its math fallback, which upcasts bf16 to fp32 inside (a
   false fp32 product for the audit); a call whose head dimensions no fused kernel takes (``q`` and ``v`` of
   different widths, a width not divisible by 8 in bf16) runs CUDA's math backend, the same decomposition as
   the CPU's, and is counted operator by operator: its fp32 products show. The backward operators of a fused
   call are recognised by their autograd node (``torch._C._current_autograd_node()``): the nodes its
   decomposition created are tagged in their ``metadata`` when the call returns, and the first backward
   operator run by any of them counts once for all, in whichever counter is open during the backward (a
   forward and a backward may be counted by two counters).

Fused calls are seen by wrapping the functions of :data:`FUSED` where callers look them up
(``F.rms_norm``; torch's own ``F.multi_head_attention_forward`` looks up
``F.scaled_dot_product_attention`` the same way) for the duration of the block (a
``TorchFunctionMode`` would miss the backward pass, where ``--checkpoint-activations`` re-runs the
forward); a reference bound before the block (``from torch.nn.functional import rms_norm``) is
counted operator by operator. Nothing here reads a tensor's value: the counters run as well on
``meta`` tensors. Reusable by tests and benchmark scripts
(``from deepinit_tools.harness.op_counters import OpCounter``).
"""

from __future__ import annotations

import collections
import itertools
from typing import Any, Callable, Dict, List

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from .origins import event, op_name

aten = torch.ops.aten

# operators that allocate without writing or only relabel memory: no kernel launch
NO_KERNEL = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten._unsafe_view.default,
        aten.lift_fresh.default,
    }
)


def _rms_norm_is_fused(args: tuple, kwargs: dict) -> bool:
    """torch's own condition for the fused CUDA rms_norm: no weight, or the weight in the input's dtype."""
    x = args[0]
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    return weight is None or weight.dtype == x.dtype


def _sdpa_is_fused(args: tuple, kwargs: dict) -> bool:
    """Whether CUDA's SDPA dispatch (torch ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``,
    ``check_head_dim_size_flash`` and ``check_head_dim_size_mem_efficient``) admits the call's head dimensions to
    a fused kernel: flash takes fp16/bf16 with ``q``, ``k``, ``v`` of one last dimension <= 256; the
    memory-efficient kernel takes fp16/bf16/fp32 with ``q`` and ``k`` of one last dimension and both it and
    ``v``'s divisible by the GEMM alignment (8 for 16-bit inputs, 4 for fp32 on sm80+). Anything else runs the
    math backend, which upcasts fp16/bf16 to fp32 inside."""
    q = args[0] if args else kwargs["query"]
    k = args[1] if len(args) > 1 else kwargs["key"]
    v = args[2] if len(args) > 2 else kwargs["value"]
    dq, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    half = q.dtype in (torch.float16, torch.bfloat16)
    flash = half and dq == dk == dv and dq <= 256
    align = 8 if half else 4
    efficient = (half or q.dtype == torch.float32) and dq == dk and dq % align == 0 and dv % align == 0
    return flash or efficient


# (module, attribute) of a function -> (name it is counted under, whether CUDA fuses this call)
FUSED: Dict[tuple, tuple] = {
    (F, "rms_norm"): ("rms_norm", _rms_norm_is_fused),
    (torch, "rms_norm"): ("rms_norm", _rms_norm_is_fused),
    (F, "scaled_dot_product_attention"): ("scaled_dot_product_attention", _sdpa_is_fused),
}

# the metadata key of a fused call's backward nodes: (group id, name, dtype)
_TAG = "harness.fused"
_GROUP_IDS = itertools.count()


def launches_kernel(func) -> bool:
    """Whether an aten operator counts under rule 1 (not a view, not a bare allocation)."""
    return not (getattr(func, "is_view", False) or func in NO_KERNEL)


def _nodes_between(root, boundary: set) -> List:
    """The autograd nodes from ``root`` back to (not including) ``boundary`` and the leaves' AccumulateGrad."""
    seen, stack, out = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in boundary or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(node)
        out.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return out


class _FusedAware(TorchDispatchMode):
    """A dispatch mode that hands each aten op to :meth:`op` and each fused call (forward, backward) to
    :meth:`fused`, once, under the rules of the module docstring. Use as a context manager."""

    def __init__(self) -> None:
        super().__init__()
        self._suppress = 0
        self._counted: set = set()  # fused groups whose backward was counted here
        self._saved: Dict[tuple, Callable] = {}

    def op(self, func, out: Any) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def fused(self, name: str, dtype: torch.dtype) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self):
        for (owner, attr), (name, fuses) in FUSED.items():
            original = getattr(owner, attr)
            self._saved[(owner, attr)] = original
            setattr(owner, attr, self._wrap(name, fuses, original))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for (owner, attr), original in self._saved.items():
                setattr(owner, attr, original)
            self._saved = {}

    def _wrap(self, name: str, fuses: Callable, original: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            if self._suppress or not fuses(args, kwargs):  # nested (F.rms_norm calls torch.rms_norm) or unfused
                return original(*args, **kwargs)
            return self._fused_call(name, original, args, kwargs)

        return wrapper

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._suppress:
            return out
        node = torch._C._current_autograd_node()
        tag = node.metadata.get(_TAG) if node is not None else None
        if tag is None:
            self.op(func, out)
        elif tag[0] not in self._counted:
            self._counted.add(tag[0])
            self.fused(f"{tag[1]}_backward", tag[2])
        return out

    def _fused_call(self, name: str, func, args: tuple, kwargs: dict):
        self._suppress += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self._suppress -= 1
        self.fused(name, out.dtype)
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            tag = (next(_GROUP_IDS), name, out.dtype)
            for node in _nodes_between(out.grad_fn, {t.grad_fn for t in inputs if t.grad_fn is not None}):
                node.metadata[_TAG] = tag
        return out


class OpCounter(_FusedAware):
    """Counts aten operators (forward and backward) under the rules of the module docstring.

    Usage::

        with OpCounter() as ops:
            loss = model(**batch).sum()
            loss.backward()
        ops.total, ops.counts  # int, Counter {"aten.mm.default": 12, "rms_norm (fused)": 4, ...}
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def op(self, func, out: Any) -> None:
        if launches_kernel(func):
            self.counts[str(func)] += 1

    def fused(self, name: str, dtype: torch.dtype) -> None:
        self.counts[f"{name} (fused)"] += 1


# aten overload packets of matrix products (F.linear and torch.matmul decompose into these)
MATMUL_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_addmm_activation", "mv", "addmv", "dot"}
)


def is_matmul(name: str) -> bool:
    """Matrix products and every scaled-dot-product-attention kernel (forward and backward); ``name``: an
    aten op's base name (``"addmm"``, ``"_scaled_dot_product_flash_attention_for_cpu"``) or a fused call's."""
    return name in MATMUL_OPS or "scaled_dot_product" in name or "flash_attention" in name


class MatmulDtypeAudit(_FusedAware):
    """Matrix products by ``(op, result dtype)``, with the line that asked for each non-``expect`` one.

    ``F.scaled_dot_product_attention`` counts as one product each way in the dtype of its output (its
    inputs'; module docstring). Usage::

        with torch.autocast("cpu", torch.bfloat16), MatmulDtypeAudit() as fwd:
            loss = model(**batch).float().sum()
        with MatmulDtypeAudit() as bwd:
            loss.backward()
        assert set(fwd.by_dtype()) == set(bwd.by_dtype()) == {torch.bfloat16}, bwd.summary()
    """

    def __init__(self, expect: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.expect = expect
        self.counts: collections.Counter = collections.Counter()  # (op name, dtype) -> products
        self.off: collections.Counter = collections.Counter()  # "origin op where" of products in another dtype

    def op(self, func, out: Any) -> None:
        name = op_name(func)
        if is_matmul(name):
            result = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(result, torch.Tensor):
                self._add(name, result.dtype)

    def fused(self, name: str, dtype: torch.dtype) -> None:
        if is_matmul(name):
            self._add(name, dtype)

    def _add(self, name: str, dtype: torch.dtype) -> None:
        self.counts[(name, dtype)] += 1
        if dtype != self.expect:
            ev = event(name)
            self.off[f"{ev.origin} {name} {ev.where}"] += 1

    def total(self, dtype: torch.dtype | None = None) -> int:
        return sum(n for (_, d), n in self.counts.items() if dtype is None or d == dtype)

    def other(self) -> int:
        """Matrix products not in the expected dtype."""
        return self.total() - self.total(self.expect)

    def by_dtype(self) -> collections.Counter:
        """Number of matrix products per result dtype."""
        total: collections.Counter = collections.Counter()
        for (_, dtype), n in self.counts.items():
            total[dtype] += n
        return total

    def of_dtype(self, dtype: torch.dtype) -> collections.Counter:
        """Number of matrix products per op name that produced ``dtype``."""
        return collections.Counter({name: n for (name, d), n in self.counts.items() if d == dtype})

    def summary(self) -> Dict[str, Dict[str, int]]:
        """``{"bfloat16": {"addmm": 26, "mm": 72}, ...}``, for a report or an assertion message."""
        out: Dict[str, Dict[str, int]] = {}
        for (name, dtype), n in sorted(self.counts.items(), key=lambda kv: (str(kv[0][1]), kv[0][0])):
            out.setdefault(str(dtype).replace("torch.", ""), {})[name] = n
        return out


__all__ = ["FUSED", "MATMUL_OPS", "NO_KERNEL", "MatmulDtypeAudit", "OpCounter", "is_matmul", "launches_kernel"]
