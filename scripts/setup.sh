#!/usr/bin/env bash
# Idempotent set-up of .venv (Python 3.11) with the pinned stack and this package.
# Used by the README's two commands and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
stamp=.venv/.deepinit-deps
want=$(cat requirements/*.txt | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing pinned dependencies into .venv (first run: about 2 minutes)"
  "${PIP[@]}" -r requirements/torch.txt
  "${PIP[@]}" -r requirements/lock.txt
  "${PIP[@]}" --no-deps --require-hashes -r requirements/fairseq.txt
  "${PIP[@]}" --no-deps --require-hashes -r requirements/ctranslate2.txt  # deepinit-export --to ctranslate2
  "${PIP[@]}" --no-deps --require-hashes -r requirements/huggingface.txt  # deepinit-export --to huggingface
  "${PIP[@]}" --no-deps --require-hashes -r requirements/onnx.txt  # benchmarks/onnx_check.py
  echo "$want" > "$stamp"
fi
# Non-editable on purpose: fairseq resolves `--user-dir fairseq_deepinit` next to its own
# site-packages folder, so the plain name works from any directory. The plugin only: the research
# tools (deepinit_tools/) run from the checkout. setuptools' build/ is cleared first, or a module
# (or package) removed from the checkout would still be installed from its stale copy there.
rm -rf build
"${PIP[@]}" --no-deps --no-build-isolation --force-reinstall . >/dev/null
