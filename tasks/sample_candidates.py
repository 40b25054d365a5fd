"""Stage 1, sample candidates: N responses per preference prompt from the current actor.

The prompts are split into shards (:mod:`runtime.fanout`), each sampled with its own generator (or, on vLLM, one
seed per row: :mod:`tasks.sampler`), wherever ``execution.task_runner`` runs them.

An iteration samples one round of ``sizes.preference_prompts`` prompts, or with ``sizes.decisive_pairs`` as many
rounds as it needs (:mod:`flows.rounds`): round R takes the R-th block of prompts of the rotation after the
iteration's first (:func:`tasks.text.round_prompts`), so no prompt is sampled twice in one iteration, and seeds apart from the
earlier rounds (:func:`runtime.seeds.round_coordinates`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from rlhf_core.generation import sample_candidates as sample
from rlhf_core.sequences import sequence_logprobs
from runtime.job import Job, Shards
from runtime.stage import Stage
from storage.schemas import CANDIDATES, ENGINE_LOGPROBS, OLD_LOGPROBS
from tasks.sampler import mismatch_metrics, policy_sampler, row_seeds, sample_whole_shard
from tasks.settings import SampleCandidatesSettings
from tasks.tensors import encode_prompts, prompt_token_lists, response_token_lists
from tasks.text import decode, load_tokenizer, read_prompts, round_prompts


def plan(job: Job[SampleCandidatesSettings]) -> Shards:
    """The preference prompts in shards, a prompt's candidates in one."""
    settings = job.settings
    shards = job.plan_shards(
        settings.prompts,
        rows_per_item=settings.candidates_per_prompt,
        rows_per_shard=settings.rows_per_shard,
        round_index=len(settings.earlier),
    )
    return Shards(shards, table="candidates")


def work(job: Job[SampleCandidatesSettings]) -> Iterator[pa.Table]:
    """The ``candidates`` rows of each shard of the iteration's preference prompts."""
    settings, context = job.settings, job.context
    sampling, candidates_per_prompt = settings.sampling, settings.candidates_per_prompt
    models = job.models(settings.precision)
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    actor_dir = settings.policy.directory / "actor"
    actor = models.load("actor", actor_dir)
    sampler = policy_sampler(models, context, actor_dir, actor, sampling)
    chosen = round_prompts(
        read_prompts(context.base.prompts.path),
        count=settings.prompts,
        iteration=context.iteration,
        round_index=len(settings.earlier),
    )
    for shard in job.shards:
        generator = shard.generator()
        rows: dict[str, list] = {name: [] for name in CANDIDATES.names}
        asked = [prompt for _, prompt in chosen[shard.start : shard.stop] for _ in range(candidates_per_prompt)]
        seeds = row_seeds(sampling, shard, shard.start * candidates_per_prompt, len(asked))
        sample_whole_shard(sampler, tokenizer, asked, seeds=seeds, sampling=sampling)
        for part in shard.batches(sampling.batch_size):
            prompt_ids, prompt_mask = encode_prompts(tokenizer, [prompt for _, prompt in chosen[part]])
            count = len(range(part.start, part.stop)) * candidates_per_prompt
            with models.autocast():
                generation = sample(
                    sampler,
                    prompt_ids.to(models.device),
                    prompt_mask.to(models.device),
                    num_samples=candidates_per_prompt,
                    config=sampling,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    generator=generator,
                    seeds=row_seeds(sampling, shard, part.start * candidates_per_prompt, count),
                )
                old_logprobs = engine_logprobs = [None] * count
                if sampler is not actor:  # the trainer's log-probs of the engine's tokens, beside the engine's
                    mask = generation.action_mask
                    recomputed = sequence_logprobs(
                        actor, generation.sequences, generation.attention_mask, prompt_ids.shape[1],
                        temperature=sampling.temperature,
                    )  # fmt: skip
                    old_logprobs = [row[keep].tolist() for row, keep in zip(recomputed.cpu(), mask.cpu(), strict=True)]
                    engine_logprobs = [
                        row[keep].tolist() for row, keep in zip(generation.logprobs.cpu(), mask.cpu(), strict=True)
                    ]
            responses = response_token_lists(generation.sequences, generation.action_mask)
            prompt_lists = prompt_token_lists(prompt_ids, prompt_mask)
            rows[OLD_LOGPROBS].extend(old_logprobs)
            rows[ENGINE_LOGPROBS].extend(engine_logprobs)
            for row, (response_ids, text) in enumerate(zip(responses, decode(tokenizer, responses), strict=True)):
                prompt_index, prompt = chosen[part][row // candidates_per_prompt]
                rows["prompt_id"].append(prompt_index)
                rows["candidate_index"].append(row % candidates_per_prompt)
                rows["prompt"].append(prompt.text)
                rows["messages"].append(list(prompt.messages))
                rows["response"].append(text)
                rows["prompt_ids"].append(prompt_lists[row // candidates_per_prompt])
                rows["response_ids"].append(response_ids)
        yield pa.table(rows, schema=CANDIDATES)


def gather(job: Job[SampleCandidatesSettings], table: pa.Table) -> dict[str, float]:
    """Write the ``candidates`` table: ``candidates_per_prompt`` responses for each of ``prompts`` prompts."""
    job.out.write_table("candidates", table, schema=CANDIDATES, rows_per_shard=job.settings.rows_per_shard)
    lengths = [len(ids) for ids in table.column("response_ids").to_pylist()]
    return {
        "candidates": float(len(lengths)),
        "round": float(len(job.settings.earlier)),
        "response_length_mean": sum(lengths) / max(len(lengths), 1),
        **mismatch_metrics(table),
    }


sample_candidates = Stage(SampleCandidatesSettings, plan=plan, work=work, gather=gather)
