"""Episodes: turn rewards, GAE across the environment's tokens, critic-free estimators; by hand, against a
reference loop, against the single-turn functions bit for bit, and never moved by padding or the environment."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.advantages import broadcast_over_tokens, group_advantages, reinforce_pp_advantages, reward_to_go
from rlhf_core.config import GROUP_ESTIMATORS, AdvantageConfig
from rlhf_core.episodes import (
    episode_gae,
    episode_group_advantages,
    episode_reinforce_pp_advantages,
    episode_reward_to_go,
    episode_shaped_rewards,
    model_token_order,
    place_turn_rewards,
    turn_ends,
    turn_index,
)
from rlhf_core.experience import Experience
from rlhf_core.experience_maker import score_experience
from rlhf_core.gae import compute_gae
from rlhf_core.rewards import shaped_rewards

F64 = torch.float64
EXACT = dict(rtol=0.0, atol=0.0)
TIGHT = dict(rtol=1e-12, atol=1e-12)
NAN = float("nan")

# The episode of the hand cases: a response window of 6 tokens,
#   column:  0    1    2    3    4    5
#   token:   m1   m1   env  env  m2   m2     (m1, m2: the model's turns 1 and 2; env: the environment's reply)
MASK = torch.tensor([[True, True, False, False, True, True]])
TURN_REWARDS = torch.tensor([[1.0, 2.0]], dtype=F64)


# ----------------------------------------------------------------------------- turns and their rewards


def test_turns_are_runs_of_model_tokens_by_hand():
    # row 0: the hand episode; row 1: padding (p) between the turns, and a third turn of one token;
    # row 2: a single-turn row (a prefix mask); row 3: no model token at all.
    mask = torch.tensor(
        [
            [1, 1, 0, 0, 1, 1, 0, 0],  # m1 m1 env env m2 m2 p p
            [1, 0, 0, 1, 1, 0, 1, 0],  # m1 p env m2 m2 env m3 p
            [1, 1, 1, 0, 0, 0, 0, 0],  # m1 m1 m1 p ...
            [0, 0, 0, 0, 0, 0, 0, 0],
        ]
    ).bool()
    expected_index = torch.tensor(
        [
            [0, 0, -1, -1, 1, 1, -1, -1],
            [0, -1, -1, 1, 1, -1, 2, -1],
            [0, 0, 0, -1, -1, -1, -1, -1],
            [-1, -1, -1, -1, -1, -1, -1, -1],
        ]
    )
    assert torch.equal(turn_index(mask), expected_index)
    expected_ends = torch.tensor(
        [[0, 1, 0, 0, 0, 1, 0, 0], [1, 0, 0, 0, 1, 0, 1, 0], [0, 0, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]]
    ).bool()
    assert torch.equal(turn_ends(mask), expected_ends)
    # the model's tokens first, in order, then the others, in order; the identity on a prefix mask
    assert torch.equal(model_token_order(mask[:1]), torch.tensor([[0, 1, 4, 5, 2, 3, 6, 7]]))
    assert torch.equal(model_token_order(mask[2:3]), torch.arange(8)[None])


def test_turn_rewards_land_on_each_turns_last_model_token_by_hand():
    # Turn 1 (columns 0-1) gets 1.0 at column 1; turn 2 (columns 4-5) gets 2.0 at column 5. Row 1 is one
    # turn of one token followed by padding: its zero-padded second column has no turn and stays unused.
    mask = torch.cat([MASK, torch.tensor([[False, True, False, False, False, False]])])
    turn_rewards = torch.tensor([[1.0, 2.0], [-0.5, 0.0]], dtype=F64)
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 2.0], [0.0, -0.5, 0.0, 0.0, 0.0, 0.0]], dtype=F64)
    assert torch.equal(place_turn_rewards(turn_rewards, mask), expected)


def test_turn_rewards_and_the_mask_must_agree_on_the_turns():
    with pytest.raises(ValueError, match="row 0 has 2 model turns but `turn_rewards` has 1 columns"):
        place_turn_rewards(torch.tensor([[1.0]]), MASK)
    with pytest.raises(ValueError, match="row 0 has a reward for turn 2 but only 2 model turns"):
        place_turn_rewards(torch.tensor([[1.0, 2.0, 3.0]]), MASK)
    with pytest.raises(ValueError, match=r"shape \(1, N\)"):
        place_turn_rewards(torch.tensor([1.0, 2.0]), MASK)
    # a row with no model token (an episode masked out of the loss) keeps its rewards and places none
    empty = torch.zeros(1, 6, dtype=torch.bool)
    assert torch.equal(place_turn_rewards(torch.tensor([[1.0, 2.0]]), empty), torch.zeros(1, 6))


def test_episode_shaped_rewards_by_hand():
    # k1, d = logprobs - ref_logprobs at the model's tokens: [0.25, -0.5 | env | 0.75, 0]; nan at the
    # environment's tokens must not leak in. kl_coef 0.5: penalties -0.5 * d = [-0.125, 0.25 | 0 0 | -0.375, 0].
    # Turn rewards 1 and 2 at columns 1 and 5: rewards [-0.125, 1.25, 0, 0, -0.375, 2].
    ref = torch.tensor([[-1.0, -2.0, NAN, NAN, -1.5, -0.5]], dtype=F64)
    d = torch.tensor([[0.25, -0.5, 0.0, 0.0, 0.75, 0.0]], dtype=F64)
    rewards, kl = episode_shaped_rewards(TURN_REWARDS, ref + d, ref, MASK, kl_coef=0.5)
    assert torch.equal(rewards, torch.tensor([[-0.125, 1.25, 0.0, 0.0, -0.375, 2.0]], dtype=F64))
    assert torch.equal(kl, torch.tensor([[0.25, -0.5, 0.0, 0.0, 0.75, 0.0]], dtype=F64))


# ----------------------------------------------------------------------------- GAE across the environment's tokens

HAND_REWARDS = torch.tensor([[0.0, 1.0, 7.0, 7.0, 0.0, 2.0]], dtype=F64)  # 7: at the environment's tokens, never read
HAND_VALUES = torch.tensor([[0.5, 1.0, 9.0, 9.0, 1.5, 0.5]], dtype=F64)  # 9: likewise


def test_gae_bootstraps_across_the_environment_tokens_by_hand():
    # gamma = 0.5, lambda = 0.5 (gamma * lambda = 0.25). The steps are the model's tokens 0, 1, 4, 5, with
    # r = [0, 1, 0, 2] (turn rewards 1 and 2 on each turn's last token), V = [0.5, 1.0, 1.5, 0.5].
    #   delta_5 = 2 + 0.5 * 0   - 0.5 =  1.5     (the episode ends after its last model token)
    #   delta_4 = 0 + 0.5 * 0.5 - 1.5 = -1.25
    #   delta_1 = 1 + 0.5 * 1.5 - 1.0 =  0.75    (turn 1's last token bootstraps from V at column 4, turn 2's
    #                                             first, one discount away: columns 2 and 3 are no steps)
    #   delta_0 = 0 + 0.5 * 1.0 - 0.5 =  0.0
    #   A_5 = 1.5;  A_4 = -1.25 + 0.25 * 1.5 = -0.875;  A_1 = 0.75 + 0.25 * -0.875 = 0.53125
    #   A_0 = 0 + 0.25 * 0.53125 = 0.1328125
    #   returns = A + V = [0.6328125, 1.53125 | 0, 0 | 0.625, 2.0]
    advantages, returns = episode_gae(HAND_REWARDS, HAND_VALUES, MASK, gamma=0.5, gae_lambda=0.5)
    assert torch.equal(advantages, torch.tensor([[0.1328125, 0.53125, 0.0, 0.0, -0.875, 1.5]], dtype=F64))
    assert torch.equal(returns, torch.tensor([[0.6328125, 1.53125, 0.0, 0.0, 0.625, 2.0]], dtype=F64))
    # Single-turn GAE handed the same mask ends the episode at column 1 instead (delta_1 = 1 - 1 = 0, so
    # A_1 = 0 and A_0 = 0 + 0.25 * 0 = 0): turn 1 would never see turn 2. That is why episodes need their own.
    cut, _ = compute_gae(HAND_REWARDS, HAND_VALUES, MASK, gamma=0.5, gae_lambda=0.5)
    assert torch.equal(cut[0, :2], torch.zeros(2, dtype=F64))


def reference_episode_gae(rewards, values, mask, *, gamma, gae_lambda):
    """The docstring's naive loop, one row at a time over its model-token columns, in Python floats."""
    advantages = torch.zeros(rewards.shape, dtype=F64)
    returns = torch.zeros(rewards.shape, dtype=F64)
    for b in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[b, t]]
        last = 0.0
        for i in reversed(range(len(steps))):
            t = steps[i]
            next_value = float(values[b, steps[i + 1]]) if i + 1 < len(steps) else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            last = delta + gamma * gae_lambda * last
            advantages[b, t], returns[b, t] = last, last + float(values[b, t])
    return advantages, returns


