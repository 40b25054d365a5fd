"""Evaluation on held-out episodes (``environment.class``): the reference's episodes, played once per campaign
(:mod:`tasks.sample_reference`), and the policy's, played in every iteration's evaluation (:mod:`tasks.evaluate`), both
by the rollout's episode player (:func:`tasks.episodes.play_episodes`).

Choices:
1. Paired as single-turn evaluation is: held-out prompt i is played as episode ``(i, 0)`` of evaluation's iteration
   (:data:`tasks.held_out.SEED_ITERATION`), so its environment is reset with the same seed on both sides and
   in every iteration, and each shard's turns sample from the shard's generator on both sides.
2. An episode's reward is its environment's (the sum of its turn rewards), which no iteration changes: the reference's
   episodes are scored when they are played, and read back with their rewards.
3. A turn succeeds when its reward is > 0 (:func:`rlhf_core.evaluation.episode_success`). Each side reports its
   reward, success by turn (``success_by_turn_<n>``, n from 1 to ``environment.max_turns``, the last ``success``),
   ``recovery`` (a failed first turn that succeeded later; left out when no first turn failed), ``turns_mean`` and the
   share of each stop reason (``stop_<reason>``, every error one ``stop_error``); the reference's are prefixed
   ``reference_``. The policy's KL to the reference is summed over its model tokens.
4. Failures are rows, as in the rollout: an episode whose environment failed is evaluated with the reward it had,
   and a shard of held-out prompts whose every reset failed is evaluated too (the rollout refuses one).
5. On ``vllm`` both sides play on the engine, behind its probe gate (:func:`tasks.sampler.policy_sampler`: the
   policy's actor folder, the initial policy's for the reference), each turn seeded by its episode and turn on both
   sides alike (:func:`runtime.seeds.turn_seed`); the policy's log-probs by the actor's forward and by the engine are
   kept in the pieces, and their mismatch reported, as single-turn evaluation does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import pyarrow as pa
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.evaluation import episode_success, response_kl
from rlhf_core.generation import ExternalSampler
from rlhf_core.sequences import sequence_logprobs
from runtime.environments import DONE, ERROR, TIMEOUT, EnvironmentRunner
from runtime.job import Job
from runtime.shards import Shard
from storage.schemas import (
    ENGINE_LOGPROBS,
    EPISODE_EVALUATION,
    LOGPROB_COLUMNS,
    OLD_LOGPROBS,
    POLICY_KL,
    PROMPT,
    REFERENCE_EPISODES,
    RESPONSE,
    ROW,
    SAMPLES,
    STOP_REASON,
    TURN_REWARDS,
)
from storage.shards import read_table
from tasks.episodes import MAX_TURNS, Episode, episode_tensors, play_episodes
from tasks.held_out import SEED_ITERATION
from tasks.sampler import mismatch_metrics, policy_sampler
from tasks.settings import EvaluateSettings, SampleReferenceSettings
from tasks.text import load_tokenizer, read_prompts

TABLE = "reference_episodes"
STOP_REASONS = (DONE, MAX_TURNS, TIMEOUT, ERROR)
"""The stop reasons counted apart (choice 3): every ``error: <Type>: <message>`` counts as ``error``."""


def play_held_out(
    job: Job[SampleReferenceSettings] | Job[EvaluateSettings],
    runner: EnvironmentRunner,
    sampler: PreTrainedModel | ExternalSampler,
    tokenizer: PreTrainedTokenizerBase,
    shard: Shard,
) -> list[Episode]:
    """One episode from each held-out prompt of ``shard`` (choice 1), sampled by ``sampler``: a side's model, or the
    engine serving it (choice 5)."""
    settings, models = job.settings, job.models(job.settings.precision)
    held_out = read_prompts(settings.eval_prompts.path)[: settings.prompts]
    with models.autocast():
        return play_episodes(
            runner,
            sampler,
            tokenizer,
            [(index, 0, held_out[index]) for index in range(shard.start, shard.stop)],
            seed=job.context.seed,
            iteration=SEED_ITERATION,
            sampling=settings.sampling,
            max_turns=settings.max_turns,
            max_tokens_per_turn=settings.max_tokens_per_turn,
            generator=shard.generator(),
            refuse_failed_resets=False,  # choice 4
        )


def conversation(episode: Episode) -> str:
    """The episode after the environment's first message, one ``role: text`` line per message."""
    return "\n".join(f"{message['role']}: {message['content']}" for message in episode.messages[1:])


