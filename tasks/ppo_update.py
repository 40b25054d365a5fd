"""Stage 6, PPO update: new actor and critic checkpoints from the scored experience."""

from __future__ import annotations

import dataclasses

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from rlhf_core.ppo import ppo_update as update
from storage.checkpoints import load_causal_lm, load_critic, load_training_state, save_model, save_training_state
from storage.experience_io import table_to_experience
from storage.manifest import StageOutput
from storage.shards import read_table
from tasks.runtime import IterationContext, StageResult, accelerator_for, run_stage, stage_state
from tasks.text import load_tokenizer

STAGE = "ppo_update"


@task(name=STAGE, cache_policy=NO_CACHE)
def ppo_update(context: IterationContext, policy: StageResult, scored: StageResult) -> State:
    """Write ``actor/``, ``critic/`` and their optimizer states after PPO epochs over the experience."""
    config = context.config

    def produce(out: StageOutput) -> dict[str, float]:
        accelerator = accelerator_for(config)
        tokenizer = load_tokenizer(context.base.tokenizer_dir)
        actor, critic = load_causal_lm(policy.directory / "actor"), load_critic(policy.directory / "critic")
        actor_optimizer = torch.optim.AdamW(actor.parameters(), lr=config.ppo.actor_learning_rate)
        critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=config.ppo.critic_learning_rate)
        if (policy.directory / "actor_optimizer").is_dir():
            load_training_state(policy.directory / "actor_optimizer", optimizer=actor_optimizer)
            load_training_state(policy.directory / "critic_optimizer", optimizer=critic_optimizer)
        actor, critic, actor_optimizer, critic_optimizer = accelerator.prepare(
            actor, critic, actor_optimizer, critic_optimizer
        )
        experience = table_to_experience(
            read_table(scored.directory, "scored_experience"), pad_token_id=tokenizer.pad_token_id
        )
        stats = update(
            actor,
            critic,
            actor_optimizer,
            critic_optimizer,
            experience,
            config.ppo,
            accelerator=accelerator,
            temperature=config.sampling.temperature,
            generator=context.generator(STAGE),
        )
        save_model(out.path / "actor", accelerator.unwrap_model(actor), tokenizer)
        save_model(out.path / "critic", accelerator.unwrap_model(critic), tokenizer)
        save_training_state(out.path / "actor_optimizer", optimizer=actor_optimizer, step=stats.optimizer_steps)
        save_training_state(out.path / "critic_optimizer", optimizer=critic_optimizer, step=stats.optimizer_steps)
        return {name: float(value) for name, value in stats._asdict().items()}

    slice_ = {
        "ppo": dataclasses.asdict(config.ppo),
        "temperature": config.sampling.temperature,
        "seed": config.seed,
        "iteration": context.iteration,
    }
    return stage_state(
        run_stage(
            context,
            STAGE,
            config=slice_,
            upstream={"policy": policy, "scored": scored},
            produce=produce,
            register={"actor": "actor", "critic": "critic"},
        )
    )