def random_episodes(seed: int, rows: int = 8, length: int = 10):
    """Rows of random turns and gaps (runs of True and False), a full row and an empty one; zero-padded turn
    rewards; garbage-free rewards, values and log-probs (tests poison the gaps themselves)."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, length, generator=generator) < 0.6  # (B, R)
    mask[0], mask[1] = True, False
    turns = int(turn_index(mask).amax()) + 1
    turn_rewards = torch.randn(rows, turns, generator=generator, dtype=F64)
    turn_rewards = torch.where(torch.arange(turns) < (turn_index(mask).amax(dim=1, keepdim=True) + 1), turn_rewards, 0)
    tensors = torch.randn(4, rows, length, generator=generator, dtype=F64)  # rewards, values, logprobs, ref
    return mask, turn_rewards, tensors


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("gamma", "gae_lambda"), [(1.0, 0.95), (0.9, 0.8), (0.99, 0.0), (0.0, 0.5)])
def test_gae_equals_the_per_row_reference_loop_on_random_episodes(seed, gamma, gae_lambda):
    mask, _, (rewards, values, _, _) = random_episodes(seed)
    advantages, returns = episode_gae(rewards, values, mask, gamma=gamma, gae_lambda=gae_lambda)
    expected_advantages, expected_returns = reference_episode_gae(
        rewards, values, mask, gamma=gamma, gae_lambda=gae_lambda
    )
    torch.testing.assert_close(advantages, expected_advantages, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(returns, expected_returns, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------- critic-free estimators


def test_reinforce_pp_return_runs_over_the_model_tokens_by_hand():
    # The shaped rewards of test_episode_shaped_rewards_by_hand: r = [-0.125, 1.25 | env env | -0.375, 2].
    rewards = torch.tensor([[-0.125, 1.25, NAN, NAN, -0.375, 2.0]], dtype=F64)
    # gamma 1: G5 = 2, G4 = 1.625, G1 = 1.25 + 1.625 = 2.875, G0 = 2.75; turn 1's return includes turn 2's reward
    # (verl's REINFORCE++ resets the return at every masked token and would give G1 = 1.25, G0 = 1.125).
    # Whitened over the 4 model tokens: mean 9.25 / 4 = 2.3125, deviations [0.4375, 0.5625 | -0.6875, -0.3125],
    # squares 0.19140625 + 0.31640625 + 0.47265625 + 0.09765625 = 1.078125, unbiased variance 1.078125 / 3 = 0.359375.
    advantages, returns = episode_reinforce_pp_advantages(rewards, MASK)
    assert torch.equal(returns, torch.tensor([[2.75, 2.875, 0.0, 0.0, 1.625, 2.0]], dtype=F64))
    expected = torch.tensor([[0.4375, 0.5625, 0.0, 0.0, -0.6875, -0.3125]], dtype=F64) / math.sqrt(0.359375)
    torch.testing.assert_close(advantages, expected, rtol=1e-7, atol=1e-7)  # masked_whiten's eps of 1e-8
    # gamma 0.5: G5 = 2, G4 = -0.375 + 0.5 * 2 = 0.625, G1 = 1.25 + 0.5 * 0.625 = 1.5625 (one discount across the
    # environment's reply, not three), G0 = -0.125 + 0.5 * 1.5625 = 0.65625.
    discounted = episode_reward_to_go(rewards, MASK, gamma=0.5)
    assert torch.equal(discounted, torch.tensor([[0.65625, 1.5625, 0.0, 0.0, 0.625, 2.0]], dtype=F64))


def test_with_gamma_one_the_environment_tokens_are_skipped_by_the_existing_reward_to_go_too():
    # A zero-reward, undiscounted step adds exactly nothing; only a discount tells the two readings apart.
    mask, _, (rewards, *_) = random_episodes(11)
    assert torch.equal(episode_reward_to_go(rewards, mask), reward_to_go(rewards, mask))
    assert not torch.equal(episode_reward_to_go(rewards, mask, gamma=0.9), reward_to_go(rewards, mask, gamma=0.9))


def test_group_estimators_broadcast_the_episode_reward_over_the_model_tokens_by_hand():
    # One group of three episodes of the hand layout, turn rewards [1, 2], [0, 1], [0.5, -0.5]:
    # episode rewards 3, 1, 0. RLOO: 3 - (1 + 0) / 2 = 2.5, 1 - (3 + 0) / 2 = -0.5, 0 - (3 + 1) / 2 = -2.
    # kl_coef 0.5, k1 d = [0.25, -0.5 | env | 0.75, 0] in row 0, 0 elsewhere: penalties [-0.125, 0.25 | -0.375, 0],
    # still to come over the model's tokens: [-0.25, -0.125 | -0.375, 0]. Row 0: 2.5 + that.
    # Returns (reward-to-go of the shaped rewards [-0.125, 1.25 | -0.375, 2]): [2.75, 2.875 | 1.625, 2].
    mask = MASK.expand(3, 6)
    turn_rewards = torch.tensor([[1.0, 2.0], [0.0, 1.0], [0.5, -0.5]], dtype=F64)
    ref = torch.full((3, 6), -1.0, dtype=F64)
    d = torch.tensor([[0.25, -0.5, 0.0, 0.0, 0.75, 0.0], [0.0] * 6, [0.0] * 6], dtype=F64)
    rewards, kl = episode_shaped_rewards(turn_rewards, ref + d, ref, mask, kl_coef=0.5)
    groups = torch.tensor([4, 4, 4])
    advantages, returns = episode_group_advantages(
        turn_rewards, rewards, kl, mask, groups, estimator="rloo", kl_coef=0.5
    )
    expected = torch.tensor(
        [[2.25, 2.375, 0, 0, 2.125, 2.5], [-0.5, -0.5, 0, 0, -0.5, -0.5], [-2.0, -2.0, 0, 0, -2.0, -2.0]], dtype=F64
    )
    torch.testing.assert_close(advantages, expected, **TIGHT)
    torch.testing.assert_close(returns[0], torch.tensor([2.75, 2.875, 0, 0, 1.625, 2.0], dtype=F64), **TIGHT)
    # row 2's turns cancel: its return is 0.5 - 0.5 = 0 at the first turn, -0.5 at the second
    torch.testing.assert_close(returns[2], torch.tensor([0.0, 0.0, 0, 0, -0.5, -0.5], dtype=F64), **TIGHT)
    # GRPO: episode rewards [3, 1, 0], mean 4/3, unbiased std sqrt(7/3); the same outcome at every model token
    grpo, _ = episode_group_advantages(turn_rewards, rewards, kl, mask, groups, estimator="grpo", kl_coef=0.0)
    outcome = (torch.tensor([3.0, 1.0, 0.0], dtype=F64) - 4 / 3) / (math.sqrt(7 / 3) + 1e-6)
    torch.testing.assert_close(grpo, torch.where(mask, outcome[:, None], 0.0), **TIGHT)


# ----------------------------------------------------------------------------- invariances


def all_estimates(turn_rewards, logprobs, ref_logprobs, values, mask, groups):
    """Every result of the module on one batch: shaped rewards, GAE, REINFORCE++ and the group estimators."""
    rewards, kl = episode_shaped_rewards(turn_rewards, logprobs, ref_logprobs, mask, kl_coef=0.1, estimator="k3")
    results = {"rewards": rewards, "kl": kl}
    results["gae"], results["gae_returns"] = episode_gae(rewards, values, mask, gamma=0.9, gae_lambda=0.8)
    results["rtg"] = episode_reward_to_go(rewards, mask, gamma=0.9)
    results["reinforce_pp"], _ = episode_reinforce_pp_advantages(rewards, mask, gamma=0.9)
    for estimator in GROUP_ESTIMATORS:
        results[estimator], _ = episode_group_advantages(
            turn_rewards, rewards, kl, mask, groups, estimator=estimator, kl_coef=0.1
        )
    return results


def spread(tensor, columns, width, fill):
    """``tensor``'s columns moved to ``columns`` of a wider row, ``fill`` everywhere else."""
    wide = torch.full((tensor.shape[0], width), fill, dtype=tensor.dtype)
    wide[:, columns] = tensor
    return wide


