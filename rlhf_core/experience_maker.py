"""Making experience: generate responses and score them with actor, reference, critic and reward.

Choices:
1. In fp32 the rollout log-probs are the ones the sampler computed (:mod:`rlhf_core.generation`),
   which equal a training-time forward of the same model up to float rounding (about 1e-6);
   re-running the actor would cost a forward pass and change nothing. Under bf16 / fp16 the
   KV-cached decode and a full forward differ by about 2e-3 (measured on CPU with tiny models),
   so the log-probs are recomputed by one full forward pass in the update's own numerics (as
   TRL, OpenRLHF and verl always do): the first PPO step then starts from a ratio of 1.
2. Reference log-probs, values and scores each take one forward pass over ``(B, T)``.
3. The reward is any callable ``(sequences, attention_mask) -> (B,)``: a :class:`RewardModel`,
   or a programmatic score (a verifiable reward, a test's rubric).
4. Without a critic (critic-free estimators) no values are computed: ``old_values`` is None. The values are
   :func:`response_values`, here and wherever a critic's values of stored rows are computed again
   (:func:`compute_values`: an overlapped update's starting critic, :mod:`tasks.critic_values`).
5. :func:`score_experience` (stage 5) dispatches on the estimator: GAE over the KL-shaped rewards
   and the rollout values, or a critic-free estimator of :mod:`rlhf_core.advantages`.
6. The sampler may be the vLLM engine serving the actor (an :class:`rlhf_core.generation.ExternalSampler`): its
   log-probs come from other kernels, so ``old_logprobs`` are then always recomputed by the actor (as TRL does with
   vLLM). The sampler's own log-probs are kept as ``engine_logprobs`` whichever samples, so the mismatch can be
   measured and corrected (:mod:`rlhf_core.mismatch`).
7. An episode (:mod:`rlhf_core.episodes`) is sampled turn by turn by the caller, which plays the environment; its
   rollout quantities take one forward pass per model over the whole episode (:func:`episode_experience`), and
   stage 5 scores it over the model's tokens only (:func:`score_experience`: the turn rewards at each turn's last
   model token, the episode reward, their sum, against its group).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from rlhf_core.config import AdvantageConfig, SamplingConfig
from rlhf_core.episodes import (
    episode_gae,
    episode_group_advantages,
    episode_reinforce_pp_advantages,
    episode_shaped_rewards,
)
from rlhf_core.experience import Experience
from rlhf_core.generation import ExternalSampler, generate
from rlhf_core.models import Critic, evaluating, fused_activations
from rlhf_core.precision import Precision, autocast, check_precision
from rlhf_core.rewards import normalize_scores
from rlhf_core.sequences import response_slice, sequence_logprobs

ScoreFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(sequences (B, T), attention_mask (B, T)) -> scores (B,)``."""


@torch.no_grad()
def score_experience(
    experience: Experience,
    config: AdvantageConfig,
    *,
    score_mean: float = 0.0,
    score_std: float = 1.0,
    kl_coef: float | None = None,
) -> Experience:
    """Fill rewards, KL, advantages and returns from a rollout (pure; the replayable stage).

    Every row is scored as an episode (:mod:`rlhf_core.episodes`, choice 7): a single-turn row is the episode of one
    turn, for which the episode functions are the single-turn ones bit for bit.

    1. Scores are normalised (``config.normalize_scores``) and clipped (``config.score_clip``); an episode's turn
       rewards are the environment's own, clipped, never normalised.
    2. Per-token rewards: the KL penalty (``kl_coef`` when ``config.kl_in`` is ``reward``, else 0)
       plus the score on the last action token (:func:`rlhf_core.rewards.shaped_rewards`).
    3. Advantages by ``config.estimator``:

       * ``gae``: GAE over those rewards and the rollout's values; returns are the critic targets.
       * ``reinforce_pp``: the rewards' return, whitened over the batch (:func:`reinforce_pp_advantages`).
       * ``grpo``, ``dr_grpo``, ``rloo``: the score against its group (:func:`group_advantages`) at
         every token, plus the KL penalty still to come from that token (gamma = 1).

       A critic-free estimator's ``returns`` are the rewards' return (reward-to-go; discounted by
       ``config.gamma`` for REINFORCE++ only, like its advantages).

    Args:
        experience: a rollout (scored or not; scored fields are recomputed); group estimators need
            its ``group_ids``, GAE its ``old_values``.
        config: estimator, KL coefficient, estimator and placement, gamma, lambda, score clipping
            and normalisation.
        score_mean, score_std: reward-model score statistics on held-out data, used when
            ``config.normalize_scores`` is set.
        kl_coef: the reward's KL coefficient when it differs from ``config.kl_coef`` (the adaptive
            controller's current value).

    Shapes:
        every (B, R) field of ``experience``; returns a new Experience.

    Raises:
        ValueError: GAE on a rollout without values, or a group estimator without ``group_ids``.
    """
    if experience.turn_rewards is not None:  # an episode's turn rewards are the environment's own: never normalised
        turn_rewards = experience.turn_rewards  # (B, N)
    else:  # a single-turn row is the episode of one turn (rlhf_core.episodes: bit for bit the single-turn maths)
        scores = experience.scores  # (B,)
        if config.normalize_scores:
            scores = normalize_scores(scores, mean=score_mean, std=score_std)
        turn_rewards = scores[:, None]  # (B, 1)
    if config.score_clip is not None:
        turn_rewards = turn_rewards.clamp(-config.score_clip, config.score_clip)
    coef = (config.kl_coef if kl_coef is None else kl_coef) if config.kl_in == "reward" else 0.0
    mask = experience.action_mask
    rewards, kl = episode_shaped_rewards(
        turn_rewards,
        experience.old_logprobs,
        experience.ref_logprobs,
        mask,
        kl_coef=coef,
        estimator=config.kl_estimator,
    )
    if config.estimator == "gae":
        if experience.old_values is None:
            raise ValueError("estimator `gae` needs the critic's values, but this rollout was made without a critic")
        result = episode_gae(rewards, experience.old_values, mask, gamma=config.gamma, gae_lambda=config.gae_lambda)
    elif config.estimator == "reinforce_pp":
        result = episode_reinforce_pp_advantages(rewards, mask, gamma=config.gamma)
    else:
        if experience.group_ids is None:
            raise ValueError(f"estimator `{config.estimator}` needs `group_ids`: the prompt of each rollout")
        result = episode_group_advantages(
            turn_rewards, rewards, kl, mask, experience.group_ids, estimator=config.estimator, kl_coef=coef
        )
    return experience.replace(rewards=rewards, kl=kl, advantages=result.advantages, returns=result.returns)


