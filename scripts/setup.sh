#!/usr/bin/env bash
# Create the project's virtual environment in .venv: the CPU build of torch first (a plain
# `torch` requirement would pull a multi-GB CUDA build), then the project, its dev tools and its scale-out
# engines (Dask, Ray: the tests start both) and TextArena (the environment adapter's test plays its games).
# Idempotent: does nothing when .venv already matches pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)

if [ -f "$stamp" ]; then
    exit 0
fi
echo "setting up .venv (one time, a few minutes)..."
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
quiet_pip() {
    # pip warns about every missing local index folder on this machine; show everything else.
    local log status=0
    log=$(mktemp)
    .venv/bin/python -m pip install --disable-pip-version-check -q "$@" >"$log" 2>&1 || status=$?
    grep -v "is ignored: it is neither a file nor a directory" "$log" || true
    rm -f "$log"
    return "$status"
}
quiet_pip "$TORCH_SPEC"
quiet_pip -e ".[dev,scale,textarena]"
.venv/bin/python -c "import prefect.server.api.server, mlflow, torch, transformers" # fastapi/prefect break is caught here
rm -f .venv/.installed-*
touch "$stamp"
echo ".venv ready: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
