#!/usr/bin/env bash
# Set up .venv: torch 2.13.0 first (the CPU build from local disk on Kiln's CPU machines;
# any looser torch requirement with no torch installed would pull a multi-GB CUDA build),
# then Kiln itself, editable, with its development extras.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
  || .venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[dev]'
