"""The held-out prompts' shards and seeds, which both sides of evaluation share (the reference's samples,
:mod:`tasks.sample_reference`, and the policy's, :mod:`tasks.evaluate`; their episodes, :mod:`tasks.episode_evaluation`):
the campaign's seeds, the same in every iteration, so every comparison stays paired."""

from __future__ import annotations

import torch

from runtime.job import Job
from runtime.shards import Shard, plan_shards

SEED_STAGE, SEED_ITERATION = "evaluate", 0
"""The coordinates of evaluation's seeds (:mod:`runtime.seeds`): evaluation's own, in the campaign's first iteration,
for both sides and every iteration (choice 2)."""


def held_out_shards(job: Job, prompts: int, *, rows_per_shard: int) -> tuple[Shard, ...]:
    """The first ``prompts`` held-out prompts in shards, seeded alike in every iteration and for both sides (choice 2)."""
    context = job.context
    return plan_shards(
        prompts,
        rows_per_shard=rows_per_shard,
        rows_per_item=1,
        seed=context.seed,
        stage=SEED_STAGE,
        iteration=SEED_ITERATION,
    )


def batch_generator(shard: Shard, part: slice) -> torch.Generator:
    """The generator a batch of held-out prompts samples from, on either side: the shard's seed plus its first
    prompt's index."""
    return torch.Generator().manual_seed(shard.seed + part.start)
