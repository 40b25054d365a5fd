#!/usr/bin/env bash
# The README's test command: set up if needed, then run the default (CPU) suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
