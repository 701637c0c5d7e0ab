"""The CPU's bf16 verdicts: native only with oneDNN's bf16 kernels and bf16 instructions; the quickstart's
bf16 only where it is native and runs on AMX."""

import subprocess
import sys

import pytest
import torch

from conftest import USER_DIR
from fairseq_deepinit.training import cpu_bf16

X86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f avx512bw {extra}\n\nprocessor\t: 1\n"
ARM = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd sve {extra}\nCPU implementer\t: 0x41\n"


@pytest.fixture
def onednn(monkeypatch):
    """Set what torch's oneDNN answers: ``onednn(False)``."""
    return lambda answer: monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: answer)


CASES = [(X86, "avx512_bf16", True), (X86, "amx_bf16 amx_tile", True), (X86, "avx512vl", False),
         (ARM, "bf16 i8mm", True), (ARM, "", False)]  # fmt: skip


@pytest.mark.parametrize("text, extra, native", CASES)
def test_native_needs_bf16_instructions(tmp_path, onednn, text, extra, native):
    info = tmp_path / "cpuinfo"
    info.write_text(text.format(extra=extra))
    onednn(True)
    assert cpu_bf16.cpu_flags(info) >= set(extra.split())
    ok, why = cpu_bf16.native_bf16(info)
    assert ok is native
    assert (extra.split()[0] in why) if native else ("emulate" in why)


def test_no_onednn_bf16_or_no_flags_is_fp32(tmp_path, onednn):
    info = tmp_path / "cpuinfo"
    info.write_text(X86.format(extra="avx512_bf16"))
    onednn(False)
    assert cpu_bf16.native_bf16(info) == (False, "torch's oneDNN reports no bf16 support on this CPU")
    onednn(True)
    assert cpu_bf16.cpu_flags(tmp_path / "missing") is None
    ok, why = cpu_bf16.native_bf16(tmp_path / "missing")
    assert not ok and "cannot read the CPU flags" in why


@pytest.mark.parametrize("extra, bf16", [("avx512_bf16 amx_bf16 amx_tile", True), ("avx512_bf16", False), ("", False)])
def test_the_quickstart_takes_bf16_only_with_amx(tmp_path, onednn, extra, bf16):
    info = tmp_path / "cpuinfo"
    info.write_text(X86.format(extra=extra))
    onednn(True)
    ok, why = cpu_bf16.autocast_pays_off(info)
    assert ok is bf16
    assert ("no AMX" in why) is (extra == "avx512_bf16")


@pytest.mark.slow
def test_the_quickstarts_check_prints_its_choice():
    """``python fairseq_deepinit/training/cpu_bf16.py``: ``bf16|fp32 why``; an AVX2-only oneDNN says fp32."""
    script = [sys.executable, f"{USER_DIR}/training/cpu_bf16.py"]
    native = subprocess.run(script, capture_output=True, text=True, check=True).stdout.split(" ", 1)
    assert native[0] == ("bf16" if cpu_bf16.autocast_pays_off()[0] else "fp32")
    env = {"ONEDNN_MAX_CPU_ISA": "AVX2", "PATH": "/usr/bin:/bin"}
    avx2 = subprocess.run(script, capture_output=True, text=True, check=True, env=env).stdout
    assert avx2.startswith("fp32 torch's oneDNN reports no bf16")
