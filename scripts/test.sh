#!/usr/bin/env bash
# The test suite: set-up, then every test that needs no GPU (tests/gpu skip without CUDA).
# Triton's interpreter is chosen when Triton is first imported, so the tests that run
# Triton kernels on CPU tensors (tests/triton_interp) get a pytest process of their own.
# Every temporary file (pytest's, Ray's, the tests' stores) goes to one folder that is
# removed at the end, so nothing is left in /tmp.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "kiln tests: 30 to 45 minutes on 2 cores (tests/gpu skip without CUDA); one line per" \
     "file as it runs"
# short: Ray's socket paths under it must fit 107 bytes
scratch="$(mktemp -d "${TMPDIR:-/tmp}/kt.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
trap 'exit 130' INT TERM
export TMPDIR="$scratch" RAY_TMPDIR="$scratch"
status=0
.venv/bin/python -m pytest tests --ignore=tests/triton_interp -p no:cacheprovider "$@" || status=$?
TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/triton_interp -p no:cacheprovider "$@" \
  || status=$?
exit $status