def response_values(
    critic: Critic, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int
) -> torch.Tensor:
    """The critic's value of each response token's state: its output at the position just before the token (the
    convention of :func:`rlhf_core.sequences.response_slice`), in float32. The one place a critic's values of sampled
    rows are computed; the caller chooses the precision, the mode and the padding's value.

    Shapes:
        sequences, attention_mask: (B, T) with the prompt in the first ``prompt_length`` columns; returns (B, R),
        R = T - prompt_length.
    """
    return response_slice(critic(sequences, attention_mask), prompt_length).float()  # (B, R)


@torch.no_grad()
def compute_values(
    critic: Critic, experience: Experience, *, batch_size: int, precision: Precision = "fp32"
) -> torch.Tensor:
    """The values ``critic`` gives the rows of ``experience``, computed as the rollout computes its own
    (:func:`response_values` in eval mode with the same fused activations, in ``precision``), ``batch_size`` rows per
    forward pass, 0 at padding: what a rollout by ``critic`` would have stored as ``old_values`` for these rows (verl's
    ``compute_values`` of the critic an update starts from).

    Shapes:
        returns (B, R) float32 on ``experience.device``.
    """
    prompt_length, parts = experience.prompt_length, []
    with autocast(experience.device, precision), evaluating(critic), fused_activations(critic):
        for start in range(0, experience.batch_size, batch_size):
            rows = slice(start, start + batch_size)
            parts.append(
                response_values(critic, experience.sequences[rows], experience.attention_mask[rows], prompt_length)
            )
    return torch.where(experience.action_mask, torch.cat(parts), 0.0)  # (B, R)


@torch.no_grad()
def episode_experience(
    actor: PreTrainedModel,
    critic: Critic | None,
    reference: PreTrainedModel,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    turn_rewards: torch.Tensor,
    engine_logprobs: torch.Tensor,
    group_ids: torch.Tensor,
    temperature: float,
    precision: Precision = "fp32",
) -> Experience:
    """The rollout quantities of sampled episodes (choice 7): the actor's and the reference's log-probs and the
    critic's values, one forward pass each over every whole episode, the environment's tokens as context.

    Args:
        sequences, attention_mask: ``[left-padded prompt | right-padded response window]``, the window holding the
            model's turns and the environment's replies (all attended to).
        action_mask: True at the model's tokens (all False for an episode kept out of the loss).
        turn_rewards: each model turn's reward, zero-padded; ``scores`` is their sum, the episode's reward.
        engine_logprobs: the sampler's log-probs of the model's tokens (0 elsewhere).
        group_ids: the prompt of each episode.
        temperature: the sampling temperature (log-probs use it).
        precision: the forward passes' precision.

    Shapes:
        sequences, attention_mask: (B, T); action_mask, engine_logprobs: (B, R); turn_rewards: (B, N);
        group_ids: (B,); returns Experience with T = P + R.
    """
    prompt_length = sequences.shape[1] - action_mask.shape[1]
    device = sequences.device
    models = (actor, critic, reference)
    with autocast(device, precision), evaluating(*models), fused_activations(*models):
        old_logprobs = sequence_logprobs(actor, sequences, attention_mask, prompt_length, temperature=temperature)
        ref_logprobs = sequence_logprobs(reference, sequences, attention_mask, prompt_length, temperature=temperature)
        old_values = None
        if critic is not None:
            old_values = response_values(critic, sequences, attention_mask, prompt_length)  # (B, R)
    return Experience(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        old_logprobs=torch.where(action_mask, old_logprobs, 0.0),
        ref_logprobs=torch.where(action_mask, ref_logprobs, 0.0),
        old_values=None if old_values is None else torch.where(action_mask, old_values, 0.0),
        scores=turn_rewards.sum(dim=1).float(),  # (B,)
        group_ids=group_ids,
        engine_logprobs=torch.where(action_mask, engine_logprobs.float(), 0.0),
        turn_rewards=turn_rewards.float(),
    )


