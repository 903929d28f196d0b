#!/usr/bin/env bash
# The main job: set-up, then the compiler's stages on the seed example, then the whole
# path on Kiln's default farm setting (a cold compile, in process or on the farm of
# `kiln farm up` if one is up, and a second process that hits the store and compiles
# nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m kiln.frontend.cli.demo
exec .venv/bin/python -m kiln.frontend.cli.demo farm
