#!/usr/bin/env bash
# The test suite: set-up, then every test that needs no GPU (tests/gpu skip without CUDA).
# Triton's interpreter is chosen when Triton is first imported, so the tests that run
# Triton kernels on CPU tensors (tests/triton_interp) get a pytest process of their own,
# which runs beside the main one; the main one spreads its files over pytest-xdist
# workers (tests/farm, which shares one Ray cluster, is one worker's unit: see
# tests/conftest.py). Both print one line per test file as it finishes
# (tests/file_progress.py), then their summaries.
# Every temporary file (pytest's, Ray's, the tests' stores) goes to one folder that is
# removed at the end, so nothing is left in /tmp.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cpus="$(nproc)"
workers=$(( cpus < 2 ? 2 : (cpus > 8 ? 8 : cpus) ))
echo "kiln tests: 15 to 25 minutes on 2 cores (tests/gpu skip without CUDA); one line per" \
     "file as it finishes, $workers workers beside the Triton-interpreter run"
# short: Ray's socket paths under it must fit 107 bytes
scratch="$(mktemp -d "${TMPDIR:-/tmp}/kt.XXXXXX")"
interp=""
cleanup() {
  if [ -n "$interp" ]; then kill "$interp" 2>/dev/null || true; wait "$interp" 2>/dev/null || true; fi
  rm -rf "$scratch"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
export TMPDIR="$scratch" RAY_TMPDIR="$scratch"
# The suite starts hundreds of Python processes (clients, ranks, Ray workers, the CLI):
# each would compile Kiln's modules from source again where the environment says never
# to write bytecode.
unset PYTHONDONTWRITEBYTECODE
status=0
# The interpreter's run: its report goes to a log, shown after the main run's; its
# per-file lines come here through file descriptor 3. It is the shorter of the two, so it
# runs at a lower priority: the main run, the longer, gets the cores when both want them.
exec 3>&1
TRITON_INTERPRET=1 nice -n 10 .venv/bin/python -m pytest tests/triton_interp -p no:cacheprovider \
  --file-progress=3 -o console_output_style=classic "$@" >"$scratch/interp.log" 2>&1 &
interp=$!
.venv/bin/python -m pytest tests --ignore=tests/triton_interp -p no:cacheprovider \
  -n "$workers" --no-loadscope-reorder --file-progress \
  -o console_output_style=classic "$@" || status=$?
wait "$interp" || status=$?
interp=""
echo
echo "== tests/triton_interp (TRITON_INTERPRET=1, run beside the above) =="
cat "$scratch/interp.log"
exit $status
