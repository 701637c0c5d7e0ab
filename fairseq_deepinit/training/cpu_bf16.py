"""Does this CPU compute bf16 natively? ``--autocast-bf16`` on a CPU pays off only where it does.

Native means both: torch's oneDNN has bf16 kernels here (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``)
and the CPU has bf16 instructions (x86: ``avx512_bf16`` or ``amx_bf16`` among the flags of
``/proc/cpuinfo``; Arm: ``bf16`` among its features). On x86, torch's check alone also answers yes for
AVX-512 CPUs without bf16 instructions, where oneDNN emulates bf16 and autocast is slower than fp32.

Native is not enough to be faster: on an AVX512-BF16 CPU without AMX the quickstart's model trained 6-18 %
slower per CPU second in bf16 autocast than in fp32 (docs/quickstart.md, "Precision"), so the quickstart's
``PRECISION=auto`` (:func:`autocast_pays_off`) takes bf16 only where the CPU also has AMX's bf16 tiles.
``python fairseq_deepinit/training/cpu_bf16.py`` prints that choice, ``bf16 <why>`` or ``fp32 <why>``; it
imports torch only.
"""

from __future__ import annotations

from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
NATIVE_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 flags, then the Arm feature


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str] | None:
    """The first processor's flags (x86 ``flags``, Arm ``Features``), or None where not readable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def native_bf16(cpuinfo: Path = CPUINFO) -> tuple[bool, str]:
    """``(native, why)``: whether bf16 autocast runs on native bf16 instructions of this CPU, and why not."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False, "torch's oneDNN reports no bf16 support on this CPU"
    flags = cpu_flags(cpuinfo)
    if flags is None:
        return False, f"cannot read the CPU flags ({cpuinfo}), so bf16 may be emulated"
    native = [f for f in NATIVE_FLAGS if f in flags]
    if not native:
        return False, "the CPU has no bf16 instructions (avx512_bf16, amx_bf16): oneDNN would emulate bf16"
    return True, f"torch's oneDNN has bf16 kernels and the CPU has {', '.join(native)}"


def autocast_pays_off(cpuinfo: Path = CPUINFO) -> tuple[bool, str]:
    """``(bf16, why)``: the quickstart's ``PRECISION=auto``, bf16 autocast where bf16 is native and runs on AMX."""
    native, why = native_bf16(cpuinfo)
    if not native:
        return False, why
    if "amx_bf16" in (cpu_flags(cpuinfo) or set()):
        return True, why
    return False, (
        "bf16 is native but the CPU has no AMX: the quickstart's model trained slower in bf16 autocast than in fp32 "
        "on such a CPU (docs/quickstart.md, Precision)"
    )


if __name__ == "__main__":
    ok, why = autocast_pays_off()
    print("bf16" if ok else "fp32", why)
