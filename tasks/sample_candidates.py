"""Stage 1, sample candidates: N responses per preference prompt from the current actor."""

from __future__ import annotations

import pyarrow as pa
from tqdm.auto import tqdm

from rlhf_core.config import SamplingConfig
from rlhf_core.generation import sample_candidates as sample
from rlhf_core.precision import Precision
from storage.manifest import StageOutput
from storage.schemas import CANDIDATES
from tasks.context import StageContext
from tasks.stage import StageResult, stage, stage_models
from tasks.text import (
    batches,
    decode,
    encode_prompts,
    load_tokenizer,
    prompt_token_lists,
    read_prompts,
    response_token_lists,
    rotating_subset,
)

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
    models = stage_models(out, context, precision)
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    actor = models.load("actor", policy.directory / "actor")
    chosen = rotating_subset(read_prompts(context.base.prompts.path), count=prompts, iteration=context.iteration)
    generator = context.generator(STAGE)
    rows: dict[str, list] = {name: [] for name in CANDIDATES.names}
    for part in tqdm(list(batches(len(chosen), sampling.batch_size)), desc=STAGE, unit="batch", leave=False):
        prompt_ids, prompt_mask = encode_prompts(tokenizer, [prompt for _, prompt in chosen[part]])
        with models.autocast():
            generation = sample(
                actor,
                prompt_ids.to(models.device),
                prompt_mask.to(models.device),
                num_samples=candidates_per_prompt,
                config=sampling,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                generator=generator,
            )
        responses = response_token_lists(generation.sequences, generation.action_mask)
        prompt_lists = prompt_token_lists(prompt_ids, prompt_mask)
        for row, (response_ids, text) in enumerate(zip(responses, decode(tokenizer, responses), strict=True)):
            prompt_index, prompt = chosen[part][row // candidates_per_prompt]
            rows["prompt_id"].append(prompt_index)
            rows["candidate_index"].append(row % candidates_per_prompt)
            rows["prompt"].append(prompt.text)
            rows["messages"].append(list(prompt.messages))
            rows["response"].append(text)
            rows["prompt_ids"].append(prompt_lists[row // candidates_per_prompt])
            rows["response_ids"].append(response_ids)
    out.write_table("candidates", pa.table(rows, schema=CANDIDATES), schema=CANDIDATES, rows_per_shard=rows_per_shard)
    lengths = [len(ids) for ids in rows["response_ids"]]
    return {"candidates": float(len(lengths)), "response_length_mean": sum(lengths) / max(len(lengths), 1)}