def test_padding_between_turns_never_changes_a_result():
    # The hand episode, and the same episode with padding (p) after turn 1, after the environment's reply and at
    # the end, holding garbage:  m1 m1 p env env p m2 m2 p p. Every result at the real tokens is identical.
    mask = MASK.expand(2, 6)
    turn_rewards = torch.tensor([[1.0, 2.0], [0.5, -1.5]], dtype=F64)
    ref = torch.tensor([[-1.0, -2.0, -3.0, -0.5, -1.5, -0.5]], dtype=F64).expand(2, 6)
    logprobs = ref + torch.tensor([[0.25, -0.5, 0.0, 0.0, 0.75, 0.0], [0.5, 0.25, 0.0, 0.0, -0.25, 1.0]], dtype=F64)
    values = HAND_VALUES.expand(2, 6)
    groups = torch.tensor([0, 0])
    columns, width = torch.tensor([0, 1, 3, 4, 6, 7]), 10
    padded = [spread(x, columns, width, fill) for x, fill in [(logprobs, 1e4), (ref, -1e4), (values, NAN)]]
    padded_mask = spread(mask, columns, width, False)
    clean = all_estimates(turn_rewards, logprobs, ref, values, mask, groups)
    dirty = all_estimates(turn_rewards, *padded, padded_mask, groups)
    for name, result in clean.items():
        torch.testing.assert_close(dirty[name][:, columns], result, **EXACT, msg=name)
        assert bool((dirty[name][:, [2, 5, 8, 9]] == 0).all()), name


