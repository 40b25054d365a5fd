"""What samples in a generation stage (``sampling.engine``), and the mismatch its log-probs leave.

``hf`` samples with the stage's actor and the shard's generator, as always. ``vllm`` samples in the long-lived
engine (:mod:`runtime.engine`), serving the actor folder the stage was given, with one seed per row
(:meth:`runtime.fanout.Shard.row_seeds`), behind the probe gate (:mod:`runtime.engine_probe`): every weight swap is
proved against the stage's own forward of the same weights before a token is sampled from it. The engine is asked
for a whole shard at once (:class:`WholeShards`), and the stage reads the rows back batch by batch. The stage then
recomputes the log-probs of the sampled tokens with the actor (the trainer's numerics) and records how far the
engine's are from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import SamplingConfig
from rlhf_core.generation import generate
from rlhf_core.loading import ModelLoader
from rlhf_core.mismatch import logprob_mismatch
from runtime.context import StageContext
from runtime.engine_client import served_policy
from runtime.engine_probe import PROBE_SIZES, GatedPolicy, Probe, campaign_probe, gated_policy
from runtime.seeds import stage_seed
from runtime.shards import Shard
from storage.schemas import ENGINE_LOGPROBS, OLD_LOGPROBS
from tasks.tensors import encode_prompts, prompt_token_lists, response_token_lists
from tasks.text import Prompt, load_tokenizer, read_prompts


def policy_sampler(
    models: ModelLoader, context: StageContext, actor_dir: str | Path, actor: PreTrainedModel, sampling: SamplingConfig
) -> PreTrainedModel | WholeShards:
    """What :func:`rlhf_core.generation.generate` samples with: the actor, or the engine serving its folder behind the
    probe gate (``actor`` gives the trainer's side of the probe), asked for whole shards (:class:`WholeShards`)."""
    if sampling.engine == "hf":
        return actor
    policy = served_policy(actor_dir, context.execution.engine_url, bases=models.bases)
    probe = campaign_probe(context.layout.engine_probe_file(), lambda: make_probe(models, context, actor))
    served = context.layout.engine_probe_weights_dir()
    return WholeShards(gated_policy(policy, actor, probe, models=models, iteration=context.iteration, served=served))


@dataclass
class WholeShards:
    """The engine asked for a whole shard's rows in one request (:meth:`prefetch`), then read back batch by batch by
    :func:`rlhf_core.generation.generate` (an :class:`rlhf_core.generation.ExternalSampler`).

    The engine schedules its own batches, and a request of a whole shard sampled more tokens per second than the
    same rows in requests of ``sampling.batch_size`` prompts (bench/RESULTS.md, issue 33), while the stage still
    scores them batch by batch, in the memory a batch takes. Each row has its own seed, so the tokens are those the
    batches would have been given.
    """

    sampler: GatedPolicy
    answers: dict[int, tuple[list[int], list[int], list[float]]] = field(default_factory=dict)

    def prefetch(
        self, prompts: list[list[int]], seeds: list[int], *, config: SamplingConfig, eos_token_id: int | None
    ) -> None:
        """Sample every row of a shard (its prompt's tokens, its seed) in one request, kept for :meth:`sample`."""
        tokens, logprobs = self.sampler.sample(prompts, seeds, config=config, eos_token_id=eos_token_id)
        self.answers = {
            seed: (prompt, row, values)
            for seed, prompt, row, values in zip(seeds, prompts, tokens, logprobs, strict=True)
        }

    def sample(
        self, prompts: list[list[int]], seeds: list[int], *, config: SamplingConfig, eos_token_id: int | None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """The rows sampled ahead for these seeds (each for the same prompt), else a request of these rows."""
        asked = zip(seeds, prompts, strict=True)
        if not all(seed in self.answers and self.answers[seed][0] == prompt for seed, prompt in asked):
            return self.sampler.sample(prompts, seeds, config=config, eos_token_id=eos_token_id)
        answers = [self.answers.pop(seed) for seed in seeds]
        return [tokens for _, tokens, _ in answers], [values for _, _, values in answers]


def sample_whole_shard(
    sampler: PreTrainedModel | WholeShards,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    *,
    seeds: list[int] | None,
    sampling: SamplingConfig,
) -> None:
    """Ask the engine for the rows of a whole shard ahead of its batches: ``prompts`` (one per row, a prompt sampled
    G times appearing G times) with their ``seeds``; nothing for the project's own sampler."""
    if isinstance(sampler, WholeShards) and seeds is not None:
        ids, mask = encode_prompts(tokenizer, prompts)
        sample_rows_ahead(
            sampler, prompt_token_lists(ids, mask), seeds, config=sampling, eos_token_id=tokenizer.eos_token_id
        )


def sample_rows_ahead(
    sampler: PreTrainedModel | WholeShards,
    prompts: list[list[int]],
    seeds: list[int],
    *,
    config: SamplingConfig,
    eos_token_id: int | None,
) -> None:
    """Ask the engine for ``prompts`` (token ids, one per row) with their ``seeds`` in one request, ahead of the
    batches that read them back (:class:`WholeShards`); nothing for the project's own sampler."""
    if isinstance(sampler, WholeShards) and prompts:
        sampler.prefetch(prompts, seeds, config=config, eos_token_id=eos_token_id)


def make_probe(models: ModelLoader, context: StageContext, actor: PreTrainedModel) -> Probe:
    """The campaign's probe batch (:mod:`runtime.engine_probe`, choice 1): the first training prompts, in the
    stages' own encoding, each with a response the project's sampler draws from ``actor`` (temperature 1, a seed of
    the campaign's)."""
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    prompts, tokens = PROBE_SIZES[models.precision]
    prompt_ids, prompt_mask = encode_prompts(tokenizer, read_prompts(context.base.prompts.path)[:prompts])
    config = SamplingConfig(max_new_tokens=tokens, temperature=1.0, batch_size=prompts)
    with models.autocast():
        generation = generate(
            actor,
            prompt_ids.to(models.device),
            prompt_mask.to(models.device),
            config=config,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            generator=torch.Generator().manual_seed(stage_seed(context.seed, "engine_probe", 0)),
        )
    responses = response_token_lists(generation.sequences, generation.action_mask)
    prompts = prompt_token_lists(prompt_ids, prompt_mask)
    return Probe(prompts=tuple(map(tuple, prompts)), responses=tuple(map(tuple, responses)))


def row_seeds(sampling: SamplingConfig, shard: Shard, first_row: int, rows: int) -> list[int] | None:
    """The engine's per-row seeds of output rows ``first_row ..`` (None for ``hf``, which draws from the shard's
    generator)."""
    return None if sampling.engine == "hf" else shard.row_seeds(range(first_row, first_row + rows))


def mismatch_metrics(table: pa.Table) -> dict[str, float]:
    """``engine_logprob_max_abs_diff`` and ``token_mult_prob_error`` over every token of the rows of ``table`` that
    hold both ``old_logprobs`` and ``engine_logprobs`` (:func:`rlhf_core.mismatch.logprob_mismatch`); none when no
    row does."""
    both = [
        (old, engine)
        for old, engine in zip(
            table.column(OLD_LOGPROBS).to_pylist(), table.column(ENGINE_LOGPROBS).to_pylist(), strict=True
        )
        if old is not None and engine is not None
    ]
    old = torch.tensor([value for row, _ in both for value in row], dtype=torch.float32).unsqueeze(0)  # (1, N)
    engine = torch.tensor([value for _, row in both for value in row], dtype=torch.float32).unsqueeze(0)  # (1, N)
    if old.numel() == 0:
        return {}
    mismatch = logprob_mismatch(old, engine, torch.ones_like(old, dtype=torch.bool))
    return {
        "engine_logprob_max_abs_diff": float(mismatch.max_abs_diff),
        "token_mult_prob_error": float(mismatch.token_mult_prob_error),
    }
