"""Wall time of the tiny campaign (configs/tiny.yaml) in this process, with its shards on a local Dask cluster of
2 workers, and with 2 training processes (issue 11).

``python -m bench.scale_out --rounds 2`` builds a tiny random GPT-2 world (the tests' checkpoint world), then runs
the campaign once per variant and round, interleaved (local, dask, 2 processes, local, ...) so the load of a shared
machine falls on every variant alike, each from an empty run root under one temporary Prefect server, and prints
the median wall time of each and its ratio to local, plus the summed stage seconds of the fanned-out and the
training stages. Every variant uses ``sizes.rows_per_shard=8`` (2 shards of candidates and of rollouts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "local": [],
    "dask, 2 workers": ["execution.task_runner=dask", "execution.workers=2"],
    "2 training processes": ["execution.training_processes=2"],
}
FANNED_OUT = ("sample_candidates", "rollout", "evaluate")
TRAINING = ("train_reward_model", "ppo_update")


def build_world(root: Path) -> dict[str, Path]:
    """The tests' checkpoint world: a tiny random GPT-2 with the demo's word-level tokenizer, and prompt files."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    from demo.corpus import generate_prompts
    from demo.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

    train, held_out = generate_prompts(48, 16, seed=3)
    words = sorted({w for p in train + held_out for w in p.split()} | {".", "happy", "sad", "warm", "cold"})
    tokenizer = build_tokenizer(words)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2,
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")
    for name, prompts in (("prompts.jsonl", train), ("eval_prompts.jsonl", held_out)):
        (root / name).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return {"policy": root / "policy", "prompts": root / "prompts.jsonl", "eval_prompts": root / "eval_prompts.jsonl"}


def stage_seconds(run_root: Path, stages: tuple[str, ...]) -> float:
    return sum(
        json.loads(path.read_text())["metrics"]["seconds"]
        for stage in stages
        for path in (run_root / "tiny" / stage).glob("[!.]*/_manifest.json")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    rounds = parser.parse_args().rounds
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # the temporary server sends nothing out

    from prefect.testing.utilities import prefect_test_harness

    from campaign.config import load_config
    from flows.rlhf_pipeline import rlhf_campaign

    config_file = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    with tempfile.TemporaryDirectory() as scratch, prefect_test_harness(server_startup_timeout=180):
        world = build_world(Path(scratch) / "world")
        results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in VARIANTS}
        for round_index in range(rounds):
            for name, overrides in VARIANTS.items():
                run_root = Path(scratch) / f"run-{round_index}-{len(results[name])}-{name.split()[0]}"
                config = load_config(
                    config_file,
                    [
                        f"run_root={run_root}",
                        f"model.policy={world['policy']}",
                        f"data.prompts={world['prompts']}",
                        f"data.eval_prompts={world['eval_prompts']}",
                        "sizes.rows_per_shard=8",
                        *overrides,
                    ],
                )
                started = time.perf_counter()
                rlhf_campaign(config)
                wall = time.perf_counter() - started
                results[name].append((wall, stage_seconds(run_root, FANNED_OUT), stage_seconds(run_root, TRAINING)))
        local = statistics.median(wall for wall, _, _ in results["local"])
        print("| variant | wall s (median) | / local | fanned-out stages s | training stages s | runs |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, runs in results.items():
            wall = statistics.median(run[0] for run in runs)
            fanned = statistics.median(run[1] for run in runs)
            training = statistics.median(run[2] for run in runs)
            print(f"| {name} | {wall:.1f} | {wall / local:.2f} | {fanned:.1f} | {training:.1f} | {len(runs)} |")


if __name__ == "__main__":
    main()
