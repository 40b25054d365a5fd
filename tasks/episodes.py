"""The rollout of multi-turn episodes (``environment.class``): the model answers, the environment replies, until
it is done or the model has had ``environment.max_turns`` turns (docs/environments.md).

Choices:
1. Token in, token out. Each turn samples from the episode's ids so far (:func:`rlhf_core.generation.generate`, on
   either engine: the engine is given the ids, never text), and the sampled ids are kept as sampled; the model's text
   is decoded only for the environment.
   Between two model turns only the chat template's delta is appended (:func:`tasks.sft_text.turn_delta`): the rest
   of the model's turn after its end-of-turn token, the environment's message, the next assistant header. A turn
   cut at ``max_tokens_per_turn`` is closed by the template's end-of-turn token, appended as the environment's (the
   model did not sample it). Nothing is re-tokenized, so nothing drifts; :func:`tasks.sft_text.rendering_drifts`
   still counts the episodes a full re-render would tokenize otherwise (``retokenization_drift``, a metric only).
2. The first user message is the environment's (``reset``), rendered as a one-message chat prompt; the prompt row's
   own text and columns are the ``row`` it is given.
3. The live episodes of a batch sample each turn together, from the shard's generator (``hf``: the same shard samples
   the same episodes wherever it runs); on ``vllm`` every live episode's turn is a row of one request to the engine
   (:class:`tasks.sampler.WholeShards`, behind its probe gate), seeded by its episode and turn
   (:func:`runtime.seeds.turn_seed`), so its tokens depend on no other episode nor on the batching. Environments are
   played by one :class:`runtime.environments.EnvironmentRunner` per shard, out of this process, each reset with
   :func:`runtime.seeds.episode_seed`.
4. Failures are rows: an environment that raises or times out ends its episode with its stop reason; the episode is
   kept with the turn rewards it had (the failed call's is 0.0), and its ``action_mask`` is all False, so none of
   its tokens reaches a loss. It stays in its group with that reward (docs/environments.md, "Failures").
5. The turns of each episode (model turns and environment replies, with their token ranges in the response
   window) travel with its experience row (:data:`storage.schemas.EPISODES`) and become the ``turns`` table.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import SamplingConfig
from rlhf_core.errors import UserError
from rlhf_core.experience_maker import episode_experience
from rlhf_core.generation import ExternalSampler, generate
from runtime.bars import stage_bar
from runtime.environments import DONE, EnvironmentReply, EnvironmentRunner
from runtime.job import Job
from runtime.references import EnvironmentReference
from runtime.seeds import episode_seed, turn_seed
from storage.experience_io import experience_to_table
from storage.schemas import (
    DONE as DONE_COLUMN,
)
from storage.schemas import (
    DRIFTS,
    ENVIRONMENT_SEED,
    EXPERIENCE,
    OBSERVATION_SHA256,
    POLICY_VERSION,
    PROMPT_ID,
    ROLE,
    ROW,
    SCORES,
    SEGMENT,
    STOP_REASON,
    TOKEN_START,
    TOKEN_STOP,
    TURN,
    TURN_REWARD,
    TURNS,
    TURNS_TABLE,
)
from tasks.sampler import mismatch_metrics, policy_sampler, sample_rows_ahead
from tasks.settings import RolloutSettings, critic_folder, critic_score_statistics
from tasks.sft_text import rendering_drifts, turn_delta
from tasks.staleness import policy_version
from tasks.tensors import pad_token_lists
from tasks.text import Prompt, load_tokenizer, prompt_ids

MAX_TURNS = "max_turns"
"""The stop reason of an episode still going after its last allowed model turn."""
ASSISTANT, USER = "assistant", "user"


@dataclass
class Episode:
    """One episode as it is played: its ids, which of them are the model's, and its turns."""

    key: tuple[int, int]
    """``(prompt_id, sample)``: its id among the runner's live episodes."""
    seed: int
    prompt: list[int]
    messages: list[dict[str, str]]
    response: list[int] = field(default_factory=list)
    actions: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """The sampler's log-prob of each model token, 0.0 at the environment's."""
    segments: list[dict[str, Any]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    stop_reason: str | None = None
    drifts: bool = False
    """Whether a full re-render of its conversation tokenizes otherwise than its ids (choice 1)."""

    @property
    def failed(self) -> bool:
        """Whether its environment failed (an error or a timeout): it is kept out of the loss (choice 4)."""
        return self.stop_reason is not None and self.stop_reason not in (DONE, MAX_TURNS)

    def append(
        self, ids: Sequence[int], *, role: str, logprobs: Sequence[float] = (), observation: str | None = None
    ) -> None:
        """Append a segment: the model's turn (with its log-probs) or the environment's delta after it (with the
        message it renders, whose digest the turns table keeps)."""
        start = len(self.response)
        self.response += ids
        self.actions += [role == ASSISTANT] * len(ids)
        self.logprobs += list(logprobs) if role == ASSISTANT else [0.0] * len(ids)
        self.segments.append(
            {
                TURN: max(
                    len(self.turn_rewards) - (role == USER), 0
                ),  # a reply is numbered by the model turn it answers
                ROLE: role,
                TOKEN_START: start,
                TOKEN_STOP: len(self.response),
                TURN_REWARD: None,
                DONE_COLUMN: False,
                STOP_REASON: None,
                ENVIRONMENT_SEED: self.seed,
                OBSERVATION_SHA256: None if observation is None else sha256(observation.encode()).hexdigest(),
            }
        )

    def end(self, reason: str) -> None:
        """End the episode: its last segment says why (a reset that failed: an empty one of the environment's)."""
        self.stop_reason = reason
        if not self.segments:
            self.append([], role=USER)
        self.segments[-1].update({DONE_COLUMN: True, STOP_REASON: reason})


def play_episodes(
    runner: EnvironmentRunner,
    sampler: PreTrainedModel | ExternalSampler,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[tuple[int, int, Prompt]],
    *,
    seed: int,
    iteration: int,
    sampling: SamplingConfig,
    max_turns: int,
    max_tokens_per_turn: int,
    generator: torch.Generator,
    refuse_failed_resets: bool = True,
) -> list[Episode]:
    """Play one episode per ``(prompt_id, sample, prompt)``, the live ones sampling together turn by turn.

    Args:
        sampler: the actor (``hf``), or the engine serving it behind its probe gate (``vllm``,
            :func:`tasks.sampler.policy_sampler`): each turn gets the episode's ids so far and its
            :func:`runtime.seeds.turn_seed`, and ``max_tokens_per_turn`` tokens (choice 3).
        generator: the ``hf`` sampler's random stream (the engine seeds each row itself).
        refuse_failed_resets: refuse ``prompts`` whose every reset failed, before any sampling
            (:func:`check_some_episode_ended`: a rollout's); False plays on, every episode a failure (an evaluation's,
            which reports them).

    Returns:
        The episodes, in the order of ``prompts``, each ended with its stop reason.
    """
    episodes = [_reset(runner, tokenizer, *item, seed=seed, iteration=iteration) for item in prompts]
    reset = [episode.stop_reason for episode in episodes if episode.stop_reason is not None]
    if refuse_failed_resets:
        check_some_episode_ended(reset, len(episodes), when=" at its reset, before any sampling")
    config = dataclasses.replace(sampling, max_new_tokens=max_tokens_per_turn)
    device = next(sampler.parameters()).device if isinstance(sampler, torch.nn.Module) else torch.device("cpu")
    for turn in range(max_turns):
        live = [episode for episode in episodes if episode.stop_reason is None]
        seeds = [turn_seed(episode.seed, turn) for episode in live]  # the engine's (choice 3)
        so_far = [episode.prompt + episode.response for episode in live]
        sample_rows_ahead(sampler, so_far, seeds, config=config, eos_token_id=tokenizer.eos_token_id)
        for start in range(0, len(live), sampling.batch_size):
            batch = live[start : start + sampling.batch_size]
            # 1. The model's turn from the episode's ids so far (token in, token out: choice 1).
            ids, mask = pad_token_lists(
                so_far[start : start + sampling.batch_size], pad_token_id=tokenizer.pad_token_id, side="left"
            )  # (b, L) each
            generation = generate(
                sampler,
                ids.to(device),
                mask.to(device),
                config=config,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                generator=generator,
                seeds=seeds[start : start + sampling.batch_size],
            )
            sampled = generation.sequences[:, ids.shape[1] :].cpu()  # (b, r)
            taken, logprobs = generation.action_mask.cpu(), generation.logprobs.float().cpu()  # (b, r) each
            for row, episode in enumerate(batch):
                tokens = sampled[row][taken[row]].tolist()
                episode.append(tokens, role=ASSISTANT, logprobs=logprobs[row][taken[row]].tolist())
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                episode.messages.append({"role": ASSISTANT, "content": text})
                # 2. The environment's reply, and the template's delta for it.
                ended = bool(tokens) and tokens[-1] == tokenizer.eos_token_id
                _answer(
                    runner, tokenizer, episode, runner.step(episode.key, text), ended=ended, last=turn == max_turns - 1
                )
    for episode in filter(lambda episode: episode.response, episodes):  # 3. The drift check: a metric (choice 1).
        last = max(i for i, message in enumerate(episode.messages) if message["role"] == ASSISTANT)
        stop = max(segment[TOKEN_STOP] for segment in episode.segments if segment[ROLE] == ASSISTANT)
        episode.drifts = rendering_drifts(
            tokenizer, episode.messages[: last + 1], episode.prompt + episode.response[:stop]
        )
    return episodes


def _reset(
    runner: EnvironmentRunner,
    tokenizer: PreTrainedTokenizerBase,
    prompt_id: int,
    sample: int,
    prompt: Prompt,
    *,
    seed: int,
    iteration: int,
) -> Episode:
    """A new episode, its environment reset (choice 2); one whose reset failed is ended already, with no turn."""
    reset_seed = episode_seed(seed, iteration, prompt_id, sample)
    row = {**prompt.columns, "prompt": prompt.text, "messages": list(prompt.messages)}
    reply = runner.reset((prompt_id, sample), seed=reset_seed, row=row)
    first = {"role": USER, "content": reply.observation if reply.observation is not None else prompt.text}
    episode = Episode(
        (prompt_id, sample), reset_seed, prompt_ids(tokenizer, Prompt(first["content"], (first,))), [first]
    )
    if reply.done:
        episode.end(reply.stop_reason or DONE)
    return episode


def _answer(
    runner: EnvironmentRunner,
    tokenizer: PreTrainedTokenizerBase,
    episode: Episode,
    reply: EnvironmentReply,
    *,
    ended: bool,
    last: bool,
) -> None:
    """The environment's reply to the model's turn: its reward, then the end of the episode or the delta to append.
    With no message (None) the model answers again after the template's delta alone."""
    episode.turn_rewards.append(reply.reward)
    episode.segments[-1][TURN_REWARD] = reply.reward
    if reply.done:
        episode.end(reply.stop_reason or DONE)
    elif last:
        runner.end(episode.key)
        episode.end(MAX_TURNS)
    else:
        if reply.observation is not None:
            episode.messages.append({"role": USER, "content": reply.observation})
        delta = turn_delta(tokenizer, episode.messages, ended=ended)
        episode.append(delta, role=USER, observation=reply.observation)


def episode_tensors(
    episodes: Sequence[Episode], *, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The episodes as one batch: ``[left-padded prompt | right-padded response window]`` ids and their attention
    mask, and the model's tokens of the window (True where the model sampled a token, whether or not it failed).

    Shapes:
        returns (B, T), (B, T) and (B, R); the window starts at ``T - R``.
    """
    prompts, prompt_mask = pad_token_lists([e.prompt for e in episodes], pad_token_id=pad_token_id, side="left")
    response, response_mask = pad_token_lists([e.response for e in episodes], pad_token_id=pad_token_id)  # (B, R)
    width = response.shape[1]
    actions = torch.tensor(
        [e.actions + [False] * (width - len(e.actions)) for e in episodes], dtype=torch.bool
    ).reshape(len(episodes), width)  # (B, R)
    return torch.cat([prompts, response], dim=1), torch.cat([prompt_mask, response_mask], dim=1), actions


def episode_table(
    episodes: Sequence[Episode],
    actor: PreTrainedModel,
    critic: Any,
    reference: PreTrainedModel,
    *,
    pad_token_id: int,
    temperature: float,
    precision: Any,
    first_row: int,
    policy_version: int,
) -> pa.Table:
    """The :data:`storage.schemas.EPISODES` rows of ``episodes``: each episode's experience (one forward pass per
    model over the whole episode, :func:`rlhf_core.experience_maker.episode_experience`), its turns and its drift."""
    sequences, attention_mask, actions = episode_tensors(episodes, pad_token_id=pad_token_id)
    width = actions.shape[1]
    failed = torch.tensor([e.failed for e in episodes], dtype=torch.bool)  # (B,)
    actions = actions & ~failed[:, None]  # (B, R): the loss mask, none of a failed episode's (choice 4)
    logprobs = torch.tensor([e.logprobs + [0.0] * (width - len(e.logprobs)) for e in episodes]).reshape(
        len(episodes), width
    )  # (B, R)
    most = max(len(e.turn_rewards) for e in episodes)
    turn_rewards = torch.tensor([e.turn_rewards + [0.0] * (most - len(e.turn_rewards)) for e in episodes]).reshape(
        len(episodes), most
    )  # (B, N)
    device = next(actor.parameters()).device
    experience = episode_experience(
        actor,
        critic,
        reference,
        sequences.to(device),
        attention_mask.to(device),
        actions.to(device),
        turn_rewards=turn_rewards.to(device),
        engine_logprobs=logprobs.to(device),
        group_ids=torch.tensor([e.key[0] for e in episodes], device=device),
        temperature=temperature,
        precision=precision,
    )
    experience = experience.replace(policy_versions=torch.full((len(episodes),), policy_version, device=device))
    table = experience_to_table(experience, first_row=first_row)
    segments = pa.array([e.segments for e in episodes], type=pa.list_(SEGMENT))
    return table.append_column(pa.field(TURNS, segments.type, nullable=False), segments).append_column(
        pa.field(DRIFTS, pa.bool_(), nullable=False), pa.array([e.drifts for e in episodes])
    )


def turns_table(episodes: pa.Table) -> pa.Table:
    """The ``turns`` table (:data:`storage.schemas.TURNS_TABLE`) of the :data:`storage.schemas.EPISODES` rows."""
    counts = pc.list_value_length(episodes.column(TURNS)).to_numpy()
    segments = pc.list_flatten(episodes.column(TURNS)).combine_chunks()  # type: ignore[attr-defined]
    columns = {name: segments.field(name) for name in SEGMENT.names}
    for name in (ROW, PROMPT_ID, POLICY_VERSION):
        columns[name] = pa.array(np.repeat(episodes.column(name).to_numpy(), counts))
    return pa.Table.from_arrays([columns[f.name] for f in TURNS_TABLE], schema=TURNS_TABLE)


def work(job: Job[RolloutSettings], chosen: Sequence[tuple[int, Prompt]]) -> Iterator[pa.Table]:
    """The :data:`storage.schemas.EPISODES` rows of each shard of the ``chosen`` prompts (``(prompt_id, prompt)``):
    ``samples_per_prompt`` episodes per prompt."""
    settings, context = job.settings, job.context
    assert settings.environment is not None
    models = job.models(settings.precision)
    tokenizer = load_tokenizer(context.base.tokenizer.path)
    policy = settings.policy.directory
    actor = models.load("actor", policy / "actor")
    critic_dir = critic_folder(policy, settings.critic_start)  # none for a critic-free policy
    statistics = critic_score_statistics(policy, settings.critic_start)
    critic = models.load("critic", critic_dir, score_statistics=statistics) if critic_dir.is_dir() else None
    reference = models.reference(actor)
    sampler = policy_sampler(models, context, policy / "actor", actor, settings.sampling)
    version = policy_version(settings.policy)
    group = settings.samples_per_prompt
    with (
        EnvironmentRunner(settings.environment, step_timeout_s=settings.step_timeout_s) as runner,
        stage_bar(total=len(job.shards), desc=job.stage, unit="shard") as bar,
    ):
        for shard in job.shards:
            prompts = [
                (index, sample, prompt) for index, prompt in chosen[shard.start : shard.stop] for sample in range(group)
            ]
            with models.autocast():
                episodes = play_episodes(
                    runner,
                    sampler,
                    tokenizer,
                    prompts,
                    seed=context.seed,
                    iteration=context.iteration,
                    sampling=settings.sampling,
                    max_turns=settings.max_turns,
                    max_tokens_per_turn=settings.max_tokens_per_turn,
                    generator=shard.generator(),
                )
            tables = [
                episode_table(
                    episodes[start : start + settings.sampling.batch_size],
                    actor,
                    critic,
                    reference,
                    pad_token_id=tokenizer.pad_token_id,
                    temperature=settings.sampling.temperature,
                    precision=models.precision,
                    first_row=shard.start * group + start,
                    policy_version=version,
                )
                for start in range(0, len(episodes), settings.sampling.batch_size)
            ]
            bar.update(1)
            yield pa.concat_tables(tables)


def not_resumable(environment: EnvironmentReference | None) -> str | None:
    """Why the episodes a crashed stage played with ``environment`` are sampled again rather than reused
    (:attr:`runtime.job.Shards.not_resumable`): its class declares itself non-deterministic, so a run after the crash
    would not play them alike; None for a deterministic one (the default), and without an environment."""
    if environment is None or getattr(environment.load(), "deterministic", True):
        return None
    return (
        f"`environment.class` {environment.name} declares itself non-deterministic (`deterministic = False`): the "
        "episodes a crashed run played are sampled again"
    )


class EveryEpisodeFailed(UserError, RuntimeError):
    """Every episode of a rollout ended in an error or a timeout: there is nothing to train on."""


def check_some_episode_ended(reasons: Sequence[str], episodes: int, *, when: str = "") -> None:
    """Refuse a rollout whose ``episodes`` all failed (``reasons``: each episode's stop reason), in one line naming
    the most frequent failure; before anything of it is written (a failed episode alone is a row: issue 44), and
    where every reset failed, before any sampling (``when`` says so)."""
    failed = [reason for reason in reasons if reason not in (DONE, MAX_TURNS)]
    if episodes and len(failed) >= episodes:
        (reason, count), *_ = Counter(failed).most_common(1)
        raise EveryEpisodeFailed(
            f"rollout: every one of the {episodes} episodes ended in an error or a timeout{when} (`{reason}` "
            f"{count} times): there is nothing to train on; the environment's tracebacks are in the stage's log "
            "(--verbose)"
        )


def gather(job: Job[RolloutSettings], table: pa.Table) -> dict[str, float]:
    """Write the ``experience`` and ``turns`` tables of the episodes; the rollout's metrics, episodes' included.
    A rollout whose episodes all failed is refused before anything is written (:func:`check_some_episode_ended`)."""
    experience = table.drop_columns([TURNS, DRIFTS])
    turns = turns_table(table)
    finals = [reason for reason in turns.column(STOP_REASON).to_pylist() if reason is not None]
    check_some_episode_ended(finals, experience.num_rows)
    rows_per_shard = job.settings.rows_per_shard
    job.out.write_table("experience", experience, schema=EXPERIENCE, rows_per_shard=rows_per_shard)
    job.out.write_table(TURNS, turns, schema=TURNS_TABLE, rows_per_shard=rows_per_shard)
    scores = experience.column(SCORES).to_pylist()
    reasons = [reason for reason in turns.column(STOP_REASON).to_pylist() if reason is not None]
    model_turns = sum(role == ASSISTANT for role in turns.column(ROLE).to_pylist())
    return {
        "score_mean": sum(scores) / len(scores),
        "rollouts": float(len(scores)),
        "turns_mean": model_turns / len(scores),
        "episode_errors": float(sum(reason not in (DONE, MAX_TURNS) for reason in reasons)),
        "retokenization_drift": float(sum(table.column(DRIFTS).to_pylist())),
        "policy_version": float(min(experience.column(POLICY_VERSION).to_pylist())),
        **mismatch_metrics(experience),
    }
