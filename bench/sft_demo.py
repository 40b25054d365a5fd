"""SFT on the embedded demo (issue 45): the demo's pretrained policy against the same policy fine-tuned on
``demo/sft.jsonl`` by the ``sft`` stage, by the hidden gold rubric on the 64 held-out prompts.

``.venv/bin/python -m bench.sft_demo [--demo-world DIR] [--learning-rate LR] [--epochs N]``: runs the ``sft`` stage of
``configs/demo.yaml`` with ``sft.data`` (the stage itself, as a campaign's first command runs it) into a fresh
``bench/.scratch/sft-demo``, then samples every held-out prompt ``--samples`` times from each policy (temperature 1,
the same seeds for both) and prints their mean gold score and the share of finished sentences. ``--demo-world``: a
built demo world to copy rather than build one (its pretraining takes minutes).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.common import REPO, SCRATCH
from campaign.config import load_config
from campaign.identity import demo_world_dir
from demo.gold import gold_score
from demo.world import load_prompts
from flows.iterations import context_for, resolve_base, tracking_store
from rlhf_core.config import SamplingConfig
from rlhf_core.generation import generate
from tasks.sft import sft
from tasks.text import load_tokenizer


def gold_of(folder: Path, prompts: list[str], *, samples: int) -> tuple[float, float]:
    """Mean gold score of ``samples`` responses to each prompt, and the share that are one finished sentence."""
    tokenizer = load_tokenizer(str(folder))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    encoded = tokenizer(prompts, padding=True, return_tensors="pt")
    scores, finished = [], []
    for seed in range(samples):
        generation = generate(
            model, encoded["input_ids"], encoded["attention_mask"],
            config=SamplingConfig(max_new_tokens=16, temperature=1.0), eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        responses = tokenizer.batch_decode(
            generation.sequences[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True
        )
        for prompt, response in zip(prompts, responses, strict=True):
            scores.append(gold_score(prompt, response.strip()))
            words = response.split()
            finished.append(bool(words) and words[-1] == "." and words.count(".") == 1)
    return statistics.mean(scores), sum(finished) / len(finished)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sft_demo")
    parser.add_argument("--demo-world", type=Path, default=None)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = SCRATCH / "sft-demo"
    shutil.rmtree(root, ignore_errors=True)
    overrides = [
        f"run_root={root}", "campaign=demo-sft", f"sft.data={REPO / 'demo' / 'sft.jsonl'}",
        f"sft.learning_rate={args.learning_rate}", f"sft.epochs={args.epochs}", "execution.torch_threads=1",
    ]  # fmt: skip
    config = load_config(REPO / "configs" / "demo.yaml", overrides)
    if args.demo_world is not None:
        shutil.copytree(args.demo_world, demo_world_dir(config))
    base = resolve_base.fn(config)
    tracker = tracking_store(config).tracker()
    started = time.perf_counter()
    tuned = sft.run(context_for(config, 0, base, tracker.experiment_id(config.campaign)), config)
    seconds = time.perf_counter() - started
    prompts = load_prompts(Path(base.eval_prompts.path))
    print(
        f"sft: {tuned.metrics['optimizer_steps']:.0f} steps in {seconds:.1f} s, train_loss {tuned.metrics['train_loss']:.3f}"
    )
    print("| policy | mean gold score | finished sentences |\n| --- | ---: | ---: |")
    for name, folder in (("pretrained", Path(base.policy.path)), ("SFT", tuned.directory / "actor")):
        gold, finished = gold_of(folder, prompts, samples=args.samples)
        print(f"| {name} | {gold:+.3f} | {finished:.2f} |")


if __name__ == "__main__":
    main()
