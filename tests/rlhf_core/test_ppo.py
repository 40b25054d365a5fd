"""The PPO update: parameters move, the first step has ratio 1, early stop on KL, statistics by hand."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_core.config import AdvantageConfig, PPOConfig, SamplingConfig
from rlhf_core.experience_maker import ExperienceMaker, score_experience
from rlhf_core.losses import entropy_from_logits
from rlhf_core.masked import masked_mean, masked_whiten
from rlhf_core.models import Critic, freeze, fused_activations
from rlhf_core.ppo import explained_variance, kl_to_reference, ppo_update
from rlhf_core.sequences import logprobs_from_logits, position_ids_from_mask, response_logits, response_slice
from runtime.models import accelerator_for
from tests.conftest import EOS, PAD, left_padded, tiny_causal_lm, tiny_config

TEMPERATURE = 0.7
PROMPTS = [[3, 4, 5], [6, 5], [9, 10, 11, 12], [13], [14, 15], [16, 17, 18], [19], [20, 21]]


def setup(*, actor_learning_rate=1e-3, critic_learning_rate=1e-3, dropout=0.0, seed=0, precision="fp32"):
    """Prepared actor and critic, their Adam optimizers, and one scored batch of 8 rollouts."""
    accelerator = accelerator_for(torch.device("cpu"), precision)
    torch.manual_seed(seed)
    config = tiny_config("gpt2")
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = dropout
    actor = AutoModelForCausalLM.from_config(config)
    reference = freeze(tiny_causal_lm("gpt2", seed=seed + 1))
    critic = Critic(config=config)
    # Adam without weight decay: a parameter moves only if it received a gradient.
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=actor_learning_rate)
    critic_optimizer = torch.optim.Adam(critic.parameters(), lr=critic_learning_rate)
    actor, critic, actor_optimizer, critic_optimizer = accelerator.prepare(
        actor, critic, actor_optimizer, critic_optimizer
    )
    maker = ExperienceMaker(
        actor,
        critic,
        lambda sequences, mask: ((sequences == 7) & mask.bool()).float().sum(dim=1),
        reference,
        sampling=SamplingConfig(max_new_tokens=6, temperature=TEMPERATURE),
        eos_token_id=EOS,
        pad_token_id=PAD,
        precision=precision,
    )
    ids, mask = left_padded(PROMPTS)
    experience = maker.make_experience(ids, mask, generator=torch.Generator().manual_seed(seed))
    scored = score_experience(experience, AdvantageConfig(kl_coef=0.05, normalize_scores=False))
    return accelerator, actor, critic, actor_optimizer, critic_optimizer, scored


def update(parts, config: PPOConfig, *, seed: int = 0):
    accelerator, actor, critic, actor_optimizer, critic_optimizer, experience = parts
    return ppo_update(
        actor,
        critic,
        actor_optimizer,
        critic_optimizer,
        experience,
        config,
        accelerator=accelerator,
        temperature=TEMPERATURE,
        generator=torch.Generator().manual_seed(seed),
    )


def test_one_update_changes_every_actor_and_critic_parameter():
    parts = setup()
    _, actor, critic, *_ = parts
    before = {
        model: {name: value.detach().clone() for name, value in model.named_parameters()} for model in (actor, critic)
    }
    stats = update(parts, PPOConfig(epochs=1, minibatch_size=8))
    assert stats.optimizer_steps == 1
    for model in (actor, critic):
        unchanged = [name for name, value in model.named_parameters() if torch.equal(value, before[model][name])]
        assert not unchanged, unchanged


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_first_step_with_the_whole_batch_has_ratio_exactly_one(dropout):
    # One epoch, one minibatch: the loss is evaluated before any step, on the rollout's own policy,
    # with dropout off, so ratio = 1 (up to float rounding) and nothing is clipped.
    parts = setup(dropout=dropout)
    experience = parts[-1]
    stats = update(parts, PPOConfig(epochs=1, minibatch_size=8))
    assert stats.optimizer_steps == 1 and not stats.early_stopped
    assert stats.clip_fraction.item() == 0.0
    assert 0.0 <= stats.approx_kl.item() < 1e-10
    # At ratio 1 the token-mean surrogate is -mean(whitened advantages) = 0.
    assert abs(stats.policy_loss.item()) < 1e-5
    # Current values equal the rollout values, so the clip is inactive: 0.5 * mean((V - R)^2).
    expected_value_loss = 0.5 * masked_mean((experience.old_values - experience.returns) ** 2, experience.action_mask)
    torch.testing.assert_close(stats.value_loss, expected_value_loss, rtol=1e-5, atol=1e-6)
    assert stats.value_clip_fraction.item() == 0.0


def test_under_bf16_the_rollout_log_probs_are_the_training_forward_and_the_first_ratio_is_one():
    # The rollout recomputes its log-probs with one full forward under bf16 autocast over the fp32
    # weights; the update's forward (Accelerate's bf16 mixed precision) is the same computation.
    # Stated tolerance: |log ratio| < 1e-3 per token, for the whole batch and for a minibatch of
    # it (measured here: exactly 0 on CPU; GPU kernels may round differently by batch shape). The
    # KV-cached sampler's own log-probs are off by about 2e-3 in bf16, which is why it recomputes.
    parts = setup(precision="bf16")
    accelerator, actor, _, _, _, experience = parts
    for rows in (torch.arange(8), torch.tensor([0, 3, 5])):
        batch = experience.select(rows)
        with torch.no_grad(), fused_activations(actor):
            logits = response_logits(actor, batch.sequences, batch.attention_mask, batch.prompt_length)
            training = logprobs_from_logits(logits / TEMPERATURE, batch.sequences[:, batch.prompt_length :])
        assert logits.dtype == torch.float32  # Accelerate returns fp32 outputs; the matmuls ran in bf16
        assert (training - batch.old_logprobs)[batch.action_mask].abs().max().item() < 1e-3
    stats = update(parts, PPOConfig(epochs=1, minibatch_size=8))
    assert stats.clip_fraction.item() == 0.0 and 0.0 <= stats.approx_kl.item() < 1e-6


def test_first_step_statistics_without_whitening_and_with_an_entropy_bonus():
    # No whitening: loss = -mean(A) - entropy_coef * entropy, with the entropy of softmax(logits / T).
    parts = setup()
    accelerator, actor, critic, _, _, experience = parts
    with torch.no_grad():
        positions = position_ids_from_mask(experience.attention_mask)
        logits = actor(
            input_ids=experience.sequences, attention_mask=experience.attention_mask, position_ids=positions
        ).logits
        entropy = masked_mean(
            entropy_from_logits(response_slice(logits, experience.prompt_length) / TEMPERATURE),
            experience.action_mask,
        )
    stats = update(parts, PPOConfig(epochs=1, minibatch_size=8, whiten_advantages=False, entropy_coef=0.1))
    torch.testing.assert_close(stats.entropy, entropy, rtol=1e-5, atol=1e-6)
    expected = -masked_mean(experience.advantages, experience.action_mask) - 0.1 * entropy
    torch.testing.assert_close(stats.policy_loss, expected, rtol=1e-5, atol=1e-5)
    assert 0 < entropy.item() <= math.log(32)


def test_sequence_mean_first_step_loss_is_minus_the_mean_of_row_means():
    parts = setup()
    experience = parts[-1]
    stats = update(parts, PPOConfig(epochs=1, minibatch_size=8, aggregation="sequence_mean"))
    whitened = masked_whiten(experience.advantages, experience.action_mask)
    expected = -masked_mean(whitened, experience.action_mask, dim=1).mean()
    torch.testing.assert_close(stats.policy_loss, expected, rtol=1e-5, atol=1e-5)


def test_step_count_stats_are_finite_and_the_callers_experience_is_untouched():
    parts = setup()
    experience = parts[-1]
    advantages = experience.advantages.clone()
    stats = update(parts, PPOConfig(epochs=2, minibatch_size=3))
    assert stats.optimizer_steps == 2 * 3 and not stats.early_stopped  # ceil(8 / 3) = 3 minibatches
    for name, value in stats._asdict().items():
        if isinstance(value, torch.Tensor):
            assert value.dim() == 0 and bool(torch.isfinite(value)), name
            assert not value.requires_grad, name
    assert 0.0 <= stats.clip_fraction.item() <= 1.0 and stats.approx_kl.item() >= 0.0
    torch.testing.assert_close(experience.advantages, advantages, rtol=0.0, atol=0.0)  # whitened on a copy


def test_target_kl_stops_early_with_a_huge_learning_rate():
    # Minibatch 1 is measured before any step (KL ~ 0) and steps; after that step with lr = 1 the
    # policy has moved far, so minibatch 2 measures a KL above the target and stops before its step.
    stats = update(setup(actor_learning_rate=1.0), PPOConfig(epochs=4, minibatch_size=4, target_kl=0.01))
    assert stats.early_stopped
    assert stats.optimizer_steps == 1
    no_target = update(setup(actor_learning_rate=1.0), PPOConfig(epochs=4, minibatch_size=4))
    assert not no_target.early_stopped and no_target.optimizer_steps == 8


def test_kl_to_reference_by_hand():
    # Row 0: token 1 at the sampling policy (ratio 1), k1 = -1.0 - -1.5 = 0.5; token 2 moved down by 0.5 (ratio
    # exp(-0.5) = 0.6065307), k1 = -2.0 - -1.0 = -1.0: 0.5 - 0.6065307 = -0.1065307. Its third column is padding
    # (garbage there, exp(100) included, changes nothing). Row 1 is the sampling policy itself: the k1 sum,
    # 0.5 + 0.75 - 2.0 = -0.75.
    logprobs = torch.tensor([[-1.0, -2.0, 100.0], [-0.5, -0.25, -3.0]], dtype=torch.float64)
    old = torch.tensor([[-1.0, -1.5, -100.0], [-0.5, -0.25, -3.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, 7.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    expected = torch.tensor([0.5 - math.exp(-0.5), -0.75], dtype=torch.float64)
    torch.testing.assert_close(kl_to_reference(logprobs, old, ref, mask), expected)


def kl_per_response(experience) -> torch.Tensor:
    """The rollout's k1 KL to the reference, summed over each response: (B,)."""
    k1 = (experience.old_logprobs - experience.ref_logprobs).masked_fill(~experience.action_mask.bool(), 0.0)
    return k1.sum(dim=1)


