"""Critic-free estimators and the adaptive KL coefficient: hand-computed cases, reference loops, invariances."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.advantages import (
    adaptive_kl_coef,
    broadcast_over_tokens,
    group_advantages,
    reinforce_pp_advantages,
    reward_to_go,
)
from rlhf_core.config import GROUP_ESTIMATORS

F64 = torch.float64
TIGHT = dict(rtol=1e-12, atol=1e-12)

# Two groups, interleaved: prompt 7 has scores [1, 2, 6], prompt 3 has [0, 4].
SCORES = torch.tensor([1.0, 0.0, 2.0, 4.0, 6.0], dtype=F64)
GROUPS = torch.tensor([7, 3, 7, 3, 7])


def test_dr_grpo_subtracts_the_group_mean_by_hand():
    # Group 7: mean (1 + 2 + 6) / 3 = 3 -> [-2, -1, 3]. Group 3: mean (0 + 4) / 2 = 2 -> [-2, 2].
    expected = torch.tensor([-2.0, -2.0, -1.0, 2.0, 3.0], dtype=F64)
    torch.testing.assert_close(group_advantages(SCORES, GROUPS, "dr_grpo"), expected, **TIGHT)


def test_grpo_divides_by_the_unbiased_group_std_by_hand():
    # Group 7: centred [-2, -1, 3], unbiased variance (4 + 1 + 9) / (3 - 1) = 7, std sqrt(7).
    # Group 3: centred [-2, 2], unbiased variance (4 + 4) / (2 - 1) = 8, std 2 sqrt(2).
    # (The biased std would give sqrt(14/3) and 2: the Bessel correction is what this pins.)
    root7, root8 = math.sqrt(7.0), math.sqrt(8.0)
    expected = torch.tensor([-2 / root7, -2 / root8, -1 / root7, 2 / root8, 3 / root7], dtype=F64)
    torch.testing.assert_close(group_advantages(SCORES, GROUPS, "grpo", eps=0.0), expected, **TIGHT)


def test_rloo_subtracts_the_mean_of_the_other_samples_by_hand():
    # Group 7: 1 - (2 + 6) / 2 = -3;  2 - (1 + 6) / 2 = -1.5;  6 - (1 + 2) / 2 = 4.5.
    # Group 3: 0 - 4 = -4;  4 - 0 = 4.
    expected = torch.tensor([-3.0, -4.0, -1.5, 4.0, 4.5], dtype=F64)
    torch.testing.assert_close(group_advantages(SCORES, GROUPS, "rloo"), expected, **TIGHT)


def reference_group_advantages(scores, group_ids, estimator, eps):
    """The docstring's naive loop, in Python floats."""
    result = []
    for b in range(len(scores)):
        group = [float(scores[j]) for j in range(len(scores)) if int(group_ids[j]) == int(group_ids[b])]
        k, mean, own = len(group), sum(group) / len(group), float(scores[b])
        if estimator == "rloo":
            result.append(own - (sum(group) - own) / (k - 1))
        elif estimator == "dr_grpo":
            result.append(own - mean)
        else:
            std = (sum((r - mean) ** 2 for r in group) / (k - 1)) ** 0.5
            result.append((own - mean) / (std + eps))
    return torch.tensor(result, dtype=F64)


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
@pytest.mark.parametrize("seed", range(3))
def test_equals_the_reference_loop_on_ragged_shuffled_groups(estimator, seed):
    generator = torch.Generator().manual_seed(seed)
    group_ids = torch.tensor([11, 11, 4, 4, 4, 4, 9, 9, 9, -2, -2])[torch.randperm(11, generator=generator)]
    scores = torch.randn(11, generator=generator, dtype=F64)
    expected = reference_group_advantages(scores, group_ids, estimator, eps=1e-6)
    torch.testing.assert_close(group_advantages(scores, group_ids, estimator), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_a_constant_added_to_a_group_changes_nothing_and_grpo_ignores_its_scale(estimator):
    shift = torch.where(GROUPS == 7, 10.0, -3.0).to(F64)  # a different constant per group
    base = group_advantages(SCORES, GROUPS, estimator)
    torch.testing.assert_close(group_advantages(SCORES + shift, GROUPS, estimator), base, rtol=1e-9, atol=1e-9)
    if estimator == "grpo":
        scaled = group_advantages(5.0 * SCORES, GROUPS, estimator, eps=0.0)
        torch.testing.assert_close(scaled, group_advantages(SCORES, GROUPS, estimator, eps=0.0), **TIGHT)


def test_a_group_of_equal_scores_gets_zero_advantage_from_grpo():
    scores = torch.tensor([2.0, 2.0, 2.0, 1.0, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    advantages = group_advantages(scores, groups, "grpo")
    assert torch.equal(advantages[:3], torch.zeros(3)) and torch.isfinite(advantages).all()


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_equal_fp32_scores_whose_mean_does_not_round_back_get_exactly_zero(estimator):
    # Eight fp32 copies of 7.839086532592773 sum in fp32 to a total whose eighth is one rounding step
    # away from the score: an fp32 mean left GRPO about -0.47 for each (a step over a std of one step).
    scores = torch.full((8,), 7.839086532592773, dtype=torch.float32)
    advantages = group_advantages(scores, torch.zeros(8, dtype=torch.long), estimator)
    assert advantages.dtype == torch.float32 and torch.equal(advantages, torch.zeros(8))


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_a_group_of_one_sample_is_refused_naming_the_setting(estimator):
    with pytest.raises(ValueError, match=r"group 5 has 1 sample.*sizes.samples_per_prompt"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 1, 5]), estimator)


def test_unknown_estimator_and_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="`estimator`"):
        group_advantages(SCORES, GROUPS, "gae")
    with pytest.raises(ValueError, match="equal 1-D shapes"):
        group_advantages(SCORES, GROUPS[:3], "rloo")


