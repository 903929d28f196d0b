#!/usr/bin/env bash
# The main job on the embedded default: set-up, then the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m frontend.demo "$@"
