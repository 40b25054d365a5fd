"""Stage 4, roll out experience: sample from the actor, score with reference, critic and a reward.

Each prompt is sampled ``samples_per_prompt`` times (its group, for GRPO and RLOO); the prompt's
id is every row's ``prompt_id`` (``Experience.group_ids``). The critic scores values only when the
policy has one (GAE), or starts from the first trained reward model (``critic_start``); a critic-free policy's
rollout has none. The reward is the reward model, or
a reward function of the prompt (as the user wrote it, with its row's other columns) and the response's text. The
prompts are split into shards (:mod:`runtime.fanout`), each rolled out with its own generator (or, on vLLM, one seed
per row: :mod:`tasks.sampler`), wherever ``execution.task_runner`` runs them. The sampler's log-probs are kept
beside the actor's (``engine_logprobs``), and the stage records their mismatch. Every row keeps the version of the
policy that sampled it (``policy_version``, :mod:`tasks.staleness`): with ``sampling.staleness`` N the flow hands it
the policy N versions behind the one the iteration's update starts from.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import torch

from rlhf_core.evaluation import correlation
from rlhf_core.experience_maker import ExperienceMaker, ScoreFn
from runtime.bars import stage_bar
from runtime.job import Job
from runtime.references import RewardFunctionReference
from runtime.stage import Shards, Stage
from storage.experience_io import experience_to_table
from storage.schemas import EXPERIENCE
from tasks import episodes
from tasks.reward_function import score_texts
from tasks.sampler import mismatch_metrics, policy_sampler, row_seeds, sample_whole_shard
from tasks.settings import RolloutSettings, critic_folder, critic_score_statistics
from tasks.sft_text import ChatTemplateError
from tasks.staleness import policy_version
from tasks.tensors import RewardScorer, encode_prompts, response_token_lists, reward_scorer
from tasks.text import Prompt, decode, load_tokenizer, prompt_text, read_prompts, rotating_subset

ROLLOUT_PROMPT_OFFSET = 7919
"""Rollout prompts start this far (a prime, so it never lines up with the batch sizes) from the
preference prompts of the same iteration, so the two stages see different prompts where they can."""


def model_scorer(scorer: RewardScorer, prompts: list[Prompt], prompt_length: int) -> ScoreFn:
    """One batch's :data:`ScoreFn` from the reward model (in its own tokens; see :class:`tasks.tensors.RewardScorer`)."""

    def score(sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return scorer.score(prompts, sequences, attention_mask, prompt_length=prompt_length)

    return score


def function_scorer(
    reward_function: RewardFunctionReference,
    tokenizer,
    prompts: list[Prompt],
    prompt_ids: list[int],
    prompt_length: int,
) -> ScoreFn:
    """One batch's :data:`ScoreFn` from a reward function: decode each row's response and score it with its prompt
    as the user wrote it and the other columns of its row (the contract of :mod:`tasks.reward_function`).

    Args:
        prompts, prompt_ids: each row's prompt and its id (a prompt sampled G times appears G times).
        prompt_length: P, the batch's padded prompt width (responses start there).
    """
    function = reward_function.load()
    texts = [prompt_text(tokenizer, prompt) for prompt in prompts]

    def score(sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        responses = decode(tokenizer, response_token_lists(sequences, attention_mask[:, prompt_length:].bool()))
        scores = score_texts(function, reward_function.name, prompts, responses, prompt_ids, prompt_texts=texts)
        return scores.to(sequences.device)

    return score


def plan(job: Job[RolloutSettings]) -> Shards:
    """The iteration's rollout prompts in shards, a prompt's group in one; episodes with an environment."""
    settings = job.settings
    rewards = [settings.reward_model, settings.reward_function, settings.environment]
    if sum(reward is not None for reward in rewards) != 1:
        raise ValueError("rollout needs exactly one reward: a reward model, a reward function or an environment")
    if settings.environment is not None and not load_tokenizer(job.context.base.tokenizer.path).chat_template:
        raise ChatTemplateError(
            "`environment.class`: the tokenizer has no chat template, and episodes are rendered turn by turn through "
            "one (docs/environments.md)"
        )
    shards = job.plan_shards(
        settings.prompts, rows_per_item=settings.samples_per_prompt, rows_per_shard=settings.rows_per_shard
    )
    table = "experience" if settings.environment is None else "episodes"
    return Shards(shards, table=table, not_resumable=episodes.not_resumable(settings.environment))


def rollout_prompts(job: Job[RolloutSettings]) -> list[tuple[int, Prompt]]:
    """The iteration's rollout prompts, ``(prompt_id, prompt)``."""
    return rotating_subset(
        read_prompts(job.context.base.prompts.path),
        count=job.settings.prompts,
        iteration=job.context.iteration,
        offset=ROLLOUT_PROMPT_OFFSET,
    )


def work(job: Job[RolloutSettings]) -> Iterator[pa.Table]:
    """The ``experience`` rows of each shard of the iteration's rollout prompts (or its episodes', with an
    environment: :mod:`tasks.episodes`)."""
    settings, context = job.settings, job.context
    if settings.environment is not None:
        yield from episodes.work(job, rollout_prompts(job))
        return
    sampling, samples_per_prompt = settings.sampling, settings.samples_per_prompt
    models = job.models(settings.precision)
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    policy = settings.policy.directory
    actor = models.load("actor", policy / "actor")
    sampler = policy_sampler(models, context, policy / "actor", actor, sampling)
    critic_dir = critic_folder(policy, settings.critic_start)  # none for a critic-free policy
    statistics = critic_score_statistics(policy, settings.critic_start)
    critic = models.load("critic", critic_dir, score_statistics=statistics) if critic_dir.is_dir() else None
    scorer = None
    if settings.reward_model is not None:
        scorer = reward_scorer(
            models.load("reward_model", settings.reward_model.directory / "reward_model"),
            policy_tokenizer_dir=context.base.tokenizer.path,
            reward_tokenizer_dir=context.base.reward_tokenizer,
        )
    reference = models.reference(actor)
    version = policy_version(settings.policy)
    chosen = rollout_prompts(job)
    batches = sum(len(range(shard.start, shard.stop, sampling.batch_size)) for shard in job.shards)
    with stage_bar(total=batches, desc=job.stage, unit="batch") as bar:  # closed on an error too: its line ends
        for shard in job.shards:
            generator = shard.generator()
            tables = []
            rows = [prompt for _, prompt in chosen[shard.start : shard.stop] for _ in range(samples_per_prompt)]
            first = shard.start * samples_per_prompt
            seeds = row_seeds(sampling, shard, first, len(rows))
            sample_whole_shard(sampler, tokenizer, rows, seeds=seeds, sampling=sampling)
            for part in shard.batches(sampling.batch_size):
                # Each prompt's G samples sit in consecutive rows.
                batch = [prompt for _, prompt in chosen[part] for _ in range(samples_per_prompt)]
                group_ids = [index for index, _ in chosen[part] for _ in range(samples_per_prompt)]
                prompt_ids, prompt_mask = encode_prompts(tokenizer, [prompt for _, prompt in chosen[part]])
                prompt_ids = prompt_ids.repeat_interleave(samples_per_prompt, dim=0)  # (b * G, P)
                prompt_mask = prompt_mask.repeat_interleave(samples_per_prompt, dim=0)  # (b * G, P)
                length = prompt_ids.shape[1]
                if scorer is not None:
                    score = model_scorer(scorer, batch, length)
                else:
                    score = function_scorer(settings.reward_function, tokenizer, batch, group_ids, length)
                maker = ExperienceMaker(
                    actor,
                    critic,
                    score,
                    reference,
                    sampling=sampling,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    precision=models.precision,
                    sampler=None if sampler is actor else sampler,
                )
                first_row = part.start * samples_per_prompt
                experience = maker.make_experience(
                    prompt_ids,
                    prompt_mask,
                    group_ids=torch.tensor(group_ids),
                    generator=generator,
                    seeds=row_seeds(sampling, shard, first_row, len(batch)),
                )
                experience = experience.replace(policy_versions=torch.full((len(batch),), version))
                tables.append(experience_to_table(experience, first_row=first_row))
                bar.update(1)
            yield pa.concat_tables(tables)


def gather(job: Job[RolloutSettings], table: pa.Table) -> dict[str, float]:
    """Write the ``experience`` table: ``samples_per_prompt`` scored rollouts for each of ``prompts`` prompts (and
    with an environment, the ``turns`` table: :func:`tasks.episodes.gather`)."""
    if job.settings.environment is not None:
        return episodes.gather(job, table)
    job.out.write_table("experience", table, schema=EXPERIENCE, rows_per_shard=job.settings.rows_per_shard)
    scores = table.column("scores").to_pylist()
    lengths = [len(ids) for ids in table.column("response_ids").to_pylist()]
    return {
        "score_mean": sum(scores) / len(scores),
        "response_length_mean": sum(lengths) / len(lengths),
        # a learned reward drifts to length first: watch its correlation (rlhf_core.evaluation, choice 4)
        "score_length_correlation": float(
            correlation(torch.tensor(scores), torch.tensor(lengths, dtype=torch.float64))
        ),
        "rollouts": float(len(scores)),
        "policy_version": float(min(table.column("policy_version").to_pylist())),
        **mismatch_metrics(table),
    }


rollout = Stage(RolloutSettings, plan=plan, work=work, gather=gather)
