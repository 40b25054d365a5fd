"""``python -m demo [--cache-dir DIR] [--seed N]``: build (or reuse) the demo world and show what its LM writes.

Prints a few samples from held-out prompts with their gold scores, then the mean gold score of
64 samples: the number that RLHF on this world should raise.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from demo.build import build_default_world
from demo.gold import gold_score
from demo.world import DEFAULT_CACHE_DIR, DemoWorld, load_prompts
from rlhf_core.config import SamplingConfig
from rlhf_core.generation import generate

NUM_SHOWN, NUM_SCORED = 8, 64


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, build the world, sample and print."""
    parser = argparse.ArgumentParser(
        prog="python -m demo", description="Build (or reuse) the demo world and show what its LM writes."
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR, help=f"default: {DEFAULT_CACHE_DIR}")
    parser.add_argument("--seed", type=int, default=0, help="world seed (default: 0)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    started = time.perf_counter()
    world = build_default_world(args.cache_dir, seed=args.seed)
    print(f"demo world in {world.model_dir.parent} ({time.perf_counter() - started:.1f} s)")
    show(world, seed=args.seed)


def show(world: DemoWorld, *, seed: int) -> None:
    """Print samples of the world's LM on held-out prompts with their gold scores, then their mean gold score."""
    tokenizer = AutoTokenizer.from_pretrained(world.model_dir)
    model = AutoModelForCausalLM.from_pretrained(world.model_dir)
    prompts = load_prompts(world.eval_prompts_path)[:NUM_SCORED]
    encoded = tokenizer(prompts, padding=True, return_tensors="pt")
    generation = generate(
        model,
        encoded["input_ids"],
        encoded["attention_mask"],
        config=SamplingConfig(max_new_tokens=16, temperature=1.0),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(seed),
    )
    responses = tokenizer.batch_decode(
        generation.sequences[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True
    )
    scores = [gold_score(prompt, response) for prompt, response in zip(prompts, responses, strict=True)]

    print(f"\n{'gold':>6}  prompt | response")
    for prompt, response, score in list(zip(prompts, responses, scores, strict=True))[:NUM_SHOWN]:
        print(f"{score:+6.2f}  {prompt} | {response}")
    print(
        f"\nmean gold score of {len(scores)} samples: {statistics.mean(scores):+.3f} (std {statistics.stdev(scores):.3f})"
    )


if __name__ == "__main__":
    main()
