"""What gpu_smoke.py counts on every step: the attention path each call took (SDPA backend, mask) and the
host synchronisations (on the CPU: the reads a GPU would wait for)."""

from __future__ import annotations

import contextlib
import warnings
from typing import Dict, Iterator

from deepinit_tools.harness.host_reads import HostReads

SDPA_OPS = {  # aten op the SDPA dispatcher chose -> backend name
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_fused_attention_overrideable": "fused",
}


# ---------------------------------------------------------------------------------------------
# what is counted


class _Recorder:
    """Which SDPA backend each attention kind dispatched to; see the module doc."""

    def __init__(self) -> None:
        self.kind: str | None = None  # the attention module running now (forward hooks)
        self.module_calls = 0  # SDPA calls inside the current attention module
        self.fused: str | None = None  # backend op seen inside the current SDPA call
        self.backends: Dict[str, Dict[str, int]] = {}

    def note(self, kind: str, backend: str) -> None:
        per = self.backends.setdefault(kind, {})
        per[backend] = per.get(backend, 0) + 1


@contextlib.contextmanager
def record_attention(model, rec: _Recorder) -> Iterator[None]:
    """Hooks on every fairseq MultiheadAttention (the kind), a function mode on SDPA calls (math when no
    fused op ran inside) and a dispatch mode on aten ops (the fused backend)."""
    import torch
    import torch.nn.functional as F
    from fairseq.modules import MultiheadAttention
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    sdpa = F.scaled_dot_product_attention  # torch's own (counters wrap the module attribute)

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is not sdpa:
                return func(*args, **(kwargs or {}))
            rec.fused = None
            out = func(*args, **(kwargs or {}))
            rec.module_calls += 1
            rec.note(rec.kind or "outside attention modules", rec.fused or "math")
            return out

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._overloadpacket.__name__
            if name in SDPA_OPS:
                rec.fused = SDPA_OPS[name]
            return func(*args, **(kwargs or {}))

    handles = []
    for path, mod in model.named_modules():
        if isinstance(mod, MultiheadAttention):
            parts = path.split(".")
            stack = next((p for p in parts if p in ("encoder", "decoder")), "model")
            kind = f"{stack} {parts[-1]}"

            def pre(_m, _a, kind=kind):
                rec.kind, rec.module_calls = kind, 0

            def post(_m, _a, _o, kind=kind):
                if rec.module_calls == 0:
                    rec.note(kind, "fairseq")
                rec.kind = None

            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        with Functions(), Ops():
            yield
    finally:
        for h in handles:
            h.remove()
        del torch  # (imported for the modes' sake only)


@contextlib.contextmanager
def count_host_syncs(device: str) -> Iterator[dict]:
    """Host syncs of the ``with`` block into the yielded dict's ``n``.

    CUDA: the warnings of ``torch.cuda.set_sync_debug_mode("warn")``, one per synchronizing call.
    CPU: the host reads a GPU would wait for (``harness.host_reads.HostReads``, the CPU standing in
    for the device).
    """
    import torch

    box = {"n": 0}
    if device == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield box
            finally:
                torch.cuda.set_sync_debug_mode("default")
        box["n"] = sum("synchroniz" in str(w.message) for w in caught)
    else:
        with HostReads() as reads:
            yield box
        box["n"] = reads.count()