def test_a_policy_past_its_kl_budget_takes_no_step_and_one_within_it_updates_as_without_one():
    parts = setup(seed=3)  # a rollout whose k1 estimate is well above 0 (an estimate: seed 0's is -0.22)
    rollout_kl = kl_per_response(parts[-1]).mean()  # the actor and the reference are different random models
    assert rollout_kl > 0.3
    before = copy.deepcopy(parts[1].state_dict())
    # The whole batch is one minibatch, measured before any step at the rollout's own policy: its KL, by hand.
    stats = update(parts, PPOConfig(epochs=2, minibatch_size=8, kl_budget=float(rollout_kl) / 2))
    assert stats.at_kl_budget and stats.early_stopped and stats.optimizer_steps == 0
    torch.testing.assert_close(stats.kl_to_reference, rollout_kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.approx_kl, torch.tensor(0.0), atol=1e-6, rtol=0.0)  # no step: ratio 1
    after = parts[1].state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)  # the policy stays as it was

    within = update(setup(seed=3), PPOConfig(epochs=2, minibatch_size=4, kl_budget=float(rollout_kl) * 100))
    unbudgeted = update(setup(seed=3), PPOConfig(epochs=2, minibatch_size=4))
    assert within.at_kl_budget is False and within.optimizer_steps == unbudgeted.optimizer_steps == 4
    assert unbudgeted.at_kl_budget is None and unbudgeted.kl_to_reference is None
    torch.testing.assert_close(within.policy_loss, unbudgeted.policy_loss, rtol=0.0, atol=0.0)
    assert within.kl_to_reference > 0


