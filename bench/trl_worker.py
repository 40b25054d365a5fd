"""One TRL ``PPOTrainer`` run over the shared artifacts; run with the TRL venv's python.

``bench/.venv-trl/bin/python -m bench.trl_worker --artifacts DIR --threads 1 --out result.json``

Imports only the standard library, torch, transformers, datasets and trl (this project is not
installed in that venv). It records per iteration (one rollout batch plus all its optimizer steps):
wall and CPU seconds of the whole iteration, of generation, and of the rollout (generation plus the
reference, value and reward forward passes and GAE), marked by TRL's own functions.

TRL settings follow ../shared/research/peer-bench-trl.md: fp32 (``bf16=False``), ``use_cpu``,
``num_mini_batches=1`` and ``per_device_train_batch_size = B`` with no gradient accumulation (one
optimizer step per PPO epoch, the same as ours, and TRL's fastest layout), one generation chunk,
no sample generations, ``stop_token="eos"``, no checkpoints, no logging callbacks.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from bench.common import Clock, set_threads, size_from_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    set_threads(args.threads)

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        PrinterCallback,
        ProgressCallback,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trainer_module

    transformers.logging.set_verbosity_error()
    size = size_from_json(args.artifacts / "size.json")
    B, R = size.rollout_batch, size.response_length
    tokenizer = AutoTokenizer.from_pretrained(args.artifacts / "tokenizer")
    policy = AutoModelForCausalLM.from_pretrained(args.artifacts / "policy", dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(args.artifacts / "policy", dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(args.artifacts / "value", dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(args.artifacts / "reward", dtype=torch.float32)
    with (args.artifacts / "prompts.jsonl").open() as lines:
        prompts = [json.loads(line)["input_ids"] for line in lines if line.strip()]
    config = PPOConfig(
        output_dir=str(args.out.parent / "trl-output"),
        per_device_train_batch_size=B,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=size.ppo_epochs,
        response_length=R,
        local_rollout_forward_batch_size=B,
        total_episodes=B * size.iterations,
        num_sample_generations=0,
        stop_token="eos",
        temperature=size.temperature,
        kl_coef=size.kl_coef,
        learning_rate=size.learning_rate,
        bf16=False,
        use_cpu=True,
        seed=size.seed,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    clock = Clock()
    marks: dict[str, tuple[float, float]] = {}
    positions: list[int] = []

    def now() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    generate = trainer_module.batch_generation

    def timed_generation(model, queries, *rest, **kwargs):
        start = now()
        query_responses, logits = generate(model, queries, *rest, **kwargs)
        end = now()
        clock.add("generation", end[0] - start[0], end[1] - start[1])
        positions.append(int(queries.shape[0] * (query_responses.shape[1] - queries.shape[1])))
        return query_responses, logits

    whiten = trainer_module.masked_whiten

    def marked_whiten(*a, **k):
        result = whiten(*a, **k)
        marks["rollout_end"] = now()  # the last whitening of an iteration is the advantages'
        return result

    trainer_module.batch_generation = timed_generation
    trainer_module.masked_whiten = marked_whiten

    class Iterations(TrainerCallback):
        def on_train_begin(self, *_, **__):
            marks["start"] = now()

        def on_step_end(self, *_, **__):
            end, start, rollout_end = now(), marks["start"], marks["rollout_end"]
            clock.add("iteration", end[0] - start[0], end[1] - start[1])
            clock.add("rollout", rollout_end[0] - start[0], rollout_end[1] - start[1])
            clock.add("update", end[0] - rollout_end[0], end[1] - rollout_end[1])
            marks["start"] = end

    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=reference,
        reward_model=reward,
        value_model=value,
        train_dataset=Dataset.from_dict({"input_ids": prompts}),
        callbacks=[Iterations()],
    )
    for noisy in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(noisy)
    trainer.train()
    result = {
        "side": "trl",
        "trl": trl.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in policy.parameters()),
        "positions_per_iteration": positions,
        "optimizer_steps_per_iteration": size.ppo_epochs * config.num_mini_batches,
        "phases": clock.to_json(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
