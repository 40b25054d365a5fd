"""Stage 5, compute rewards, KL and GAE: pure, so replaying it with new settings is cheap."""

from __future__ import annotations

import dataclasses

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from rlhf_core.experience_maker import score_experience
from rlhf_core.masked import masked_mean
from storage.experience_io import experience_to_table, table_to_experience
from storage.manifest import StageOutput
from storage.schemas import SCORED_EXPERIENCE
from storage.shards import read_table
from tasks.runtime import IterationContext, StageResult, run_stage, stage_state

STAGE = "compute_advantages"


@task(name=STAGE, cache_policy=NO_CACHE)
def compute_advantages(context: IterationContext, experience: StageResult, reward_model: StageResult) -> State:
    """Write the ``scored_experience`` table: per-token rewards, KL, advantages and returns."""
    config = context.config

    def produce(out: StageOutput) -> dict[str, float]:
        table = read_table(experience.directory, "experience")
        # Only masks and per-token floats are read here and padding is stripped again on write,
        # so the id used to pad token columns cannot change the output.
        rollouts = table_to_experience(table, pad_token_id=0)
        scored = score_experience(
            rollouts,
            config.advantages,
            score_mean=reward_model.metrics["score_mean"],
            score_std=reward_model.metrics["score_std"],
        )
        out.write_table(
            "scored_experience",
            experience_to_table(
                scored, table.column("prompt_id").to_pylist(), first_row=table.column("row")[0].as_py()
            ),
            schema=SCORED_EXPERIENCE,
            rows_per_shard=config.sizes.rows_per_shard,
        )
        mask = scored.action_mask
        return {
            "kl_mean": float(scored.kl.sum(dim=1).mean()),
            "reward_mean": float(scored.reward.sum(dim=1).mean()),
            "advantage_mean": float(masked_mean(scored.advantages, mask)),
            "return_mean": float(masked_mean(scored.returns, mask)),
        }

    slice_ = {"advantages": dataclasses.asdict(config.advantages)}
    return stage_state(
        run_stage(
            context,
            STAGE,
            config=slice_,
            upstream={"experience": experience, "reward_model": reward_model},
            produce=produce,
        )
    )
