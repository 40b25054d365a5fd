"""The probe gate's cost per weight swap, and the gap between engine and trainer it must tolerate in fp32 and bf16
(issue 36).

    PYTHONPATH=$PWD .venv/bin/python -m bench.engine_probe                  # the tiny Llama, then SmolLM2-135M
    PYTHONPATH=$PWD .venv/bin/python -m bench.engine_probe --skip-smollm2

For each model and precision the engine the ``rlhf`` command starts (eager, CPU) serves the policy, and:

1. the gate's probe batch (4 chat prompts, 16 sampled tokens each: what ``tasks.sampler.make_probe`` makes) is scored
   by the trainer (``runtime.engine_probe.trainer_logprobs`` under the precision's autocast, the actor's fp32
   weights) and by the engine (``POST /score``); the gate's cost per swap is the engine's scoring (each swap) plus the
   trainer's side (once per weights and process);
2. a swap: the engine alternates between the policy's folder and a copy of it (a reload each time), and the
   request's own swap seconds are set beside the probe's;
3. the gap the gate must tolerate: the largest ``|engine - trainer|`` over a wider batch (16 prompts x 32 tokens), with
   its 99th percentile and mean, where both sides hold the same weights.

Prints the figures and writes them to ``bench/.scratch/engine_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from bench.common import SCRATCH, machine
from bench.vllm_engine import _config, chat_prompts, smollm2_folder

THREADS = 2


def tiny_llama() -> Path:
    """The engine tests' tiny Llama (2 layers, hidden 128, head size 64) with a tied output layer, and SmolLM2's
    tokenizer cut to its vocabulary (only the shape matters here)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    target = SCRATCH / "probe-tiny-llama"
    if (target / "config.json").is_file():
        return target
    from tasks.text import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_folder()))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def probe_of(model, tokenizer, prompts, *, tokens: int, loader):
    """A probe batch as ``tasks.sampler.make_probe`` makes one: the prompts with a response the project's sampler
    draws from ``model`` at temperature 1."""
    import torch

    from rlhf_core.config import SamplingConfig
    from rlhf_core.generation import generate
    from runtime.engine_probe import Probe
    from tasks.tensors import encode_prompts, prompt_token_lists, response_token_lists

    ids, mask = encode_prompts(tokenizer, prompts)
    config = SamplingConfig(max_new_tokens=tokens, temperature=1.0, batch_size=len(prompts))
    with loader.autocast():
        out = generate(
            model, ids, mask, config=config, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
    responses = response_token_lists(out.sequences, out.action_mask)
    return Probe(tuple(map(tuple, prompt_token_lists(ids, mask))), tuple(map(tuple, responses)))


def measure(policy: Path, precision: str) -> dict:
    """Sections 1-3 for one model and precision (one engine start)."""
    import torch

    from rlhf_core.loading import ModelLoader
    from runtime.engine import EngineStartError, ensure_engine, stop_engine
    from runtime.engine_client import ServedPolicy, engine_score
    from runtime.engine_probe import PROBE_SIZES, gated_policy, probe_gap
    from tasks.text import load_tokenizer, read_prompts

    torch.set_num_threads(THREADS)
    scratch = SCRATCH / "engine_probe"
    scratch.mkdir(parents=True, exist_ok=True)
    prompts = read_prompts(chat_prompts(16, scratch / "prompts.jsonl"))
    config = _config(
        policy, scratch / "prompts.jsonl", scratch / "runs", "sampling.engine=vllm", "execution.engine_compile=false",
        "execution.device=cpu", f"precision={precision}",
    )  # fmt: skip
    start = time.perf_counter()
    try:
        url = ensure_engine(config.execution, precision=precision, lora_rank=None, policy=str(policy))
    except EngineStartError as error:
        return {"refused": str(error)}
    result: dict = {"model": policy.name, "precision": precision, "engine_start_seconds": time.perf_counter() - start}
    tokenizer = load_tokenizer(str(policy))
    loader = ModelLoader(device=torch.device("cpu"), precision=precision)
    actor = loader.load("actor", policy)
    served = ServedPolicy(url, str(policy))
    # 1. the gate's own probe: the trainer's side once, the engine's at each swap
    probe_prompts, probe_tokens = PROBE_SIZES[precision]
    probe = probe_of(actor, tokenizer, prompts[:probe_prompts], tokens=probe_tokens, loader=loader)
    gate = gated_policy(served, actor, probe, models=loader, iteration=0)
    engine_score(served, probe.batch())  # the first request warms the engine's kernels up
    scores = [engine_score(served, probe.batch()) for _ in range(5)]
    result.update(
        probe_tokens=sum(len(response) for response in probe.responses),
        trainer_seconds=gate.trainer_seconds,
        engine_probe_seconds=statistics.median(score.seconds for score in scores),
        probe_gap=probe_gap(scores[0].logprobs, gate.expected),
        tolerance=gate.tolerance,
    )
    # 2. swaps: a copy of the folder and the folder, in turn
    copy = scratch / f"{policy.name}-copy"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(policy, copy)
    swaps = [engine_score(ServedPolicy(url, str(folder)), probe.batch()) for folder in (copy, policy) * 3]
    result.update(
        swap_seconds=statistics.median(answer.swap_seconds for answer in swaps),
        swap_probe_seconds=statistics.median(answer.seconds for answer in swaps),
        swap_gaps=max(probe_gap(answer.logprobs, gate.expected) for answer in swaps),
    )
    shutil.rmtree(copy, ignore_errors=True)
    # 3. the gap to tolerate, on a wider batch
    wide = probe_of(actor, tokenizer, prompts, tokens=32, loader=loader)
    wide_gate = gated_policy(served, actor, wide, models=loader, iteration=0)
    engine = engine_score(served, wide.batch()).logprobs
    differences = sorted(
        abs(e - t)
        for row_e, row_t in zip(engine, wide_gate.expected, strict=True)
        for e, t in zip(row_e, row_t, strict=True)
    )
    result.update(
        wide_tokens=len(differences),
        wide_gap=differences[-1],
        wide_p99=differences[int(0.99 * (len(differences) - 1))],
        wide_mean=sum(differences) / len(differences),
    )
    stop_engine()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-smollm2", action="store_true", help="the tiny Llama only")
    arguments = parser.parse_args()
    models = [tiny_llama()] + ([] if arguments.skip_smollm2 else [smollm2_folder()])
    results = {"machine": machine(), "runs": []}
    for policy in models:
        for precision in ("fp32", "bf16"):
            run = measure(policy, precision)
            print(json.dumps(run, indent=2), flush=True)  # noqa: T201
            results["runs"].append(run)
    (SCRATCH / "engine_probe.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
