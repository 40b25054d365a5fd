"""TRL's ``GRPOTrainer`` on SmolLM2 at the work of our GRPO iteration; run with ``bench/.venv-trl-grpo``'s python.

``bench/.venv-trl-grpo/bin/python -m bench.real_trl_worker --model DIR --prompts N --iterations 3 --out FILE``

Imports only the standard library, torch, transformers, datasets, trl and ``configs/smollm2_task.py`` (this
project is not installed in that venv). One iteration is what ours is (:mod:`bench.real_ours_worker`): N chat
prompts of ``configs/smollm2/prompts.jsonl`` x G = 4 samples of at most 16 tokens at temperature 1, scored by
the same reward function, the reference's log-probs (``beta`` 0.05 > 0 loads it), group advantages, then
4 optimizer steps of N x G / 4 rollouts each (``steps_per_generation`` 4, one epoch: ``num_iterations`` 1);
fp32 (``bf16=False``), ``use_cpu``, the same learning rate and thread count. Wall and CPU seconds are recorded
per iteration (4 trainer steps) and for ``_generate_and_score_completions`` (the rollout: generation, reward,
reference and old log-probs, advantages).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from bench.common import Clock, set_threads

REPO = Path(__file__).resolve().parent.parent
STEPS = 4  # optimizer steps per iteration, as configs/smollm2.yaml (64 rollouts, minibatch 16, one epoch)
GROUP = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    set_threads(args.threads)

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, ProgressCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(REPO / "configs"))
    from smollm2_task import one_word

    transformers.logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    with (REPO / "configs" / "smollm2" / "prompts.jsonl").open() as lines:
        prompts = [json.loads(line)["messages"] for line in lines if line.strip()]

    def reward(completions: list, **_: object) -> list[float]:
        return [one_word(None, completion[-1]["content"]) for completion in completions]

    rollouts = args.prompts * GROUP
    config = GRPOConfig(
        output_dir=str(args.out.parent / "trl-grpo-output"),
        per_device_train_batch_size=rollouts // STEPS,
        gradient_accumulation_steps=1,
        steps_per_generation=STEPS,
        num_generations=GROUP,
        num_iterations=1,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.05,
        learning_rate=args.learning_rate,
        max_steps=STEPS * args.iterations,
        bf16=False,
        use_cpu=True,
        seed=0,
        report_to="none",
        save_strategy="no",
        logging_steps=10_000,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    clock = Clock()

    def now() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    score = GRPOTrainer._generate_and_score_completions

    def timed_rollout(self, *a, **k):
        start = now()
        result = score(self, *a, **k)
        end = now()
        clock.add("rollout", end[0] - start[0], end[1] - start[1])
        return result

    GRPOTrainer._generate_and_score_completions = timed_rollout
    marks: dict[str, tuple[float, float]] = {}

    class Iterations(TrainerCallback):
        def on_train_begin(self, *_, **__):
            marks["start"] = now()

        def on_step_end(self, _args, state, *__, **___):
            if state.global_step % STEPS == 0:
                end, start = now(), marks["start"]
                clock.add("iteration", end[0] - start[0], end[1] - start[1])
                marks["start"] = end

    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[reward],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
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
        "rollouts_per_iteration": [rollouts] * args.iterations,
        "optimizer_steps_per_iteration": STEPS,
        "phases": clock.to_json(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
