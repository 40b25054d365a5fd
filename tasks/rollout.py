"""Stage 4, roll out experience: sample from the actor, score with reference, critic and reward model."""

from __future__ import annotations

import pyarrow as pa
from tqdm.auto import tqdm

from rlhf_core.config import SamplingConfig
from rlhf_core.experience_maker import ExperienceMaker
from rlhf_core.precision import Precision
from storage.experience_io import experience_to_table
from storage.manifest import StageOutput
from storage.schemas import EXPERIENCE
from tasks.context import StageContext
from tasks.stage import StageResult, stage, stage_models
from tasks.text import batches, encode_prompts, load_tokenizer, read_prompts, reward_scorer, rotating_subset

STAGE = "rollout"
ROLLOUT_PROMPT_OFFSET = 7919
"""Rollout prompts start this far (a prime, so it never lines up with the batch sizes) from the
preference prompts of the same iteration, so the two stages see different prompts where they can."""


@stage(STAGE)
def rollout(
    out: StageOutput,
    context: StageContext,
    policy: StageResult,
    reward_model: StageResult,
    *,
    sampling: SamplingConfig,
    precision: Precision,
    prompts: int,
    rows_per_shard: int,
) -> dict[str, float]:
    """Write the ``experience`` table: one scored rollout for each of ``prompts`` prompts."""
    models = stage_models(out, context, precision)
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    actor = models.load("actor", policy.directory / "actor")
    critic = models.load("critic", policy.directory / "critic")
    scorer = reward_scorer(
        models.load("reward_model", reward_model.directory / "reward_model"),
        policy_tokenizer_dir=context.base.tokenizer.path,
        reward_tokenizer_dir=context.base.reward_tokenizer,
    )
    reference = models.reference(actor)
    chosen = rotating_subset(
        read_prompts(context.base.prompts.path),
        count=prompts,
        iteration=context.iteration,
        offset=ROLLOUT_PROMPT_OFFSET,
    )
    generator = context.generator(STAGE)
    tables = []
    for part in tqdm(list(batches(len(chosen), sampling.batch_size)), desc=STAGE, unit="batch"):
        batch = [prompt for _, prompt in chosen[part]]
        prompt_ids, prompt_mask = encode_prompts(tokenizer, batch)
        maker = ExperienceMaker(
            actor,
            critic,
            lambda sequences, mask, batch=batch, length=prompt_ids.shape[1]: scorer.score(
                batch, sequences, mask, prompt_length=length
            ),
            reference,
            sampling=sampling,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            precision=precision,
        )
        experience = maker.make_experience(prompt_ids, prompt_mask, generator=generator)
        tables.append(experience_to_table(experience, [index for index, _ in chosen[part]], first_row=part.start))
    table = pa.concat_tables(tables)
    out.write_table("experience", table, schema=EXPERIENCE, rows_per_shard=rows_per_shard)
    scores = table.column("scores").to_pylist()
    lengths = [len(ids) for ids in table.column("response_ids").to_pylist()]
    return {
        "score_mean": sum(scores) / len(scores),
        "response_length_mean": sum(lengths) / len(lengths),
        "rollouts": float(len(scores)),
    }
