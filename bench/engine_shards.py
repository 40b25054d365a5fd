"""The generation engine asked for a whole shard per request against ``sampling.batch_size`` prompts per request
(issue 33), on the CPU engine.

    RLHF_VLLM_ENV=/path/to/.venv-vllm PYTHONPATH=$PWD .venv/bin/python -m bench.engine_shards [--skip-smollm2]

For the tiny Llama (:func:`bench.engine_probe.tiny_llama`) and then SmolLM2-135M-Instruct, one engine start each
(the one the ``rlhf`` command starts: compiled, CPU, fp32), the same rows, 32 chat prompts x 4 samples of at most 12
tokens (``configs/smollm2.yaml``'s rollout: temperature 1, each row its own seed), are sampled as the stages sample a
shard: in requests of ``batch_size`` 8 prompts (32 rows), or in one request of the whole shard (128 rows,
:class:`tasks.sampler.WholeShards`). The two alternate, each three times (other seeds each round), after one
unmeasured warm-up request; tokens per second of sampled tokens, median of the rounds. Each round also checks both
ways sampled the same tokens for the same seeds. Prints the figures and writes ``bench/.scratch/engine_shards.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.common import SCRATCH, machine
from bench.engine_probe import tiny_llama
from bench.vllm_engine import _config, chat_prompts, smollm2_folder

PROMPTS, SAMPLES, TOKENS, BATCH, ROUNDS = 32, 4, 12, 8, 3


def measure(policy: Path) -> dict:
    """Tokens per second of one shard sampled batch by batch and whole, on one engine start."""
    from rlhf_core.config import SamplingConfig
    from runtime.engine import EngineStartError, ensure_engine, stop_engine
    from runtime.engine_client import ServedPolicy
    from tasks.tensors import encode_prompts, prompt_token_lists
    from tasks.text import load_tokenizer, read_prompts

    scratch = SCRATCH / "engine-shards"
    scratch.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(str(policy))
    chosen = read_prompts(chat_prompts(PROMPTS, scratch / "prompts.jsonl"))
    rows = [row for row in prompt_token_lists(*encode_prompts(tokenizer, chosen)) for _ in range(SAMPLES)]
    sampling = SamplingConfig(max_new_tokens=TOKENS, temperature=1.0, batch_size=BATCH)
    config = _config(policy, scratch / "prompts.jsonl", scratch / "runs", "sampling.engine=vllm")
    started = time.perf_counter()
    try:
        url = ensure_engine(config.execution, precision="fp32", lora_rank=None, policy=str(policy))
    except EngineStartError as error:
        return {"refused": str(error)}
    result: dict = {"model": policy.name, "start_seconds": time.perf_counter() - started, "rounds": []}
    served, eos = ServedPolicy(url, str(policy)), tokenizer.eos_token_id
    try:
        served.sample(rows[:BATCH], list(range(BATCH)), config=sampling, eos_token_id=eos)  # warm-up
        per_request = BATCH * SAMPLES
        for round_ in range(ROUNDS):
            seeds = [10_000 * (round_ + 1) + row for row in range(len(rows))]
            started = time.perf_counter()
            batched: list[list[int]] = []
            for start in range(0, len(rows), per_request):
                tokens, _ = served.sample(
                    rows[start : start + per_request], seeds[start : start + per_request], config=sampling,
                    eos_token_id=eos,
                )  # fmt: skip
                batched += tokens
            batched_seconds = time.perf_counter() - started
            started = time.perf_counter()
            whole, _ = served.sample(rows, seeds, config=sampling, eos_token_id=eos)
            whole_seconds = time.perf_counter() - started
            count = sum(map(len, whole))
            result["rounds"].append(
                {
                    "tokens": count,
                    "batched_tokens_per_second": sum(map(len, batched)) / batched_seconds,
                    "whole_tokens_per_second": count / whole_seconds,
                    "same_tokens": batched == whole,
                }
            )
    finally:
        stop_engine()
    for side in ("batched", "whole"):
        result[side] = statistics.median(r[f"{side}_tokens_per_second"] for r in result["rounds"])
    result["speedup"] = result["whole"] / result["batched"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-smollm2", action="store_true")
    arguments = parser.parse_args()
    if not os.environ.get("RLHF_VLLM_ENV"):
        raise SystemExit("set RLHF_VLLM_ENV to the engine's environment (bash scripts/setup-vllm.sh makes .venv-vllm)")
    figures = {"machine": machine(), "load_average_start": os.getloadavg(), "models": []}
    for policy in [tiny_llama()] + ([] if arguments.skip_smollm2 else [smollm2_folder()]):
        figures["models"].append(measure(policy))
        print(json.dumps(figures["models"][-1], indent=2), flush=True)
    figures["load_average_end"] = os.getloadavg()
    (SCRATCH / "engine_shards.json").write_text(json.dumps(figures, indent=2))
    for model in figures["models"]:
        if "refused" in model:
            print(f"{model}: refused", file=sys.stderr)
            continue
        print(
            f"{model['model']}: batch by batch {model['batched']:.1f} tok/s, whole shard {model['whole']:.1f} tok/s "
            f"({model['speedup']:.2f}x); the same tokens: {all(r['same_tokens'] for r in model['rounds'])}"
        )


if __name__ == "__main__":
    main()
