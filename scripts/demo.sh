#!/usr/bin/env bash
# The main job on the embedded default: set-up, then the compiler's stages on the seed
# example, then the whole path (a cold compile through the local Ray farm, and a second
# process that hits the store and compiles nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m kiln.frontend.cli.demo
exec .venv/bin/python -m kiln.frontend.cli.demo farm
