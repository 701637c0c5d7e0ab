#!/usr/bin/env bash
# The README's test command (CI: .ci/run): set up .venv (idempotent), lint, run every test on CPU (the
# fast tier and the slow one: pytest -m "not slow" is the fast tier alone), then the floating-point tests
# (pytest -m numerics) again on a second CPU kernel path, so that a tolerance that holds only on this
# machine's kernels fails here rather than on a user's machine. Both passes run on TEST_WORKERS pytest-xdist
# processes (default 2, one torch thread each; 0 runs in this process).
# The second pass takes the fast tier's floating-point tests (the formulas against their references) and the
# slow ones marked kernel_checked (trained models whose margins depend on the kernels);
# DEEPINIT_SECOND_KERNEL_PATH=all adds every slow floating-point test, =0 skips the second pass.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
workers=(-n "${TEST_WORKERS:-2}" --dist loadfile)  # a module on one worker: its module fixtures run once
.venv/bin/python -m pytest -q "${workers[@]}" --durations=25 tests "$@"
[ "${DEEPINIT_SECOND_KERNEL_PATH:-1}" = 0 ] && exit 0
# torch picks its vectorised kernels by ATEN_CPU_CAPABILITY and MKL its GEMMs by
# MKL_ENABLE_INSTRUCTIONS: an AVX-512 machine re-runs as an AVX2-only CPU would, any other machine
# on the portable (non-vectorised ATen, SSE4.2 MKL) path; CTranslate2 (deepinit-export's tests) picks its
# kernels by CT2_FORCE_CPU_ISA
native=$(.venv/bin/python -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
if [ "$native" = AVX512 ]; then
  second=(ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 CT2_FORCE_CPU_ISA=AVX2)
else
  second=(ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 CT2_FORCE_CPU_ISA=GENERIC)
fi
marker="numerics and (not slow or kernel_checked)"
[ "${DEEPINIT_SECOND_KERNEL_PATH:-1}" = all ] && marker=numerics
echo "[test] floating-point tests ($marker) again on a second CPU kernel path (native: $native): ${second[*]}"
exec env "${second[@]}" .venv/bin/python -m pytest -q "${workers[@]}" -m "$marker" tests "$@"
