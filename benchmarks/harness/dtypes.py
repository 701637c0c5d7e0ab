"""Which dtype each matrix product ran in: a dtype audit of a forward or backward pass.

:class:`MatmulDtypes` is a ``TorchDispatchMode``: it sees every aten op after autocast has chosen its
dtype and after autograd has expanded the backward (``F.linear`` arrives as ``addmm`` / ``mm``, the
backward of a Linear as two ``mm``), on the CPU and on CUDA alike. It counts the matrix-product
family (``MATMUL_OPS``, and every scaled-dot-product-attention kernel and its backward) by op and by
the dtype of the op's result, and passes every op through unchanged::

    with MatmulDtypes() as audit:
        loss.backward()
    assert set(audit.by_dtype()) == {torch.bfloat16}, audit.counts

Under bf16 autocast every matrix product of the forward and backward should be bf16; an fp32 entry
names a product that left the low-precision path (on a GPU: the tensor cores).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten overload packets of matrix products (F.linear and torch.matmul decompose into these)
MATMUL_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_addmm_activation", "mv", "addmv", "dot"}
)


def is_matmul(op_name: str) -> bool:
    """``op_name``: an aten op's base name (``"addmm"``, ``"_scaled_dot_product_flash_attention_for_cpu"``)."""
    return op_name in MATMUL_OPS or "scaled_dot_product" in op_name


class MatmulDtypes(TorchDispatchMode):
    """Counts matrix-product aten ops by ``(op name, result dtype)`` while active (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[Tuple[str, torch.dtype]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::", 1)[-1]
        if is_matmul(name):
            result = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(result, torch.Tensor):
                self.counts[(name, result.dtype)] += 1
        return out

    def by_dtype(self) -> Counter[torch.dtype]:
        """Number of matrix products per result dtype."""
        total: Counter[torch.dtype] = Counter()
        for (_, dtype), n in self.counts.items():
            total[dtype] += n
        return total

    def of_dtype(self, dtype: torch.dtype) -> Counter[str]:
        """Number of matrix products per op name that produced ``dtype``."""
        return Counter({name: n for (name, d), n in self.counts.items() if d == dtype})

    def summary(self) -> dict[str, Any]:
        """``{"bfloat16": {"addmm": 26, "mm": 72}, ...}``, for a report or an assertion message."""
        out: dict[str, dict[str, int]] = {}
        for (name, dtype), n in sorted(self.counts.items(), key=lambda kv: (str(kv[0][1]), kv[0][0])):
            out.setdefault(str(dtype).replace("torch.", ""), {})[name] = n
        return out
