"""Making experience: generate responses and score them with actor, reference, critic and reward.

Choices:
1. The rollout log-probs are the ones the sampler computed (:mod:`rlhf_core.generation`), which
   equal a training-time forward of the same model up to float rounding; re-running the actor
   over the batch would cost a forward pass and change nothing.
2. Reference log-probs, values and scores each take one forward pass over ``(B, T)``.
3. The reward is any callable ``(sequences, attention_mask) -> (B,)``: a :class:`RewardModel`,
   or a programmatic score for tests and gold-labelled demos.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from rlhf_core.config import AdvantageConfig, SamplingConfig
from rlhf_core.experience import Experience
from rlhf_core.gae import compute_gae
from rlhf_core.generation import generate
from rlhf_core.models import Critic, evaluating, fused_activations
from rlhf_core.rewards import normalize_scores, shaped_rewards
from rlhf_core.sequences import logprobs_from_logits, response_logits, response_slice

ScoreFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(sequences (B, T), attention_mask (B, T)) -> scores (B,)``."""


class ExperienceMaker(ABC):
    """Turns a batch of prompts into :class:`Experience` (the interface of ColossalChat's maker)."""

    def __init__(
        self,
        actor: PreTrainedModel,
        critic: Critic,
        reward_model: ScoreFn,
        initial_model: PreTrainedModel,
    ) -> None:
        self.actor = actor
        self.critic = critic
        self.reward_model = reward_model
        self.initial_model = initial_model

    @abstractmethod
    def make_experience(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **generate_kwargs) -> Experience:
        """Shapes: input_ids, attention_mask: (B, P) left-padded prompts."""


@torch.no_grad()
def reference_logprobs(
    model: PreTrainedModel,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    *,
    temperature: float,
) -> torch.Tensor:
    """Log-probs of the response tokens under ``model`` (one forward pass).

    Shapes:
        sequences, attention_mask: (B, T); returns (B, R).
    """
    logits = response_logits(model, sequences, attention_mask, prompt_length)  # (B, R, V)
    return logprobs_from_logits(logits, sequences[:, prompt_length:], temperature=temperature)


@torch.no_grad()
def score_experience(
    experience: Experience, config: AdvantageConfig, *, score_mean: float = 0.0, score_std: float = 1.0
) -> Experience:
    """Fill rewards, KL, advantages and returns from a rollout (pure; the replayable stage).

    Args:
        experience: a rollout (scored or not; scored fields are recomputed).
        config: KL coefficient and estimator, gamma, lambda, score clipping and normalisation.
        score_mean, score_std: reward-model score statistics on held-out data, used when
            ``config.normalize_scores`` is set.

    Shapes:
        every (B, R) field of ``experience``; returns a new Experience.
    """
    scores = experience.scores
    if config.normalize_scores:
        scores = normalize_scores(scores, mean=score_mean, std=score_std)
    rewards, kl = shaped_rewards(
        scores,
        experience.action_log_probs,
        experience.ref_log_probs,
        experience.action_mask,
        kl_coef=config.kl_coef,
        estimator=config.kl_estimator,
        score_clip=config.score_clip,
    )
    advantages, returns = compute_gae(
        rewards, experience.values, experience.action_mask, gamma=config.gamma, gae_lambda=config.gae_lambda
    )
    return experience.replace(reward=rewards, kl=kl, advantages=advantages, returns=returns)


class PPOExperienceMaker(ExperienceMaker):
    """Samples with the actor, then scores with reference, critic and reward in one pass each."""

    def __init__(
        self,
        actor: PreTrainedModel,
        critic: Critic,
        reward_model: ScoreFn,
        initial_model: PreTrainedModel,
        *,
        sampling: SamplingConfig,
        eos_token_id: int | None,
        pad_token_id: int,
        advantage_config: AdvantageConfig | None = None,
        score_mean: float | None = None,
        score_std: float | None = None,
    ) -> None:
        """``score_mean`` and ``score_std`` (the reward model's held-out statistics) are required
        when ``advantage_config.normalize_scores`` is set, and used only then."""
        if (
            advantage_config is not None
            and advantage_config.normalize_scores
            and (score_mean is None or score_std is None)
        ):
            raise ValueError(
                "`advantage_config.normalize_scores` is set: pass `score_mean` and `score_std` (the reward model's "
                "held-out score statistics), or turn normalisation off"
            )
        super().__init__(actor, critic, reward_model, initial_model)
        self.sampling = sampling
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.advantage_config = advantage_config
        self.score_mean = 0.0 if score_mean is None else score_mean
        self.score_std = 1.0 if score_std is None else score_std

    @torch.no_grad()
    def make_experience(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> Experience:
        """One response per prompt row, scored; with ``advantage_config`` set, also rewards and GAE.

        Shapes:
            input_ids, attention_mask: (B, P); returns Experience with T = P + R.
        """
        prompt_length = input_ids.shape[1]
        generation = generate(
            self.actor,
            input_ids,
            attention_mask,
            config=self.sampling,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            generator=generator,
        )
        sequences, full_mask = generation.sequences, generation.attention_mask  # (B, T)
        action_mask = generation.action_mask  # (B, R)
        models = (self.critic, self.reward_model, self.initial_model)
        with evaluating(*models), fused_activations(*models):
            ref_log_probs = reference_logprobs(
                self.initial_model, sequences, full_mask, prompt_length, temperature=self.sampling.temperature
            )
            values = response_slice(self.critic(sequences, full_mask), prompt_length)  # (B, R)
            scores = self.reward_model(sequences, full_mask).float()  # (B,)
        float_mask = action_mask.float()
        experience = Experience(
            sequences=sequences,
            attention_mask=full_mask,
            action_mask=action_mask,
            action_log_probs=generation.logprobs,
            ref_log_probs=ref_log_probs * float_mask,
            values=values * float_mask,
            scores=scores,
        )
        if self.advantage_config is not None:
            experience = score_experience(
                experience, self.advantage_config, score_mean=self.score_mean, score_std=self.score_std
            )
        return experience
