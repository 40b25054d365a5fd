"""Learning tests with rlhf_core alone: PPO lifts reward; reward-model training separates pairs."""

from __future__ import annotations

import torch

from rlhf_core.config import AdvantageConfig, PPOConfig, RewardModelConfig, SamplingConfig
from rlhf_core.experience_maker import ExperienceMaker, score_experience
from rlhf_core.models import Critic, RewardModel, freeze
from rlhf_core.ppo import ppo_update
from rlhf_core.reward_training import PreferenceBatch, fit_reward_model
from runtime.models import accelerator_for
from tests.conftest import EOS, PAD, left_padded, tiny_causal_lm, tiny_config

TARGET_TOKEN = 7


def target_token_share(sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A programmatic reward: the share of the last 8 tokens equal to TARGET_TOKEN. Shapes: returns (B,)."""
    response = sequences[:, -8:]
    return (response == TARGET_TOKEN).float().mean(dim=1)


def test_ppo_lifts_programmatic_reward_far_above_random_init():
    accelerator = accelerator_for(torch.device("cpu"), "fp32")
    actor = tiny_causal_lm("gpt2", seed=0)
    reference = freeze(tiny_causal_lm("gpt2", seed=0))
    torch.manual_seed(1)
    critic = Critic(config=tiny_config("gpt2"))
    actor_optimizer = torch.optim.AdamW(actor.parameters(), lr=3e-3)
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=3e-3)
    actor, critic, actor_optimizer, critic_optimizer = accelerator.prepare(
        actor, critic, actor_optimizer, critic_optimizer
    )
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0)
    maker = ExperienceMaker(
        actor,
        critic,
        target_token_share,
        reference,
        sampling=sampling,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    prompts, prompt_mask = left_padded([[3, 4, 5], [6, 5], [9, 10, 11, 12], [13]] * 8)  # (32, 4)
    generator = torch.Generator().manual_seed(0)
    mean_scores = []
    for _iteration in range(25):
        experience = maker.make_experience(prompts, prompt_mask, generator=generator)
        experience = score_experience(experience, AdvantageConfig(kl_coef=0.01, normalize_scores=False))
        mean_scores.append(experience.scores.mean().item())
        ppo_update(
            actor,
            critic,
            actor_optimizer,
            critic_optimizer,
            experience,
            PPOConfig(epochs=4, minibatch_size=8),
            accelerator=accelerator,
            temperature=1.0,
            generator=generator,
        )
    # Random init puts about 1/32 of the mass on the target token.
    assert mean_scores[0] < 0.1
    assert sum(mean_scores[-3:]) / 3 > 0.6, mean_scores


def test_reward_model_reaches_high_held_out_accuracy_on_synthetic_pairs():
    """Hidden rule: a response with more copies of token 7 is preferred."""
    accelerator = accelerator_for(torch.device("cpu"), "fp32")
    generator = torch.Generator().manual_seed(0)

    def random_pairs(count: int) -> PreferenceBatch:
        prompt = torch.randint(3, 30, (count, 3), generator=generator)
        a = torch.randint(3, 30, (count, 6), generator=generator)
        b = torch.randint(3, 30, (count, 6), generator=generator)
        a[:, :3] = torch.where(torch.rand(count, 3, generator=generator) < 0.5, TARGET_TOKEN, a[:, :3])
        a_better = (a == TARGET_TOKEN).sum(1) > (b == TARGET_TOKEN).sum(1)
        keep = (a == TARGET_TOKEN).sum(1) != (b == TARGET_TOKEN).sum(1)
        chosen = torch.where(a_better[:, None], a, b)[keep]
        rejected = torch.where(a_better[:, None], b, a)[keep]
        eos = torch.full((int(keep.sum()), 1), EOS)
        chosen_ids = torch.cat([prompt[keep], chosen, eos], dim=1)
        rejected_ids = torch.cat([prompt[keep], rejected, eos], dim=1)
        ones = torch.ones_like(chosen_ids)
        return PreferenceBatch(chosen_ids, ones, rejected_ids, ones, torch.zeros(int(keep.sum())))

    torch.manual_seed(0)
    model = RewardModel(config=tiny_config("llama"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    stats = fit_reward_model(
        model,
        optimizer,
        random_pairs(1200),
        random_pairs(300),
        RewardModelConfig(epochs=4, batch_size=32, learning_rate=3e-3),
        accelerator=accelerator,
        generator=generator,
    )
    assert stats.eval_accuracy > 0.9, stats
    assert stats.eval_loss < 0.4, stats
