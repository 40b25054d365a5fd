#!/usr/bin/env bash
# The README's test command: set up if needed, then run the default (CPU) suite on three worker processes
# (pytest-xdist; each computes on one torch thread; a third keeps a 2-core machine's cores busy while a worker waits
# on a command or server it started: 773 s against 818 s with two, bench/TEST_DURATIONS.md). A module's tests stay on
# one worker, so its module-scoped fixtures are built once; campaigns several modules read are built once per run
# (tests/flows/campaigns.py). RLHF_TEST_WORKERS sets the number of workers (0: everything in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n "${RLHF_TEST_WORKERS:-3}" --dist loadfile "$@"
