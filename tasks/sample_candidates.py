"""Stage 1, sample candidates: N responses per preference prompt from the current actor.

The prompts are split into shards (:mod:`runtime.fanout`), each sampled with its own generator (or, on vLLM, one
seed per row: :mod:`tasks.sampler`), wherever ``execution.task_runner`` runs them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from rlhf_core.config import SamplingConfig
from rlhf_core.generation import sample_candidates as sample
from rlhf_core.loading import ModelLoader
from rlhf_core.precision import Precision
from rlhf_core.sequences import sequence_logprobs
from runtime.context import StageContext
from runtime.fanout import Shard, plan_shards, run_shards
from runtime.stage import StageResult, stage
from storage.manifest import StageOutput
from storage.schemas import CANDIDATES, ENGINE_LOGPROBS, OLD_LOGPROBS
from tasks.sampler import mismatch_metrics, policy_sampler, row_seeds
from tasks.tensors import encode_prompts, prompt_token_lists, response_token_lists
from tasks.text import decode, load_tokenizer, read_prompts, rotating_subset

STAGE = "sample_candidates"


@stage(STAGE)
def sample_candidates(
    out: StageOutput,
    context: StageContext,
    policy: StageResult,
    *,
    sampling: SamplingConfig,
    precision: Precision,
    prompts: int,
    candidates_per_prompt: int,
    rows_per_shard: int,
) -> dict[str, float]:
    """Write the ``candidates`` table: ``candidates_per_prompt`` responses for each of ``prompts`` prompts."""
    shards = plan_shards(
        prompts,
        rows_per_shard=rows_per_shard,
        rows_per_item=candidates_per_prompt,
        seed=context.seed,
        stage=STAGE,
        iteration=context.iteration,
    )
    table = run_shards(
        out, context, STAGE, sample_shards, shards, schema=CANDIDATES, precision=precision,
        policy=policy, sampling=sampling, prompts=prompts, candidates_per_prompt=candidates_per_prompt,
    )  # fmt: skip
    out.write_table("candidates", table, schema=CANDIDATES, rows_per_shard=rows_per_shard)
    lengths = [len(ids) for ids in table.column("response_ids").to_pylist()]
    return {
        "candidates": float(len(lengths)),
        "response_length_mean": sum(lengths) / max(len(lengths), 1),
        **mismatch_metrics(table),
    }


def sample_shards(
    models: ModelLoader,
    context: StageContext,
    shards: list[Shard],
    *,
    policy: StageResult,
    sampling: SamplingConfig,
    prompts: int,
    candidates_per_prompt: int,
) -> Iterator[pa.Table]:
    """The ``candidates`` rows of each shard of the iteration's preference prompts."""
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    actor = models.load("actor", policy.directory / "actor")
    sampler = policy_sampler(models, context, policy.directory / "actor", actor, sampling)
    chosen = rotating_subset(read_prompts(context.base.prompts.path), count=prompts, iteration=context.iteration)
    for shard in shards:
        generator = shard.generator()
        rows: dict[str, list] = {name: [] for name in CANDIDATES.names}
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