def runner_of(settings: SampleReferenceSettings | EvaluateSettings) -> EnvironmentRunner:
    """The runner of the stage's environments, one process for all its shards (:mod:`runtime.environments`)."""
    assert settings.environment is not None
    return EnvironmentRunner(settings.environment, step_timeout_s=settings.step_timeout_s)


def reference_work(job: Job[SampleReferenceSettings]) -> Iterator[pa.Table]:
    """The :data:`storage.schemas.REFERENCE_EPISODES` rows of each shard: the reference's episode from each prompt."""
    models = job.models(job.settings.precision)
    tokenizer = load_tokenizer(job.context.base.tokenizer.path)
    reference = models.reference()
    sampler = policy_sampler(models, job.context, job.context.base.policy.path, reference, job.settings.sampling)
    with runner_of(job.settings) as runner:
        for shard in job.shards:
            episodes = play_held_out(job, runner, sampler, tokenizer, shard)
            rows = {
                ROW: range(shard.start, shard.stop),
                PROMPT: [episode.messages[0]["content"] for episode in episodes],
                RESPONSE: [conversation(episode) for episode in episodes],
                TURN_REWARDS: [episode.turn_rewards for episode in episodes],
                STOP_REASON: [episode.stop_reason for episode in episodes],
            }
            yield pa.table({name: list(values) for name, values in rows.items()}, schema=REFERENCE_EPISODES)


def reference_gather(job: Job[SampleReferenceSettings], table: pa.Table) -> dict[str, float]:
    """Write the ``reference_episodes`` table."""
    job.out.write_table(TABLE, table, schema=REFERENCE_EPISODES, rows_per_shard=job.settings.rows_per_shard)
    rewards = [sum(turns) for turns in table.column(TURN_REWARDS).to_pylist()]
    return {"responses": float(len(rewards)), "reward_mean": sum(rewards) / max(len(rewards), 1)}


def evaluate_work(job: Job[EvaluateSettings]) -> Iterator[pa.Table]:
    """The :data:`storage.schemas.EPISODE_EVALUATION` rows of each shard: the policy's episode from each held-out
    prompt, its KL to the reference, beside the reference's episode read back."""
    settings, context = job.settings, job.context
    models = job.models(settings.precision)
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    actor = models.load("actor", settings.policy.directory / "actor")
    reference = models.reference(actor)
    sampler = policy_sampler(models, context, settings.policy.directory / "actor", actor, settings.sampling)
    theirs = read_table(settings.reference.directory, TABLE).to_pylist()
    size = settings.sampling.batch_size
    with runner_of(settings) as runner:
        for shard in job.shards:
            episodes = play_held_out(job, runner, sampler, tokenizer, shard)
            scored = [
                row
                for start in range(0, len(episodes), size)
                for row in _kl(actor, reference, episodes[start : start + size], tokenizer, job)
            ]
            rows: dict[str, list] = {name: [] for name in EPISODE_EVALUATION.names}
            for episode, other, (divergence, trainer) in zip(
                episodes, theirs[shard.start : shard.stop], scored, strict=True
            ):
                rows[PROMPT].append(episode.messages[0]["content"])
                rows[POLICY_KL].append(divergence)
                engine = [value for value, action in zip(episode.logprobs, episode.actions, strict=True) if action]
                rows[OLD_LOGPROBS].append(None if sampler is actor else trainer)  # choice 5
                rows[ENGINE_LOGPROBS].append(None if sampler is actor else engine)
                for side, response, turn_rewards, reason in (
                    ("policy", conversation(episode), episode.turn_rewards, episode.stop_reason),
                    ("reference", other[RESPONSE], other[TURN_REWARDS], other[STOP_REASON]),
                ):
                    rows[f"{side}_response"].append(response)
                    rows[f"{side}_reward"].append(float(sum(turn_rewards)))
                    rows[f"{side}_{TURN_REWARDS}"].append(turn_rewards)
                    rows[f"{side}_{STOP_REASON}"].append(reason)
            yield pa.table(rows, schema=EPISODE_EVALUATION)


