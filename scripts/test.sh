#!/usr/bin/env bash
# The README's test command: set up if needed, then run the default (CPU) suite on two worker processes
# (pytest-xdist; each worker computes on one torch thread, so two use both cores of a small machine). A module's tests
# stay on one worker, so its module-scoped fixtures are built once; campaigns several modules read are built once per
# run (tests/flows/campaigns.py). RLHF_TEST_WORKERS sets the number of workers (0: everything in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n "${RLHF_TEST_WORKERS:-2}" --dist loadfile "$@"
