"""Counting, on the CPU or the ``meta`` device, what a training step would launch on a GPU.

Reusable by tests and benchmark scripts (``sys.path`` holding ``benchmarks/``, then
``from harness.counters import OpCounter, AttentionCalls``):

- :class:`OpCounter`: aten operators of a forward + backward, a stand-in for CUDA kernel launches;
- :class:`AttentionCalls`: per attention-module call, which path it took (``F.scaled_dot_product_attention``,
  ``F.multi_head_attention_forward`` or fairseq's explicit ``bmm``/``softmax``), its ``is_causal`` and the
  shape of any mask it materialised.

Counting rules of :class:`OpCounter` (a ``TorchDispatchMode``: it sees the operators after autograd, the
ones a backend runs, forward and backward alike):

1. every aten operator counts once, except those that launch no kernel: views and aliases (an
   operator whose schema returns an alias, ``func.is_view``: ``view``, ``expand``, ``transpose``,
   ``detach`` ...) and the ones in :data:`NO_KERNEL` (allocation without a fill, ``_unsafe_view``);
2. a call of a function in :data:`FUSED` counts as one operator forward and one backward, whatever it
   decomposes into locally, when CUDA would run it as one fused kernel each way. ``F.rms_norm``: torch
   2.11-2.13 dispatch it to ``aten::_fused_rms_norm`` / ``_fused_rms_norm_backward`` on CUDA when the
   weight's dtype is the input's (or there is no weight), and decompose it everywhere else (CPU,
   ``meta``, mixed dtypes, with a warning). A call the rule does not cover is counted operator by
   operator. The backward operators of a fused call are recognised by their autograd node
   (``torch._C._current_autograd_node()``): the nodes its decomposition created are collected when the
   call returns, and the first backward operator run by any of them counts once for all.

Nothing here reads a tensor's value: the counters run as well on ``meta`` tensors (no data at all).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

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


# (module, attribute) of a function -> (name it is counted under, whether CUDA fuses this call)
FUSED: Dict[tuple, tuple] = {
    (F, "rms_norm"): ("rms_norm", _rms_norm_is_fused),
    (torch, "rms_norm"): ("rms_norm", _rms_norm_is_fused),
}


def launches_kernel(func) -> bool:
    """Whether an aten operator counts under rule 1 (not a view, not a bare allocation)."""
    return not (getattr(func, "is_view", False) or func in NO_KERNEL)


class _FusedGroup:
    __slots__ = ("name", "counted")

    def __init__(self, name: str) -> None:
        self.name = name
        self.counted = False


class _OpDispatch(TorchDispatchMode):
    def __init__(self, owner: OpCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.owner._dispatched(func)
        return out


class OpCounter:
    """Counts aten operators (forward and backward) under the rules of the module docstring.

    Usage::

        with OpCounter() as ops:
            loss = model(**batch).sum()
            loss.backward()
        ops.total, ops.counts  # int, Counter {"aten.mm.default": 12, "rms_norm (fused)": 4, ...}

    Only operators run inside the ``with`` are counted; the counter keeps references to the autograd
    nodes of fused calls until it is garbage collected. Fused calls are seen by wrapping the functions
    of :data:`FUSED` where callers look them up (``F.rms_norm``) for the duration of the block (a
    ``TorchFunctionMode`` would miss the backward pass, where ``--checkpoint-activations`` re-runs the
    forward); a reference bound before the block (``from torch.nn.functional import rms_norm``) is
    counted operator by operator.
    """

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self._suppress = 0
        self._fused_nodes: Dict[torch.autograd.graph.Node, _FusedGroup] = {}
        self._mode: _OpDispatch | None = None
        self._saved: Dict[tuple, Callable] = {}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> OpCounter:
        for (owner, attr), (name, fuses) in FUSED.items():
            original = getattr(owner, attr)
            self._saved[(owner, attr)] = original
            setattr(owner, attr, self._wrap(name, fuses, original))
        self._mode = _OpDispatch(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        self._mode = None
        for (owner, attr), original in self._saved.items():
            setattr(owner, attr, original)
        self._saved = {}

    def _wrap(self, name: str, fuses: Callable, original: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            if self._suppress or not fuses(args, kwargs):  # nested (F.rms_norm calls torch.rms_norm) or unfused
                return original(*args, **kwargs)
            return self._fused_call(name, original, args, kwargs)

        return wrapper

    def _dispatched(self, func) -> None:
        if self._suppress:
            return
        node = torch._C._current_autograd_node()
        group = self._fused_nodes.get(node) if node is not None else None
        if group is not None:
            if not group.counted:
                group.counted = True
                self.counts[f"{group.name}_backward (fused)"] += 1
            return
        if launches_kernel(func):
            self.counts[str(func)] += 1

    def _fused_call(self, name: str, func, args: tuple, kwargs: dict):
        self._suppress += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self._suppress -= 1
        self.counts[f"{name} (fused)"] += 1
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            group = _FusedGroup(name)
            for node in _nodes_between(out.grad_fn, {t.grad_fn for t in inputs if t.grad_fn is not None}):
                self._fused_nodes[node] = group
        return out


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


# --- attention calls ------------------------------------------------------------------------------


@dataclasses.dataclass
class AttentionCall:
    """One forward call of an attention module and the kernel path it took.

    ``path``: ``"sdpa"`` (``F.scaled_dot_product_attention``), ``"mha"`` (``F.multi_head_attention_forward``,
    torch's module path; ``is_causal`` and ``mask_shape`` are then those of the SDPA call it makes, if
    any) or ``"explicit"`` (neither: fairseq's ``bmm -> softmax -> bmm``). ``mask_shape``: the shape of
    the ``attn_mask`` the kernel got (``None``: no mask tensor). ``square_mask``: a mask with a query
    axis as long as its key axis, i.e. a materialised ``T x T`` (per sentence or shared) mask.
    """

    module: str
    kind: str
    path: str = "explicit"
    is_causal: bool = False
    mask_shape: tuple | None = None
    query_shape: tuple | None = None

    @property
    def square_mask(self) -> bool:
        s = self.mask_shape
        return s is not None and len(s) >= 2 and s[-2] == s[-1] and s[-2] > 1


def attention_kind(name: str) -> str:
    """``"encoder.self_attn"``, ``"decoder.self_attn"``, ``"decoder.encoder_attn"``, ``"decoder.self_branch"``
    (MAtt): the stack and the attribute the module is stored under."""
    parts = [p for p in name.split(".") if p not in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")]
    stack = next((p for p in parts if p in ("encoder", "decoder")), parts[0] if parts else "")
    return f"{stack}.{parts[-1]}" if parts else name


class AttentionCalls:
    """Records every forward call of the attention modules of ``model`` (see :class:`AttentionCall`).

    Attention modules: ``nn.MultiheadAttention`` and fairseq's ``MultiheadAttention`` (and subclasses,
    such as the plugin's SDPA module). Usage::

        with AttentionCalls(model) as calls:
            model(**batch)
        calls.of_kind("decoder.self_attn")  # [AttentionCall(...), ...]

    The kernel calls are seen by wrapping ``torch.nn.functional.scaled_dot_product_attention`` and
    ``multi_head_attention_forward`` for the duration of the block (callers look them up there at
    call time, torch's own ``multi_head_attention_forward`` included), not with a ``TorchFunctionMode``:
    function modes are not active in the backward pass, where ``--checkpoint-activations`` re-runs
    the layers.
    """

    def __init__(self, model: nn.Module) -> None:
        from fairseq.modules.multihead_attention import MultiheadAttention

        self.modules = {
            name: m for name, m in model.named_modules() if isinstance(m, (MultiheadAttention, nn.MultiheadAttention))
        }
        self.calls: List[AttentionCall] = []
        self._stack: List[AttentionCall] = []
        self._handles: list = []
        self._saved: Dict[str, Callable] = {}

    def __enter__(self) -> AttentionCalls:
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(self._pre(name)))
            self._handles.append(module.register_forward_hook(self._post))
        self._saved = {
            "scaled_dot_product_attention": F.scaled_dot_product_attention,
            "multi_head_attention_forward": F.multi_head_attention_forward,
        }
        F.scaled_dot_product_attention = self._sdpa
        F.multi_head_attention_forward = self._mha
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(F, name, fn)
        self._saved = {}
        for h in self._handles:
            h.remove()
        self._handles = []

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
        call = self._stack[-1] if self._stack else None
        if call is not None:
            call.path = "sdpa"
            call.is_causal = bool(is_causal)
            call.mask_shape = tuple(attn_mask.shape) if attn_mask is not None else None
            call.query_shape = tuple(query.shape)
        return self._saved["scaled_dot_product_attention"](
            query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs
        )

    def _mha(self, *args, **kwargs):
        out = self._saved["multi_head_attention_forward"](*args, **kwargs)
        call = self._stack[-1] if self._stack else None
        if call is not None:  # the kernel call inside (if any) recorded its mask; the path is torch's module one
            call.path = "mha"
            call.query_shape = tuple(args[0].shape)
        return out

    def _pre(self, name: str):
        def hook(_module, _inputs) -> None:
            call = AttentionCall(module=name, kind=attention_kind(name))
            self._stack.append(call)
            self.calls.append(call)

        return hook

    def _post(self, _module, _inputs, _output) -> None:
        self._stack.pop()

    def of_kind(self, kind: str) -> List[AttentionCall]:
        return [c for c in self.calls if c.kind == kind]

    def kinds(self) -> List[str]:
        return sorted({c.kind for c in self.calls})


__all__ = ["FUSED", "NO_KERNEL", "AttentionCall", "AttentionCalls", "OpCounter", "attention_kind", "launches_kernel"]
