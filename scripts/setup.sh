#!/usr/bin/env bash
# Set up .venv: torch 2.13.0 first (the CPU build from local disk on Kiln's CPU machines;
# any looser torch requirement with no torch installed would pull a multi-GB CUDA build),
# then Kiln itself, editable, with its development extras.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# A .venv this script finished with the same pyproject.toml and script needs no pip run
# (scripts/test.sh runs this script each time; pip's no-op takes half a minute).
stamp=.venv/.kiln-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && .venv/bin/python -c "
import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ('kiln', 'torch', 'torchvision', 'xdist')))"; then
  exit 0
fi
rm -f "$stamp"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
  || .venv/bin/python -m pip install -q torch==2.13.0
# The model suite (bench/suite/, tests/cpu/test_model_suite.py) needs torchvision, which
# pins one torch release: 0.28.0 is torch 2.13.0's. Installed first and without its
# dependencies, so that neither it nor timm's unpinned requirement on it replaces the
# CPU torch (PyPI's torchvision is a CUDA build: its native ops do not load next to a
# CPU torch, and bench/suite/tv_shim.py lets its Python half import).
.venv/bin/python -m pip install -q --no-deps torchvision==0.28.0 pillow
.venv/bin/python -m pip install -q -e '.[dev]'
.venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" \
  || { echo "setup.sh: torch is no longer 2.13.0" >&2; exit 1; }
echo "$want" >"$stamp"
