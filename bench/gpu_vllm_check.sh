#!/usr/bin/env bash
# Issue 24 on a GPU: the official vLLM engine (CUDA) end to end, then the SmolLM2 generation benchmark.
# Needs: an NVIDIA GPU; the project's .venv with a CUDA torch (TORCH_SPEC='torch==2.13.0' from the CUDA index when
# it was made); and the official vllm for .venv-vllm (scripts/setup-vllm.sh installs vllm==0.32.0 when nvidia-smi
# answers; point PIP_FIND_LINKS at a wheel folder where the machine cannot reach PyPI).
# Run from anywhere: bash bench/gpu_vllm_check.sh   (about 10 minutes; prints what to paste into bench/RESULTS.md)
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'the project .venv has no CUDA torch'"
bash scripts/setup-vllm.sh
.venv-vllm/bin/python -c "import torch, vllm; assert torch.cuda.is_available(); print('vllm', vllm.__version__)"
export PYTHONPATH="$PWD" RLHF_VLLM_GPU=1
# The tiny campaign on the engine (GAE, GRPO, LoRA, Dask, kill -9), on CUDA (device auto).
.venv/bin/python -m pytest -m vllm tests/flows/test_vllm_engine.py -q
# Tokens per second, hf against vllm at equal work, and one whole iteration each.
.venv/bin/python -m bench.vllm_engine --skip-sizes --iteration
