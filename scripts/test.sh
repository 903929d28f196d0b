#!/usr/bin/env bash
# The test suite: set-up, then every test that needs no GPU (tests/gpu skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"