def test_the_kl_budget_stops_the_update_once_steps_have_taken_the_policy_past_it():
    # Every minibatch starts within the budget (above the largest response's KL); steps with lr = 1 move the policy
    # far, and a later minibatch measures it past the budget and stops before its step.
    parts = setup(seed=3, actor_learning_rate=1.0)
    budget = float(kl_per_response(parts[-1]).max()) + 0.01
    stats = update(parts, PPOConfig(epochs=4, minibatch_size=4, kl_budget=budget))
    assert stats.at_kl_budget and stats.early_stopped and 0 < stats.optimizer_steps < 8


def test_ppo_update_requires_scored_experience():
    parts = setup()
    unscored = parts[-1].replace(rewards=None, kl=None, advantages=None, returns=None)
    with pytest.raises(ValueError, match="run score_experience first"):
        update((*parts[:-1], unscored), PPOConfig(epochs=1, minibatch_size=8))


def test_explained_variance_by_hand():
    # returns 1, 2, 3, 4 (unbiased var 5/3); values 1, 2, 3, 3: residuals 0, 0, 0, 1 (unbiased var 1/4).
    # EV = 1 - (1/4) / (5/3) = 1 - 0.15 = 0.85. The fifth column is padding.
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0]], dtype=torch.float64)
    values = torch.tensor([[1.0, 2.0, 3.0, 3.0, -100.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, False]])
    torch.testing.assert_close(explained_variance(values, returns, mask), torch.tensor(0.85, dtype=torch.float64))
    # A perfect critic explains everything; a constant one explains nothing.
    torch.testing.assert_close(explained_variance(returns, returns, mask), torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(
        explained_variance(torch.zeros_like(returns), returns, mask), torch.tensor(0.0, dtype=torch.float64)
    )


def test_resuming_after_an_epoch_gives_exactly_the_uninterrupted_update():
    config = PPOConfig(epochs=3, minibatch_size=3)
    uninterrupted = setup()
    expected = update(uninterrupted, config)

    # Run again, snapshot everything at the end of epoch 1, then "crash" and resume from the snapshot.
    parts = setup()
    _, actor, critic, actor_optimizer, critic_optimizer, experience = parts
    generator = torch.Generator().manual_seed(0)
    snapshots = {}

    def snapshot(progress):
        if progress.epochs_done == 1:
            snapshots["progress"] = progress
            snapshots["generator"] = generator.get_state()
            snapshots["models"] = [copy.deepcopy(m.state_dict()) for m in (actor, critic)]
            snapshots["optimizers"] = [copy.deepcopy(o.state_dict()) for o in (actor_optimizer, critic_optimizer)]

    ppo_update(
        *parts[1:], config, accelerator=parts[0], temperature=TEMPERATURE, generator=generator, on_epoch_end=snapshot
    )
    resumed_parts = setup()
    accelerator, actor, critic, actor_optimizer, critic_optimizer, experience = resumed_parts
    for model, state in zip((actor, critic), snapshots["models"], strict=True):
        model.load_state_dict(state)
    for optimizer, state in zip((actor_optimizer, critic_optimizer), snapshots["optimizers"], strict=True):
        optimizer.load_state_dict(state)
    resumed_generator = torch.Generator()
    resumed_generator.set_state(snapshots["generator"])
    resumed = ppo_update(
        actor, critic, actor_optimizer, critic_optimizer, experience, config,
        accelerator=accelerator, temperature=TEMPERATURE, generator=resumed_generator, resume=snapshots["progress"],
    )  # fmt: skip

    assert resumed.optimizer_steps == expected.optimizer_steps == 9
    for name in ("policy_loss", "value_loss", "approx_kl", "entropy"):
        torch.testing.assert_close(getattr(resumed, name), getattr(expected, name), rtol=0, atol=0)
    for resumed_model, expected_model in ((actor, uninterrupted[1]), (critic, uninterrupted[2])):
        for (name, value), expected_value in zip(
            resumed_model.named_parameters(), expected_model.parameters(), strict=True
        ):
            assert torch.equal(value, expected_value), name


# ----------------------------------------------------------------------------- critic-free updates


def critic_free(parts, advantages: AdvantageConfig):
    """The setup's rollout as if made without a critic (no values), in groups of 2 with distinct scores, rescored."""
    accelerator, actor, _, actor_optimizer, _, experience = parts
    rollout = experience.replace(
        old_values=None, group_ids=torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]),
        scores=torch.tensor([0.0, 3.0, 1.0, 1.0, 5.0, 2.0, 0.0, 4.0]),
        rewards=None, kl=None, advantages=None, returns=None,
    )  # fmt: skip
    return accelerator, actor, actor_optimizer, score_experience(rollout, advantages)


