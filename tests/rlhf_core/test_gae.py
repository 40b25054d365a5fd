"""GAE over the action window: a hand-computed case, a per-row reference loop, and its invariances."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.gae import compute_gae

EXACT = dict(rtol=0.0, atol=0.0)
TIGHT = dict(rtol=1e-12, atol=1e-12)
F64 = torch.float64


def test_three_step_case_by_hand():
    # gamma = 0.9, lambda = 0.8, so gamma * lambda = 0.72. The value after the last action is 0.
    # Row 0, three actions: r = [1, 0, 2], V = [0.5, 1.0, 1.5]
    #   delta_2 = 2 + 0.9 * 0   - 1.5 = 0.5
    #   delta_1 = 0 + 0.9 * 1.5 - 1.0 = 0.35
    #   delta_0 = 1 + 0.9 * 1.0 - 0.5 = 1.4
    #   A_2 = 0.5
    #   A_1 = 0.35 + 0.72 * 0.5  = 0.71
    #   A_0 = 1.4  + 0.72 * 0.71 = 1.9112
    #   returns = A + V = [2.4112, 1.71, 2.0]
    # Row 1, two actions then padding (99 and 77 sit in the padding and must be ignored):
    #   delta_1 = 0 + 0.9 * 0   - 1.0 = -1.0   (episode ends after token 1)
    #   delta_0 = 1 + 0.9 * 1.0 - 0.5 = 1.4
    #   A_1 = -1.0;  A_0 = 1.4 + 0.72 * -1.0 = 0.68
    #   returns = [1.18, 0.0, 0]
    rewards = torch.tensor([[1.0, 0.0, 2.0], [1.0, 0.0, 99.0]], dtype=F64)
    values = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 77.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, gae_lambda=0.8)
    torch.testing.assert_close(advantages, torch.tensor([[1.9112, 0.71, 0.5], [0.68, -1.0, 0.0]], dtype=F64), **TIGHT)
    torch.testing.assert_close(returns, torch.tensor([[2.4112, 1.71, 2.0], [1.18, 0.0, 0.0]], dtype=F64), **TIGHT)


def reference_gae(rewards, values, action_mask, *, gamma, gae_lambda):
    """The docstring's naive loop, one row at a time over its ``n`` valid tokens, in Python floats."""
    rows, length = rewards.shape
    advantages = torch.zeros(rows, length, dtype=F64)
    for b in range(rows):
        n = int(action_mask[b].sum())
        last = 0.0
        for t in reversed(range(n)):
            next_value = float(values[b, t + 1]) if t + 1 < n else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            last = delta + gamma * gae_lambda * last
            advantages[b, t] = last
    returns = torch.where(action_mask, advantages + values, torch.zeros_like(values))
    return advantages, returns


def random_case(seed: int, rows: int = 7, length: int = 6):
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(rows, length, generator=generator, dtype=F64)
    values = torch.randn(rows, length, generator=generator, dtype=F64)
    lengths = torch.randint(0, length + 1, (rows,), generator=generator)
    lengths[0], lengths[1] = length, 0  # a full row and an empty one
    mask = torch.arange(length)[None, :] < lengths[:, None]  # (B, R) ragged prefix mask
    return rewards, values, mask


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("gamma", "gae_lambda"), [(1.0, 0.95), (0.9, 0.8), (0.99, 0.0), (1.0, 1.0), (0.0, 0.5)])
def test_equals_the_per_row_reference_loop_on_ragged_masks(seed, gamma, gae_lambda):
    rewards, values, mask = random_case(seed)
    advantages, returns = compute_gae(rewards, values, mask, gamma=gamma, gae_lambda=gae_lambda)
    expected_advantages, expected_returns = reference_gae(rewards, values, mask, gamma=gamma, gae_lambda=gae_lambda)
    torch.testing.assert_close(advantages, expected_advantages, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(returns, expected_returns, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("poison", [None, float("nan"), float("inf")])
def test_rewards_and_values_at_masked_positions_never_matter(poison):
    rewards, values, mask = random_case(5)
    generator = torch.Generator().manual_seed(6)
    if poison is None:
        garbage = 1e4 * torch.randn(2, *rewards.shape, generator=generator, dtype=F64)
    else:
        garbage = torch.full((2, *rewards.shape), poison, dtype=F64)
    clean = compute_gae(rewards, values, mask, gamma=0.97, gae_lambda=0.9)
    dirty = compute_gae(
        torch.where(mask, rewards, garbage[0]), torch.where(mask, values, garbage[1]), mask, gamma=0.97, gae_lambda=0.9
    )
    torch.testing.assert_close(dirty.advantages, clean.advantages, **EXACT)
    torch.testing.assert_close(dirty.returns, clean.returns, **EXACT)
    assert bool((clean.advantages[~mask] == 0).all()) and bool((clean.returns[~mask] == 0).all())


def test_gamma_and_lambda_one_give_reward_to_go_minus_value():
    # A_t = sum_{k >= t} r_k - V_t (a telescoping sum), and returns are the reward-to-go.
    rewards, values, mask = random_case(7)
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, gae_lambda=1.0)
    masked_rewards = torch.where(mask, rewards, torch.zeros_like(rewards))
    reward_to_go = masked_rewards.flip(1).cumsum(1).flip(1)  # (B, R)
    torch.testing.assert_close(advantages, torch.where(mask, reward_to_go - values, 0.0), **TIGHT)
    torch.testing.assert_close(returns, torch.where(mask, reward_to_go, 0.0), **TIGHT)


def test_lambda_zero_gives_the_one_step_td_error():
    # A_t = r_t + gamma * V_{t+1} - V_t, with V after the last action = 0.
    rewards, values, mask = random_case(8)
    advantages, _ = compute_gae(rewards, values, mask, gamma=0.9, gae_lambda=0.0)
    next_values = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    expected = torch.where(mask, rewards + 0.9 * next_values - values, 0.0)
    torch.testing.assert_close(advantages, expected, **TIGHT)


@pytest.mark.parametrize("seed", range(3))
def test_returns_are_advantages_plus_values(seed):
    rewards, values, mask = random_case(seed)
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.95, gae_lambda=0.9)
    torch.testing.assert_close(returns, torch.where(mask, advantages + values, 0.0), **EXACT)


def test_a_terminal_score_propagates_back_with_discount():
    # Only the last action is rewarded (the sequence score), V = 0: A_t = (gamma*lambda)^(n-1-t) * score.
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=F64)
    values = torch.zeros(1, 4, dtype=F64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    advantages, _ = compute_gae(rewards, values, mask, gamma=0.5, gae_lambda=0.5)
    torch.testing.assert_close(advantages, torch.tensor([[0.25**3, 0.25**2, 0.25, 1.0]], dtype=F64), **TIGHT)


def test_inputs_are_unchanged_and_no_gradient_flows():
    rewards, values, mask = random_case(9)
    values.requires_grad_(True)
    copies = rewards.clone(), values.detach().clone()
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, gae_lambda=0.9)
    assert not advantages.requires_grad and not returns.requires_grad
    torch.testing.assert_close(rewards, copies[0], **EXACT)
    torch.testing.assert_close(values.detach(), copies[1], **EXACT)


def test_mismatched_shapes_are_an_error():
    with pytest.raises(ValueError, match="must share a shape"):
        compute_gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool), gamma=1.0, gae_lambda=1.0)
