"""Which path every attention call takes: ``F.scaled_dot_product_attention``, torch's
``F.multi_head_attention_forward`` or fairseq's explicit ``bmm``/``softmax``, with its ``is_causal`` and
the shape of any mask it materialised (:class:`AttentionCalls`, per attention-module call).

Reusable by tests and benchmark scripts (``from deepinit_tools.harness.attention_calls import
AttentionCalls``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List

import torch.nn as nn
import torch.nn.functional as F


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
    self_attention: bool = False  # the module's own flag (fairseq's MultiheadAttention)
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
        def hook(module, _inputs) -> None:
            call = AttentionCall(name, attention_kind(name), bool(getattr(module, "self_attention", False)))
            self._stack.append(call)
            self.calls.append(call)

        return hook

    def _post(self, _module, _inputs, _output) -> None:
        self._stack.pop()

    def of_kind(self, kind: str) -> List[AttentionCall]:
        return [c for c in self.calls if c.kind == kind]

    def kinds(self) -> List[str]:
        return sorted({c.kind for c in self.calls})

    def self_attention(self, stack: str | None = None) -> List[AttentionCall]:
        """The self-attention calls (of ``stack``: ``encoder`` / ``decoder``)."""
        return [c for c in self.calls if c.self_attention and (stack is None or c.kind.split(".")[0] == stack)]


__all__ = ["AttentionCall", "AttentionCalls", "attention_kind"]