def update_actor(accelerator, actor, actor_optimizer, experience, config: PPOConfig, **kwargs):
    return ppo_update(
        actor, None, actor_optimizer, None, experience, config,
        accelerator=accelerator, temperature=TEMPERATURE, generator=torch.Generator().manual_seed(0), **kwargs,
    )  # fmt: skip


def test_without_a_critic_the_actor_alone_is_updated_and_value_statistics_are_absent():
    parts = setup()
    critic = parts[2]
    critic_before = {name: value.detach().clone() for name, value in critic.named_parameters()}
    accelerator, actor, actor_optimizer, experience = critic_free(parts, AdvantageConfig(estimator="rloo"))
    actor_before = {name: value.detach().clone() for name, value in actor.named_parameters()}
    stats = update_actor(accelerator, actor, actor_optimizer, experience, PPOConfig(epochs=1, minibatch_size=8))
    assert stats.value_loss is None and stats.value_clip_fraction is None and stats.explained_variance is None
    assert not [name for name, value in actor.named_parameters() if torch.equal(value, actor_before[name])]
    assert all(torch.equal(value, critic_before[name]) for name, value in critic.named_parameters())


def test_without_a_critic_advantages_are_not_whitened_and_the_kl_term_enters_the_loss():
    # First step, one minibatch: ratio 1, the current policy is the rollout's, so
    # loss = -token_mean(A) + kl_loss_coef * token_mean(k3(old_logprobs, ref_logprobs)), A as stage 5 left it.
    # (RLOO advantages with the KL penalty still to come have a non-zero mean; whitened, they would not.)
    parts = setup()
    advantages = AdvantageConfig(estimator="rloo", kl_coef=0.5, normalize_scores=False)
    accelerator, actor, actor_optimizer, experience = critic_free(parts, advantages)
    mask = experience.action_mask
    mean_advantage = masked_mean(experience.advantages, mask)
    assert abs(mean_advantage.item()) > 1e-3  # whitening would have made it 0
    d = experience.old_logprobs - experience.ref_logprobs
    k3 = masked_mean(torch.expm1(-d) + d, mask)
    config = PPOConfig(epochs=1, minibatch_size=8, kl_loss_coef=0.5, whiten_advantages=True)
    stats = update_actor(accelerator, actor, actor_optimizer, experience, config)
    torch.testing.assert_close(stats.ref_kl, k3, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(stats.policy_loss, -mean_advantage + 0.5 * k3, rtol=1e-4, atol=1e-5)


def test_token_sum_norm_divides_by_rows_times_the_generation_budget():
    parts = setup()
    accelerator, actor, actor_optimizer, experience = critic_free(parts, AdvantageConfig(estimator="rloo"))
    mask = experience.action_mask
    expected = -torch.where(mask, experience.advantages, 0.0).sum() / (8 * 6)  # 8 rows, budget 6 tokens
    config = PPOConfig(epochs=1, minibatch_size=8, aggregation="token_sum_norm")
    stats = update_actor(accelerator, actor, actor_optimizer, experience, config, norm_tokens=6)
    torch.testing.assert_close(stats.policy_loss, expected, rtol=1e-4, atol=1e-5)


def test_a_critic_cannot_train_on_a_rollout_without_values():
    parts = setup()
    accelerator, actor, critic, actor_optimizer, critic_optimizer, experience = parts
    with pytest.raises(ValueError, match="no critic values"):
        ppo_update(
            actor, critic, actor_optimizer, critic_optimizer, experience.replace(old_values=None),
            PPOConfig(epochs=1, minibatch_size=8), accelerator=accelerator, temperature=TEMPERATURE,
        )  # fmt: skip
    with pytest.raises(ValueError, match="together"):
        ppo_update(
            actor, critic, actor_optimizer, None, experience,
            PPOConfig(epochs=1, minibatch_size=8), accelerator=accelerator, temperature=TEMPERATURE,
        )  # fmt: skip


def test_issue44_environment_tokens_and_failed_episodes_never_reach_the_update():
    """The losses' mask is the model mask: an environment token (a gap in a row's mask) with anything at all in its
    per-token fields changes nothing, and a row with no model token (a failed episode) is left out, even where a
    minibatch would hold only such rows."""

    def trained(edit) -> dict[str, torch.Tensor]:
        accelerator, actor, actor_optimizer, experience = critic_free(setup(), AdvantageConfig(estimator="rloo"))
        update_actor(accelerator, actor, actor_optimizer, edit(experience), PPOConfig(epochs=1, minibatch_size=2))
        return {name: value.detach().clone() for name, value in actor.named_parameters()}

    def episodes(experience, *, garbage: float):
        mask = experience.action_mask.clone()
        mask[:2] = False  # two failed episodes
        mask[2, 1] = False  # an environment token between two model tokens
        poisoned = {
            name: torch.where(mask, getattr(experience, name), garbage)
            for name in ("old_logprobs", "ref_logprobs", "advantages", "returns", "engine_logprobs")
        }
        return experience.replace(action_mask=mask, **poisoned)

    clean = trained(lambda experience: episodes(experience, garbage=0.0))
    assert all(
        torch.equal(clean[name], value) for name, value in trained(lambda e: episodes(e, garbage=float("nan"))).items()
    )
    dropped = trained(lambda experience: episodes(experience, garbage=0.0).select(torch.arange(2, 8)))
    assert all(torch.equal(clean[name], value) for name, value in dropped.items())
