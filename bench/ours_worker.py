"""Our PPO iteration (``rlhf_core`` only, models in memory) over the shared artifacts.

``.venv/bin/python -m bench.ours_worker --artifacts DIR --threads 1 --out result.json``

One iteration is what TRL's is: sample B responses of R tokens, score them with the frozen
reference, the critic and the reward model, shape rewards and run GAE
(:meth:`ExperienceMaker.make_experience` and :func:`score_experience`), then ``ppo_epochs`` optimizer steps of actor and
critic over the whole batch (:func:`ppo_update`). The settings mirror the TRL worker's: the same
weights (TRL's value and reward ``score`` heads become our heads, with a zero bias), temperature,
KL coefficient, GAE, clip ranges, learning rate, fp32 and thread count.
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import rlhf_core.experience_maker as experience_maker
from bench.artifacts import read_prompts
from bench.common import Clock, Size, set_threads, size_from_json
from rlhf_core.config import AdvantageConfig, PPOConfig, SamplingConfig
from rlhf_core.experience_maker import ExperienceMaker, score_experience
from rlhf_core.models import Critic, RewardModel, freeze
from rlhf_core.ppo import ppo_update


def _with_score_head(model: Critic | RewardModel, folder: Path) -> Critic | RewardModel:
    """Copy the ``score`` head of a saved ``GPT2ForSequenceClassification`` into our head (bias 0)."""
    weights = load_file(folder / "model.safetensors")
    with torch.no_grad():
        model.head.weight.copy_(weights["score.weight"])
        model.head.bias.zero_()
    return model


def left_pad(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, width - len(row) :] = torch.tensor(row)
        mask[index, width - len(row) :] = 1
    return ids, mask


def run(artifacts: Path, *, size: Size | None = None, clock: Clock | None = None) -> dict:
    """Run ``size.iterations`` iterations; returns the per-phase timings and work counts."""
    size = size or size_from_json(artifacts / "size.json")
    clock = clock or Clock()
    B, R = size.rollout_batch, size.response_length
    tokenizer = AutoTokenizer.from_pretrained(artifacts / "tokenizer")
    actor = AutoModelForCausalLM.from_pretrained(artifacts / "policy", dtype=torch.float32)
    reference = freeze(AutoModelForCausalLM.from_pretrained(artifacts / "policy", dtype=torch.float32))
    critic = _with_score_head(Critic(pretrained=artifacts / "value"), artifacts / "value")
    reward = freeze(_with_score_head(RewardModel(pretrained=artifacts / "reward"), artifacts / "reward"))
    prompts = read_prompts(artifacts)
    sampling = SamplingConfig(max_new_tokens=R, temperature=size.temperature, batch_size=B)
    advantages = AdvantageConfig(kl_coef=size.kl_coef, gamma=1.0, gae_lambda=0.95, normalize_scores=False)
    ppo = PPOConfig(
        epochs=size.ppo_epochs,
        minibatch_size=B,
        actor_learning_rate=size.learning_rate,
        critic_learning_rate=size.learning_rate,
        clip_eps=0.2,
        value_clip_eps=0.2,
    )
    accelerator = Accelerator(cpu=True)
    actor_optimizer = torch.optim.AdamW(actor.parameters(), lr=ppo.actor_learning_rate)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=ppo.critic_learning_rate)
    actor, critic, actor_optimizer, critic_optimizer = accelerator.prepare(
        actor, critic, actor_optimizer, critic_optimizer
    )
    maker = ExperienceMaker(
        actor,
        critic,
        reward,
        reference,
        sampling=sampling,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    generate = experience_maker.generate

    def timed_generate(*args, **kwargs):
        with clock.measure("generation"):
            return generate(*args, **kwargs)

    experience_maker.generate = timed_generate
    generator = torch.Generator().manual_seed(size.seed)
    positions, steps = [], []
    try:
        for iteration in range(size.iterations):
            rows = [prompts[(iteration * B + i) % len(prompts)] for i in range(B)]
            prompt_ids, prompt_mask = left_pad(rows, tokenizer.pad_token_id)
            with clock.measure("iteration"):
                with clock.measure("rollout"):
                    experience = maker.make_experience(prompt_ids, prompt_mask, generator=generator)
                    experience = score_experience(experience, advantages)
                with clock.measure("update"):
                    stats = ppo_update(
                        actor,
                        critic,
                        actor_optimizer,
                        critic_optimizer,
                        experience,
                        ppo,
                        accelerator=accelerator,
                        temperature=size.temperature,
                        generator=generator,
                    )
            positions.append(int(experience.action_mask.numel()))
            steps.append(stats.optimizer_steps)
    finally:
        experience_maker.generate = generate
    return {
        "side": "ours",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in accelerator.unwrap_model(actor).parameters()),
        "positions_per_iteration": positions,
        "optimizer_steps_per_iteration": steps[-1],
        "phases": clock.to_json(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, help="override B (scaling runs)")
    parser.add_argument("--response-length", type=int, help="override R (scaling runs)")
    args = parser.parse_args()
    set_threads(args.threads)
    size = size_from_json(args.artifacts / "size.json")
    overrides = {"rollout_batch": args.batch, "response_length": args.response_length}
    size = Size(**{**size.__dict__, **{k: v for k, v in overrides.items() if v is not None}})
    args.out.write_text(json.dumps(run(args.artifacts, size=size), indent=2))


if __name__ == "__main__":
    main()