def test_broadcast_repeats_a_sequence_value_over_its_action_tokens_only():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    expected = torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])
    assert torch.equal(broadcast_over_tokens(torch.tensor([2.0, -1.0]), mask), expected)


def test_reward_to_go_by_hand_and_padding_never_matters():
    # Row 0, r = [1, -0.5, 2]: gamma 1 -> [2.5, 1.5, 2];  gamma 0.5 -> G2 = 2, G1 = -0.5 + 1 = 0.5,
    # G0 = 1 + 0.25 = 1.25. Row 1 has one action (r = 3) and nan padding, which must not leak in.
    rewards = torch.tensor([[1.0, -0.5, 2.0], [3.0, float("nan"), float("inf")]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    torch.testing.assert_close(
        reward_to_go(rewards, mask), torch.tensor([[2.5, 1.5, 2.0], [3.0, 0.0, 0.0]], dtype=F64), **TIGHT
    )
    torch.testing.assert_close(
        reward_to_go(rewards, mask, gamma=0.5), torch.tensor([[1.25, 0.5, 2.0], [3.0, 0.0, 0.0]], dtype=F64), **TIGHT
    )


def test_reward_to_go_equals_the_reference_loop():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(6, 5, generator=generator, dtype=F64)
    lengths = torch.tensor([5, 0, 3, 1, 4, 2])
    mask = torch.arange(5)[None, :] < lengths[:, None]
    expected = torch.zeros_like(rewards)
    for b in range(6):
        running = 0.0
        for t in reversed(range(int(lengths[b]))):
            running = float(rewards[b, t]) + 0.9 * running
            expected[b, t] = running
    torch.testing.assert_close(reward_to_go(rewards, mask, gamma=0.9), expected, rtol=1e-12, atol=1e-12)


def test_reinforce_pp_whitens_the_returns_over_every_valid_token_by_hand():
    # Row 0: r = [1, 0, 2] -> returns [3, 2, 2]. Row 1: r = [-1, 1, pad] -> returns [0, 1, 0].
    # Valid returns [3, 2, 2, 0, 1]: mean 1.6, deviations [1.4, 0.4, 0.4, -1.6, -0.6],
    # squares sum 5.2, unbiased variance 5.2 / 4 = 1.3.
    rewards = torch.tensor([[1.0, 0.0, 2.0], [-1.0, 1.0, 99.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    advantages, returns = reinforce_pp_advantages(rewards, mask)
    torch.testing.assert_close(returns, torch.tensor([[3.0, 2.0, 2.0], [0.0, 1.0, 0.0]], dtype=F64), **TIGHT)
    std = math.sqrt(1.3)
    expected = torch.tensor([[1.4, 0.4, 0.4], [-1.6, -0.6, 0.0]], dtype=F64) / std
    torch.testing.assert_close(advantages, expected, rtol=1e-7, atol=1e-7)


def test_adaptive_kl_coefficient_by_hand():
    # error = clip(6 / 4 - 1, -0.2, 0.2) = 0.2 -> 0.1 * (1 + 0.2 * 256 / 1000) = 0.10512
    assert adaptive_kl_coef(0.1, 6.0, target=4.0, horizon=1000, steps=256) == pytest.approx(0.10512, abs=1e-15)
    # error = 3.6 / 4 - 1 = -0.1 -> 0.1 * (1 - 0.1 * 0.256) = 0.09744
    assert adaptive_kl_coef(0.1, 3.6, target=4.0, horizon=1000, steps=256) == pytest.approx(0.09744, abs=1e-15)
    # On target, or no samples: unchanged. Far below: the clip bounds the step at -20% per horizon.
    assert adaptive_kl_coef(0.1, 4.0, target=4.0, horizon=1000, steps=256) == 0.1
    assert adaptive_kl_coef(0.1, 9.0, target=4.0, horizon=1000, steps=0) == 0.1
    assert adaptive_kl_coef(0.1, 0.0, target=4.0, horizon=100, steps=100) == pytest.approx(0.08, abs=1e-15)
    with pytest.raises(ValueError, match="`target`"):
        adaptive_kl_coef(0.1, 1.0, target=0.0, horizon=100, steps=1)
    # more samples than the horizon would multiply by 1 - 0.2 * 256 / 10 < 0: refused, not a negative beta
    with pytest.raises(ValueError, match="`steps` <= `horizon`"):
        adaptive_kl_coef(0.05, 0.0, target=1.0, horizon=10, steps=256)
