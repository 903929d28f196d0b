#!/usr/bin/env bash
# The test suite: set-up, then every test that needs no GPU (tests/gpu skip without CUDA).
# Triton's interpreter is chosen when Triton is first imported, so the tests that run
# Triton kernels on CPU tensors (tests/triton_interp) get a pytest process of their own.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0
.venv/bin/python -m pytest tests --ignore=tests/triton_interp -p no:cacheprovider "$@" || status=$?
TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/triton_interp -p no:cacheprovider "$@" \
  || status=$?
exit $status
