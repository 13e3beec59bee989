#!/usr/bin/env bash
# The main job: install, then train the MoE char-LM on the Python stdlib source.
# Extra arguments go to the example (e.g. --steps 1000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m fmoe.examples.charlm "$@"