@pytest.mark.parametrize("poison", [None, NAN, float("inf")])
@pytest.mark.parametrize("seed", range(3))
def test_environment_tokens_never_get_an_advantage_and_never_matter(poison, seed):
    mask, turn_rewards, (_, values, logprobs, ref) = random_episodes(seed)
    groups = torch.arange(mask.shape[0]) // 2
    clean = all_estimates(turn_rewards, logprobs, ref, values, mask, groups)
    generator = torch.Generator().manual_seed(100 + seed)
    if poison is None:
        garbage = 1e4 * torch.randn(3, *mask.shape, generator=generator, dtype=F64)
    else:
        garbage = torch.full((3, *mask.shape), poison, dtype=F64)
    dirty_inputs = [torch.where(mask, x, g) for x, g in zip((logprobs, ref, values), garbage, strict=True)]
    dirty = all_estimates(turn_rewards, *dirty_inputs[:2], dirty_inputs[2], mask, groups)
    for name, result in clean.items():
        assert bool((result[~mask] == 0).all()), name
        torch.testing.assert_close(dirty[name], result, **EXACT, msg=name)


# ----------------------------------------------------------------------------- one turn is the single-turn case


@pytest.mark.parametrize("seed", range(3))
def test_a_single_turn_episode_equals_the_single_turn_functions_bit_for_bit(seed):
    generator = torch.Generator().manual_seed(seed)
    rows, length = 8, 7
    lengths = torch.randint(0, length + 1, (rows,), generator=generator)
    lengths[0], lengths[1] = length, 0
    mask = torch.arange(length)[None, :] < lengths[:, None]  # (B, R) ragged prefix mask
    scores = torch.randn(rows, generator=generator, dtype=F64)
    logprobs, ref, values = torch.randn(3, rows, length, generator=generator, dtype=F64)
    groups = torch.arange(rows) // 2

    rewards, kl = episode_shaped_rewards(scores[:, None], logprobs, ref, mask, kl_coef=0.2, estimator="k3")
    expected_rewards, expected_kl = shaped_rewards(scores, logprobs, ref, mask, kl_coef=0.2, estimator="k3")
    assert torch.equal(rewards, expected_rewards) and torch.equal(kl, expected_kl)
    for got, want in [
        (
            episode_gae(rewards, values, mask, gamma=0.9, gae_lambda=0.8),
            compute_gae(rewards, values, mask, gamma=0.9, gae_lambda=0.8),
        ),
        (episode_reinforce_pp_advantages(rewards, mask, gamma=0.9), reinforce_pp_advantages(rewards, mask, gamma=0.9)),
    ]:
        assert torch.equal(got.advantages, want.advantages) and torch.equal(got.returns, want.returns)
    assert torch.equal(episode_reward_to_go(rewards, mask, gamma=0.9), reward_to_go(rewards, mask, gamma=0.9))
    for estimator in GROUP_ESTIMATORS:
        got = episode_group_advantages(scores[:, None], rewards, kl, mask, groups, estimator=estimator, kl_coef=0.2)
        outcome = group_advantages(scores, groups, estimator)
        assert torch.equal(got.advantages, broadcast_over_tokens(outcome, mask) + reward_to_go(-0.2 * kl, mask))
        assert torch.equal(got.returns, reward_to_go(rewards, mask))


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp", *GROUP_ESTIMATORS])
def test_a_single_turn_episode_equals_score_experience_bit_for_bit(estimator):
    # score_experience is stage 5 today; on a one-turn episode the episode functions must reproduce it exactly.
    generator = torch.Generator().manual_seed(3)
    mask = torch.tensor([[True, True, True], [True, False, False], [True, True, False], [True, True, True]])
    ref = torch.randn(4, 3, generator=generator, dtype=F64)
    logprobs = ref + 0.3 * torch.randn(4, 3, generator=generator, dtype=F64)
    experience = Experience(
        sequences=torch.tensor([[5, 6, 7, 8]] * 4),
        attention_mask=torch.cat([torch.ones(4, 1, dtype=torch.long), mask.long()], dim=1),
        action_mask=mask,
        old_logprobs=torch.where(mask, logprobs, 0.0),
        ref_logprobs=torch.where(mask, ref, 0.0),
        old_values=torch.where(mask, torch.randn(4, 3, generator=generator, dtype=F64), 0.0),
        scores=torch.randn(4, generator=generator, dtype=F64),
        group_ids=torch.tensor([0, 0, 1, 1]),
    )
    config = AdvantageConfig(estimator=estimator, kl_coef=0.3, gamma=0.95, gae_lambda=0.9, normalize_scores=False)
    scored = score_experience(experience, config)
    turn_rewards = experience.scores[:, None]  # (B, 1)
    rewards, kl = episode_shaped_rewards(
        turn_rewards, experience.old_logprobs, experience.ref_logprobs, mask, kl_coef=0.3
    )
    if estimator == "gae":
        result = episode_gae(rewards, experience.old_values, mask, gamma=0.95, gae_lambda=0.9)
    elif estimator == "reinforce_pp":
        result = episode_reinforce_pp_advantages(rewards, mask, gamma=0.95)
    else:
        result = episode_group_advantages(
            turn_rewards, rewards, kl, mask, experience.group_ids, estimator=estimator, kl_coef=0.3
        )
    assert torch.equal(rewards, scored.rewards) and torch.equal(kl, scored.kl)
    assert torch.equal(result.advantages, scored.advantages) and torch.equal(result.returns, scored.returns)