def _kl(
    actor: PreTrainedModel,
    reference: PreTrainedModel,
    episodes: Sequence[Episode],
    tokenizer: PreTrainedTokenizerBase,
    job: Job[EvaluateSettings],
) -> list[tuple[float, list[float]]]:
    """The policy's KL to the reference over each episode's model tokens, the environment's as context, and the
    actor's log-prob of each of them."""
    models = job.models(job.settings.precision)
    sequences, attention_mask, actions = episode_tensors(episodes, pad_token_id=tokenizer.pad_token_id)
    sequences, attention_mask = sequences.to(models.device), attention_mask.to(models.device)  # (b, T) each
    prompt_length = sequences.shape[1] - actions.shape[1]
    with models.autocast(), torch.no_grad():
        policy, ref = (
            sequence_logprobs(
                model, sequences, attention_mask, prompt_length, temperature=job.settings.sampling.temperature
            )
            for model in (actor, reference)
        )  # (b, R) each
    kl = response_kl(policy, ref, actions.to(models.device)).cpu().tolist()
    trainer = [row[keep].tolist() for row, keep in zip(policy.float().cpu(), actions, strict=True)]
    return list(zip(kl, trainer, strict=True))


def evaluate_gather(job: Job[EvaluateSettings], table: pa.Table) -> dict[str, float]:
    """Write ``samples.jsonl`` (each held-out episode of both sides) and return the evaluation metrics (choice 3)."""
    kl = table.column(POLICY_KL).to_pylist()
    metrics = {"kl_to_reference": sum(kl) / len(kl), **mismatch_metrics(table)}
    for side, prefix in (("policy", ""), ("reference", "reference_")):
        turn_rewards = table.column(f"{side}_{TURN_REWARDS}").to_pylist()
        reasons = table.column(f"{side}_{STOP_REASON}").to_pylist()
        found = side_metrics(turn_rewards, reasons, max_turns=job.settings.max_turns)
        metrics |= {f"{prefix}{name}": value for name, value in found.items()}
    records = table.drop_columns(list(LOGPROB_COLUMNS)).to_pylist()
    (job.out.path / SAMPLES).write_text("".join(json.dumps(record) + "\n" for record in records))
    return metrics


def side_metrics(turn_rewards: list[list[float]], reasons: list[str], *, max_turns: int) -> dict[str, float]:
    """One side's metrics (choice 3) from each episode's turn rewards and stop reason."""
    episodes = len(turn_rewards)
    padded = torch.tensor([rewards + [0.0] * (max_turns - len(rewards)) for rewards in turn_rewards])  # (B, N)
    success = episode_success(padded.reshape(episodes, max_turns), torch.tensor([len(r) for r in turn_rewards]))
    metrics = {
        "reward_mean": sum(map(sum, turn_rewards)) / episodes,
        "success": float(success.by_turn[-1]),
        **{f"success_by_turn_{turn + 1}": float(share) for turn, share in enumerate(success.by_turn)},
        "turns_mean": sum(map(len, turn_rewards)) / episodes,
    }
    if not success.recovered.isnan():
        metrics["recovery"] = float(success.recovered)
    kinds = [reason.split(":")[0] for reason in reasons]  # `error: <Type>: <message>` -> `error`
    return metrics | {f"stop_{reason}": kinds.count(reason) / episodes for reason in STOP_REASONS}
