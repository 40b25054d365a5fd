"""Stage 1, sample candidates: N responses per preference prompt from the current actor."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import State
from tqdm.auto import tqdm

from rlhf_core.generation import sample_candidates as sample
from storage.checkpoints import load_causal_lm
from storage.manifest import StageOutput
from storage.schemas import CANDIDATES
from tasks.runtime import IterationContext, StageResult, run_stage, stage_state
from tasks.text import (
    batches,
    decode,
    encode_prompts,
    load_tokenizer,
    prompt_token_lists,
    read_prompt_texts,
    response_token_lists,
    rotating_subset,
)

STAGE = "sample_candidates"


@task(name=STAGE, cache_policy=NO_CACHE)
def sample_candidates(context: IterationContext, policy: StageResult) -> State:
    """Write the ``candidates`` table: ``candidates_per_prompt`` responses for each preference prompt."""
    config = context.config
    sampling = dataclasses.replace(config.sampling, num_samples=config.sizes.candidates_per_prompt)

    def produce(out: StageOutput) -> dict[str, float]:
        tokenizer = load_tokenizer(context.base.tokenizer_dir)
        actor = load_causal_lm(policy.directory / "actor")
        chosen = rotating_subset(
            read_prompt_texts(context.base.prompts_path),
            count=config.sizes.preference_prompts,
            iteration=context.iteration,
        )
        generator = context.generator(STAGE)
        rows: dict[str, list] = {name: [] for name in CANDIDATES.names}
        for part in tqdm(list(batches(len(chosen), sampling.batch_size)), desc=STAGE, unit="batch"):
            prompt_ids, prompt_mask = encode_prompts(tokenizer, [text for _, text in chosen[part]])
            generation = sample(
                actor,
                prompt_ids,
                prompt_mask,
                config=sampling,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                generator=generator,
            )
            responses = response_token_lists(generation.sequences, generation.action_mask)
            prompt_lists = prompt_token_lists(prompt_ids, prompt_mask)
            for row, (response_ids, text) in enumerate(zip(responses, decode(tokenizer, responses), strict=True)):
                prompt_index, prompt = chosen[part][row // sampling.num_samples]
                rows["prompt_id"].append(prompt_index)
                rows["candidate_index"].append(row % sampling.num_samples)
                rows["prompt"].append(prompt)
                rows["response"].append(text)
                rows["prompt_ids"].append(prompt_lists[row // sampling.num_samples])
                rows["response_ids"].append(response_ids)
        out.write_table(
            "candidates",
            pa.table(rows, schema=CANDIDATES),
            schema=CANDIDATES,
            rows_per_shard=config.sizes.rows_per_shard,
        )
        lengths = [len(ids) for ids in rows["response_ids"]]
        return {"candidates": float(len(lengths)), "response_length_mean": sum(lengths) / max(len(lengths), 1)}

    slice_ = {
        "sampling": dataclasses.asdict(sampling),
        "prompts": config.sizes.preference_prompts,
        "seed": config.seed,
        "iteration": context.iteration,
    }
    return stage_state(run_stage(context, STAGE, config=slice_, upstream={"policy": policy}, produce=produce))
