"""The reference's side of evaluation, sampled once per campaign: the initial policy's responses to the held-out
prompts, which every iteration's evaluation reads back (:mod:`tasks.evaluate`).

Choices:
1. The reference never changes, so neither do its samples: sampling them again in every iteration cost 25-40 % of an
   iteration on SmolLM2 (issue 33). This stage's key is the reference (the base policy), the held-out prompts, the
   sampling settings and the campaign's seed; the flow gives it the campaign's first iteration's context, so every
   iteration's call finds the same output.
2. Evaluation's seeds are the campaign's, the same in every iteration (:func:`tasks.held_out.held_out_shards`): the policy of any
   iteration samples each held-out prompt with the seed the reference sampled it with, so every comparison stays
   paired (common random numbers), and the evaluation curve varies with the policy, not the draw.
3. A response is kept as its tokens, so evaluation scores it with the iteration's own reward model in the layout it
   scores the policy's responses in, and as its text, for the judge, the rubric and the samples people read.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import torch

from rlhf_core.generation import generate
from runtime.job import Job
from runtime.stage import Shards, Stage
from storage.schemas import REFERENCE_RESPONSES, RESPONSE, RESPONSE_IDS, ROW
from tasks import episode_evaluation
from tasks.episodes import not_resumable
from tasks.held_out import batch_generator, held_out_shards
from tasks.sampler import policy_sampler, row_seeds, sample_whole_shard
from tasks.settings import SampleReferenceSettings
from tasks.tensors import encode_prompts, response_token_lists
from tasks.text import decode, load_tokenizer, read_prompts


def plan(job: Job[SampleReferenceSettings]) -> Shards:
    """The held-out prompts in evaluation's shards (the reference's episodes with an environment)."""
    settings = job.settings
    table = "reference_responses" if settings.environment is None else episode_evaluation.TABLE
    shards = held_out_shards(job, settings.prompts, rows_per_shard=settings.rows_per_shard)
    return Shards(shards, table, not_resumable=not_resumable(settings.environment))


def work(job: Job[SampleReferenceSettings]) -> Iterator[pa.Table]:
    """The :data:`storage.schemas.REFERENCE_RESPONSES` rows of each shard: the reference's response to each prompt (or
    its episode's, with an environment: :mod:`tasks.episode_evaluation`)."""
    settings, context = job.settings, job.context
    if settings.environment is not None:
        yield from episode_evaluation.reference_work(job)
        return
    sampling = settings.sampling
    models = job.models(settings.precision)
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    reference = models.reference()
    sampler = policy_sampler(models, context, context.base.policy.path, reference, sampling)
    held_out = read_prompts(settings.eval_prompts.path)[: settings.prompts]
    for shard in job.shards:
        rows: dict[str, list] = {name: [] for name in REFERENCE_RESPONSES.names}
        seeds = row_seeds(sampling, shard, shard.start, shard.stop - shard.start)
        sample_whole_shard(sampler, tokenizer, held_out[shard.start : shard.stop], seeds=seeds, sampling=sampling)
        for part in shard.batches(sampling.batch_size):
            prompt_ids, prompt_mask = encode_prompts(tokenizer, held_out[part])
            with models.autocast(), torch.no_grad():
                generation = generate(
                    sampler,
                    prompt_ids.to(models.device),
                    prompt_mask.to(models.device),
                    config=sampling,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    generator=batch_generator(shard, part),
                    seeds=row_seeds(sampling, shard, part.start, prompt_ids.shape[0]),
                )
            responses = response_token_lists(generation.sequences, generation.action_mask)
            rows[ROW].extend(range(part.start, part.stop))
            rows[RESPONSE].extend(decode(tokenizer, responses))
            rows[RESPONSE_IDS].extend(responses)
        yield pa.table(rows, schema=REFERENCE_RESPONSES)


def gather(job: Job[SampleReferenceSettings], table: pa.Table) -> dict[str, float]:
    """Write the ``reference_responses`` table (``reference_episodes``, with an environment)."""
    if job.settings.environment is not None:
        return episode_evaluation.reference_gather(job, table)
    rows_per_shard = job.settings.rows_per_shard
    job.out.write_table("reference_responses", table, schema=REFERENCE_RESPONSES, rows_per_shard=rows_per_shard)
    lengths = [len(ids) for ids in table.column(RESPONSE_IDS).to_pylist()]
    return {"responses": float(len(lengths)), "response_length_mean": sum(lengths) / max(len(lengths), 1)}


sample_reference = Stage(SampleReferenceSettings, plan=plan, work=work, gather=gather)