class ExperienceMaker:
    """Samples with the actor, then scores with reference, critic and reward in one pass each.

    The interface of ColossalChat's ``ExperienceMaker`` (``make_experience``), over four models:

    Args:
        actor: the policy being trained (a causal LM).
        critic: its value model, or None (critic-free estimators: no values).
        reward_model: any callable ``(sequences, attention_mask) -> (B,)``, e.g. a :class:`RewardModel`.
        reference: the frozen initial policy.
        sampling: temperature, top-k, top-p, response length.
        eos_token_id, pad_token_id: the tokenizer's.
        precision: the forward passes run in this precision (:mod:`rlhf_core.precision`) on the
            actor's device; below fp32 the rollout log-probs are recomputed by a full forward
            pass (see choice 1).
        sampler: what samples: the actor (None), or the engine serving it (choice 6).
    """

    def __init__(
        self,
        actor: PreTrainedModel,
        critic: Critic | None,
        reward_model: ScoreFn,
        reference: PreTrainedModel,
        *,
        sampling: SamplingConfig,
        eos_token_id: int | None,
        pad_token_id: int,
        precision: Precision = "fp32",
        sampler: ExternalSampler | None = None,
    ) -> None:
        self.actor = actor
        self.sampler = sampler
        self.critic = critic
        self.reward_model = reward_model
        self.reference = reference
        self.sampling = sampling
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.precision = check_precision(precision)

    @torch.no_grad()
    def make_experience(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        group_ids: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        seeds: list[int] | None = None,
    ) -> Experience:
        """One response per prompt row, scored by reference, critic and reward.

        Args:
            input_ids, attention_mask: left-padded prompts, on any device (moved to the actor's).
                A prompt sampled G times appears in G rows.
            group_ids: the prompt of each row, carried into the Experience (its ``group_ids``).
            generator: CPU random stream for sampling by the actor.
            seeds: one seed per row, for sampling by the engine.

        Shapes:
            input_ids, attention_mask: (B, P); group_ids: (B,); returns Experience with T = P + R, on
            the actor's device.
        """
        device = next(self.actor.parameters()).device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        prompt_length = input_ids.shape[1]
        temperature = self.sampling.temperature
        with autocast(device, self.precision):
            generation = generate(
                self.actor if self.sampler is None else self.sampler,
                input_ids,
                attention_mask,
                config=self.sampling,
                eos_token_id=self.eos_token_id,
                pad_token_id=self.pad_token_id,
                generator=generator,
                seeds=seeds,
            )
            sequences, full_mask = generation.sequences, generation.attention_mask  # (B, T)
            engine_logprobs = old_logprobs = generation.logprobs  # (B, R)
            models = (self.actor, self.critic, self.reward_model, self.reference)  # None and functions are skipped
            with evaluating(*models), fused_activations(*models):
                if self.precision != "fp32" or self.sampler is not None:
                    old_logprobs = sequence_logprobs(
                        self.actor, sequences, full_mask, prompt_length, temperature=temperature
                    )
                ref_logprobs = sequence_logprobs(
                    self.reference, sequences, full_mask, prompt_length, temperature=temperature
                )
                old_values = None
                if self.critic is not None:
                    old_values = response_values(self.critic, sequences, full_mask, prompt_length)  # (B, R)
                scores = self.reward_model(sequences, full_mask).float()  # (B,)
        action_mask = generation.action_mask  # (B, R)
        return Experience(
            sequences=sequences,
            attention_mask=full_mask,
            action_mask=action_mask,
            old_logprobs=torch.where(action_mask, old_logprobs, 0.0),
            ref_logprobs=torch.where(action_mask, ref_logprobs, 0.0),
            old_values=None if old_values is None else torch.where(action_mask, old_values, 0.0),
            scores=scores.to(device),
            group_ids=None if group_ids is None else group_ids.to(device),
            engine_logprobs=torch.where(action_mask, engine_logprobs.float(), 0.0),
        )
