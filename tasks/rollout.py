"""Stage 4, roll out experience: sample from the actor, score with reference, critic and reward model."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State
from tqdm.auto import tqdm

from rlhf_core.experience_maker import PPOExperienceMaker
from rlhf_core.models import freeze
from storage.checkpoints import load_causal_lm, load_critic, load_reward_model
from storage.experience_io import experience_to_table
from storage.manifest import StageOutput
from storage.schemas import EXPERIENCE
from tasks.runtime import IterationContext, StageResult, run_stage, stage_state
from tasks.text import batches, encode_prompts, load_tokenizer, read_prompt_texts, rotating_subset

STAGE = "rollout"
ROLLOUT_PROMPT_OFFSET = 7919
"""Rollout prompts start this far (a prime, so it never lines up with the batch sizes) from the
preference prompts of the same iteration, so the two stages see different prompts where they can."""


@task(name=STAGE, cache_policy=NO_CACHE)
def rollout(context: IterationContext, policy: StageResult, reward_model: StageResult) -> State:
    """Write the ``experience`` table: one scored rollout per prompt."""
    config = context.config
    sampling = dataclasses.replace(config.sampling, num_samples=1)

    def produce(out: StageOutput) -> dict[str, float]:
        tokenizer = load_tokenizer(context.base.tokenizer_dir)
        maker = PPOExperienceMaker(
            load_causal_lm(policy.directory / "actor"),
            load_critic(policy.directory / "critic"),
            load_reward_model(reward_model.directory / "reward_model"),
            freeze(load_causal_lm(context.base.policy_dir)),
            sampling=sampling,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        prompts = rotating_subset(
            read_prompt_texts(context.base.prompts_path),
            count=config.sizes.rollout_prompts,
            iteration=context.iteration,
            offset=ROLLOUT_PROMPT_OFFSET,
        )
        generator = context.generator(STAGE)
        tables = []
        for part in tqdm(list(batches(len(prompts), sampling.batch_size)), desc=STAGE, unit="batch"):
            prompt_ids, prompt_mask = encode_prompts(tokenizer, [text for _, text in prompts[part]])
            experience = maker.make_experience(prompt_ids, prompt_mask, generator=generator)
            tables.append(experience_to_table(experience, [index for index, _ in prompts[part]], first_row=part.start))
        table = pa.concat_tables(tables)
        out.write_table("experience", table, schema=EXPERIENCE, rows_per_shard=config.sizes.rows_per_shard)
        scores = table.column("scores").to_pylist()
        lengths = [len(ids) for ids in table.column("response_ids").to_pylist()]
        return {
            "score_mean": sum(scores) / len(scores),
            "response_length_mean": sum(lengths) / len(lengths),
            "rollouts": float(len(scores)),
        }

    slice_ = {
        "sampling": dataclasses.asdict(sampling),
        "prompts": config.sizes.rollout_prompts,
        "seed": config.seed,
        "iteration": context.iteration,
    }
    return stage_state(
        run_stage(
            context, STAGE, config=slice_, upstream={"policy": policy, "reward_model": reward_model}, produce=produce
        )
    )
