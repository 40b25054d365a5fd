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
   or a programmatic score for tests and gold-labelled demos.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from rlhf_core.config import AdvantageConfig, SamplingConfig
from rlhf_core.experience import Experience
from rlhf_core.gae import compute_gae
from rlhf_core.generation import generate
from rlhf_core.models import Critic, evaluating, fused_activations
from rlhf_core.precision import Precision, autocast, check_precision
from rlhf_core.rewards import normalize_scores, shaped_rewards
from rlhf_core.sequences import logprobs_from_logits, response_logits, response_slice

ScoreFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(sequences (B, T), attention_mask (B, T)) -> scores (B,)``."""


@torch.no_grad()
def sequence_logprobs(
    model: PreTrainedModel,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    *,
    temperature: float,
) -> torch.Tensor:
    """Log-probs of the response tokens under ``model`` (one forward pass), in fp32.

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
        experience.old_logprobs,
        experience.ref_logprobs,
        experience.action_mask,
        kl_coef=config.kl_coef,
        estimator=config.kl_estimator,
        score_clip=config.score_clip,
    )
    advantages, returns = compute_gae(
        rewards, experience.old_values, experience.action_mask, gamma=config.gamma, gae_lambda=config.gae_lambda
    )
    return experience.replace(rewards=rewards, kl=kl, advantages=advantages, returns=returns)


class ExperienceMaker:
    """Samples with the actor, then scores with reference, critic and reward in one pass each.

    The interface of ColossalChat's ``ExperienceMaker`` (``make_experience``), over four models:

    Args:
        actor: the policy being trained (a causal LM).
        critic: its value model.
        reward_model: any callable ``(sequences, attention_mask) -> (B,)``, e.g. a :class:`RewardModel`.
        reference: the frozen initial policy.
        sampling: temperature, top-k, top-p, response length.
        eos_token_id, pad_token_id: the tokenizer's.
        precision: the forward passes run in this precision (:mod:`rlhf_core.precision`) on the
            actor's device; below fp32 the rollout log-probs are recomputed by a full forward
            pass (see choice 1).
    """

    def __init__(
        self,
        actor: PreTrainedModel,
        critic: Critic,
        reward_model: ScoreFn,
        reference: PreTrainedModel,
        *,
        sampling: SamplingConfig,
        eos_token_id: int | None,
        pad_token_id: int,
        precision: Precision = "fp32",
    ) -> None:
        self.actor = actor
        self.critic = critic
        self.reward_model = reward_model
        self.reference = reference
        self.sampling = sampling
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.precision = check_precision(precision)

    @torch.no_grad()
    def make_experience(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> Experience:
        """One response per prompt row, scored by reference, critic and reward model.

        Args:
            input_ids, attention_mask: left-padded prompts, on any device (moved to the actor's).
            generator: CPU random stream for sampling.

        Shapes:
            input_ids, attention_mask: (B, P); returns Experience with T = P + R, on the actor's device.
        """
        device = next(self.actor.parameters()).device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        prompt_length = input_ids.shape[1]
        temperature = self.sampling.temperature
        with autocast(device, self.precision):
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
            old_logprobs = generation.logprobs  # (B, R)
            models = (self.actor, self.critic, self.reward_model, self.reference)
            with evaluating(*models), fused_activations(*models):
                if self.precision != "fp32":
                    old_logprobs = sequence_logprobs(
                        self.actor, sequences, full_mask, prompt_length, temperature=temperature
                    )
                ref_logprobs = sequence_logprobs(
                    self.reference, sequences, full_mask, prompt_length, temperature=temperature
                )
                old_values = response_slice(self.critic(sequences, full_mask), prompt_length)  # (B, R)
                scores = self.reward_model(sequences, full_mask).float()  # (B,)
        action_mask = generation.action_mask  # (B, R)
        return Experience(
            sequences=sequences,
            attention_mask=full_mask,
            action_mask=action_mask,
            old_logprobs=torch.where(action_mask, old_logprobs, 0.0),
            ref_logprobs=torch.where(action_mask, ref_logprobs, 0.0),
            old_values=torch.where(action_mask, old_values.float(), 0.0),
            scores=scores,
        )
