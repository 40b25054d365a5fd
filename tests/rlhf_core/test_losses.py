"""PPO policy and value losses, entropy, aggregation and the Bradley-Terry loss: hand values, loops, invariances."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.losses import (
    aggregate_loss,
    entropy_from_logits,
    pairwise_reward_loss,
    policy_loss,
    reference_kl_loss,
    value_loss,
)

EXACT = dict(rtol=0.0, atol=0.0)
TIGHT = dict(rtol=1e-10, atol=1e-12)
F64 = torch.float64


def k3(ratio: float) -> float:
    """k3 estimate of KL(old || new) from one sampled token: (r - 1) - log r."""
    return ratio - 1 - math.log(ratio)


# ----------------------------------------------------------------------------- policy loss

# Six valid tokens (row 0: A, B, C, D; row 1: E, F, then two padding slots), clip_eps = 0.2:
#   token  ratio  adv   -adv*ratio  -adv*clip(ratio)   loss = max   clip active   d loss / d logprob
#   A      1.1    +2    -2.2        -2.2               -2.2         no            -adv*ratio = -2.2
#   B      1.5    +2    -3.0        -2.4               -2.4         yes           0
#   C      1.5    -1     1.5         1.2                1.5         no            1.5
#   D      0.5    -1     0.5         0.8                0.8         yes           0
#   E      0.5    +2    -1.0        -1.6               -1.0         no            -1.0
#   F      0.9    -1     0.9         0.9                0.9         no            0.9
RATIOS = torch.tensor([[1.1, 1.5, 1.5, 0.5], [0.5, 0.9, 1.0, 1.0]], dtype=F64)
ADVANTAGES = torch.tensor([[2.0, 2.0, -1.0, -1.0], [2.0, -1.0, 0.0, 0.0]], dtype=F64)
MASK = torch.tensor([[True, True, True, True], [True, True, False, False]])
OLD_LOGPROBS = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.6], [0.5, 0.25, 0.1, 0.1]], dtype=F64))
PER_TOKEN_LOSS = torch.tensor([[-2.2, -2.4, 1.5, 0.8], [-1.0, 0.9, 0.0, 0.0]], dtype=F64)
PER_TOKEN_GRAD = torch.tensor([[-2.2, 0.0, 1.5, 0.0], [-1.0, 0.9, 0.0, 0.0]], dtype=F64)


def hand_logprobs() -> torch.Tensor:
    return (OLD_LOGPROBS + RATIOS.log()).clone().requires_grad_(True)


def test_policy_loss_token_mean_by_hand():
    # token mean: (-2.2 - 2.4 + 1.5 + 0.8 - 1.0 + 0.9) / 6 = -2.4 / 6 = -0.4
    logprobs = hand_logprobs()
    loss, stats = policy_loss(logprobs, OLD_LOGPROBS, ADVANTAGES, MASK, clip_eps=0.2)
    torch.testing.assert_close(loss, torch.tensor(-0.4, dtype=F64), **TIGHT)
    loss.backward()
    # Each valid token's gradient is its per-token derivative / 6; exactly 0 where the clip is active.
    torch.testing.assert_close(logprobs.grad, PER_TOKEN_GRAD / 6, **TIGHT)
    assert logprobs.grad[0, 1].item() == 0.0 and logprobs.grad[0, 3].item() == 0.0
    # clip fraction: B and D, 2 of 6 valid tokens
    torch.testing.assert_close(stats.clip_fraction, torch.tensor(2 / 6, dtype=F64), **TIGHT)
    torch.testing.assert_close(stats.dual_clip_fraction, torch.tensor(0.0, dtype=F64), **EXACT)
    # approx_kl: mean of (r - 1) - log r over the six valid ratios 1.1, 1.5, 1.5, 0.5, 0.5, 0.9
    #   = (0.0046898 + 2 * 0.0945349 + 2 * 0.1931472 + 0.0053605) / 6 = 0.0975691
    expected_kl = (k3(1.1) + 2 * k3(1.5) + 2 * k3(0.5) + k3(0.9)) / 6
    torch.testing.assert_close(stats.approx_kl, torch.tensor(expected_kl, dtype=F64), **TIGHT)
    assert abs(expected_kl - 0.0975691) < 1e-7
    assert not stats.approx_kl.requires_grad and not stats.clip_fraction.requires_grad


def test_policy_loss_sequence_mean_by_hand():
    # row 0: (-2.2 - 2.4 + 1.5 + 0.8) / 4 = -0.575; row 1: (-1.0 + 0.9) / 2 = -0.05
    # sequence mean: (-0.575 - 0.05) / 2 = -0.3125; gradients are per-token / 4 / 2 and / 2 / 2.
    logprobs = hand_logprobs()
    loss, _ = policy_loss(logprobs, OLD_LOGPROBS, ADVANTAGES, MASK, clip_eps=0.2, aggregation="sequence_mean")
    torch.testing.assert_close(loss, torch.tensor(-0.3125, dtype=F64), **TIGHT)
    loss.backward()
    row_weights = torch.tensor([[1 / 8], [1 / 4]], dtype=F64)
    torch.testing.assert_close(logprobs.grad, PER_TOKEN_GRAD * row_weights, **TIGHT)


def test_ratio_one_gives_minus_mean_advantage_and_no_clipping():
    # At the first PPO step logprobs == old_logprobs: loss = -mean(A), clip fraction 0, approx_kl 0.
    loss, stats = policy_loss(OLD_LOGPROBS, OLD_LOGPROBS, ADVANTAGES, MASK)
    torch.testing.assert_close(loss, -ADVANTAGES[MASK].mean(), **TIGHT)
    assert stats.clip_fraction.item() == 0.0 and stats.approx_kl.item() == 0.0


@pytest.mark.parametrize("advantage", [1.0, -1.0])
@pytest.mark.parametrize("ratio", [0.3, 0.79, 1.21, 3.0])
def test_gradient_is_exactly_zero_where_the_clip_is_active(advantage, ratio):
    # The clip is active (the clipped term is the max) when A > 0 and r > 1 + eps, or A < 0 and r < 1 - eps.
    old = torch.tensor([[-1.0]], dtype=F64)
    logprobs = (old + math.log(ratio)).requires_grad_(True)
    loss, stats = policy_loss(logprobs, old, torch.tensor([[advantage]], dtype=F64), torch.ones(1, 1, dtype=torch.bool))
    loss.backward()
    clip_active = (advantage > 0 and ratio > 1.2) or (advantage < 0 and ratio < 0.8)
    assert stats.clip_fraction.item() == float(clip_active)
    if clip_active:
        assert logprobs.grad.item() == 0.0
        torch.testing.assert_close(loss, torch.tensor(-advantage * min(max(ratio, 0.8), 1.2), dtype=F64), **TIGHT)
    else:
        # d(-A * r)/d logprob = -A * r
        torch.testing.assert_close(logprobs.grad, torch.tensor([[-advantage * ratio]], dtype=F64), **TIGHT)


def test_dual_clip_by_hand():
    # clip_eps = 0.2, dual_clip c = 3; bound for A < 0 is -c * A:
    #   ratio  adv  max(unclipped, clipped)      dual bound  loss   d loss / d logprob
    #   5.0    -1   max(5.0, 1.2)  = 5.0         3.0         3.0    0 (dual clip active)
    #   2.0    -1   max(2.0, 1.2)  = 2.0         3.0         2.0    -A * r = 2.0
    #   5.0    +1   max(-5.0, -1.2) = -1.2       (A > 0)     -1.2   0 (ordinary clip)
    #   0.5    -2   max(1.0, 1.6)  = 1.6         6.0         1.6    0 (ordinary clip)
    # mean = (3 + 2 - 1.2 + 1.6) / 4 = 1.35; dual-clip fraction 1/4; clip fraction (clipped > unclipped) 2/4.
    ratios = torch.tensor([[5.0, 2.0, 5.0, 0.5]], dtype=F64)
    advantages = torch.tensor([[-1.0, -1.0, 1.0, -2.0]], dtype=F64)
    old = torch.full((1, 4), -2.0, dtype=F64)
    logprobs = (old + ratios.log()).requires_grad_(True)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, stats = policy_loss(logprobs, old, advantages, mask, clip_eps=0.2, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor(1.35, dtype=F64), **TIGHT)
    torch.testing.assert_close(stats.dual_clip_fraction, torch.tensor(0.25, dtype=F64), **TIGHT)
    torch.testing.assert_close(stats.clip_fraction, torch.tensor(0.5, dtype=F64), **TIGHT)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 2.0, 0.0, 0.0]], dtype=F64) / 4, **TIGHT)
    # Without the dual clip the first token costs 5 instead of 3: mean (5 + 2 - 1.2 + 1.6) / 4 = 1.85.
    plain, _ = policy_loss(logprobs, old, advantages, mask, clip_eps=0.2)
    torch.testing.assert_close(plain, torch.tensor(1.85, dtype=F64), **TIGHT)


def test_dual_clip_bounds_every_negative_advantage_token():
    generator = torch.Generator().manual_seed(0)
    advantages = -torch.rand(1, 200, generator=generator, dtype=F64) - 0.1  # all negative
    log_ratio = 4 * torch.randn(1, 200, generator=generator, dtype=F64)
    old = torch.zeros(1, 200, dtype=F64)
    for column in range(200):  # per-token losses through a one-hot mask
        mask = torch.zeros(1, 200, dtype=torch.bool)
        mask[0, column] = True
        loss, _ = policy_loss(log_ratio, old, advantages, mask, dual_clip=2.5)
        assert loss.item() <= -2.5 * advantages[0, column].item() + 1e-12


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="`dual_clip` must be greater than 1"):
        policy_loss(OLD_LOGPROBS, OLD_LOGPROBS, ADVANTAGES, MASK, dual_clip=1.0)


def reference_aggregate(per_row: list[list[float]], aggregation: str, norm_tokens: int | None = None) -> float:
    """The three aggregations of per-token losses (one list per row, valid tokens only), in Python floats."""
    all_tokens = [loss for row in per_row for loss in row]
    if aggregation == "token_mean":
        return sum(all_tokens) / len(all_tokens)
    if aggregation == "token_sum_norm":
        return sum(sum(row) / norm_tokens for row in per_row) / len(per_row)
    means = [sum(row) / len(row) for row in per_row if row]
    return sum(means) / len(means)


def reference_policy_loss(logprobs, old_logprobs, advantages, mask, *, clip_eps, dual_clip, aggregation):
    """Plain loop in Python floats: per-token clipped surrogate, then the chosen aggregation."""
    rows, length = mask.shape
    per_row = []
    clipped_count = dual_count = 0
    for b in range(rows):
        row = []
        for t in range(length):
            if not mask[b, t]:
                continue
            ratio = math.exp(float(logprobs[b, t] - old_logprobs[b, t]))
            a = float(advantages[b, t])
            unclipped, clipped = -a * ratio, -a * min(max(ratio, 1 - clip_eps), 1 + clip_eps)
            loss = max(unclipped, clipped)
            clipped_count += clipped > unclipped
            if dual_clip is not None and a < 0 and loss > -dual_clip * a:
                loss = -dual_clip * a
                dual_count += 1
            row.append(loss)
        per_row.append(row)
    tokens = sum(len(row) for row in per_row)
    value = reference_aggregate(per_row, aggregation, norm_tokens=NORM_TOKENS)
    return value, clipped_count / tokens, dual_count / tokens


def ragged_mask(rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(1, length + 1, (rows,), generator=generator)
    lengths[-1] = 0  # a row without any valid token
    return torch.arange(length)[None, :] < lengths[:, None]


NORM_TOKENS = 9
"""The generation budget the reference loops use for ``token_sum_norm``."""
AGGREGATIONS = ["token_mean", "sequence_mean", "token_sum_norm"]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("dual_clip", [None, 2.0])
@pytest.mark.parametrize("seed", range(3))
def test_policy_loss_equals_the_reference_loop(aggregation, dual_clip, seed):
    generator = torch.Generator().manual_seed(seed)
    shape = (5, 7)
    old = -3 * torch.rand(shape, generator=generator, dtype=F64)
    logprobs = old + 0.6 * torch.randn(shape, generator=generator, dtype=F64)
    advantages = torch.randn(shape, generator=generator, dtype=F64)
    mask = ragged_mask(*shape, generator)
    loss, stats = policy_loss(
        logprobs,
        old,
        advantages,
        mask,
        clip_eps=0.2,
        dual_clip=dual_clip,
        aggregation=aggregation,
        norm_tokens=NORM_TOKENS,
    )
    expected, clip_fraction, dual_fraction = reference_policy_loss(
        logprobs, old, advantages, mask, clip_eps=0.2, dual_clip=dual_clip, aggregation=aggregation
    )
    assert 0 < clip_fraction < 1
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=F64), **TIGHT)
    torch.testing.assert_close(stats.clip_fraction, torch.tensor(clip_fraction, dtype=F64), **TIGHT)
    torch.testing.assert_close(stats.dual_clip_fraction, torch.tensor(dual_fraction, dtype=F64), **TIGHT)


# ----------------------------------------------------------------------------- value loss

# value_clip_eps = 0.2; V_clip = old + clip(V - old, -0.2, 0.2):
#   V    old  R    V_clip  (V-R)^2  (V_clip-R)^2  max    clipped dominates  d/dV of 0.5 * max / 4
#   1.0  0.9  2.0  1.0     1.0      1.0           1.0    no (equal)         (V - R) / 4 = -0.25
#   1.5  1.0  2.0  1.2     0.25     0.64          0.64   yes                0
#   1.5  1.0  1.0  1.2     0.25     0.04          0.25   no                 (V - R) / 4 = 0.125
#   0.0  1.0  3.0  0.8     9.0      4.84          9.0    no                 (V - R) / 4 = -0.75
# loss = 0.5 * (1 + 0.64 + 0.25 + 9) / 4 = 1.36125; clip fraction 1/4.
# Unclipped: 0.5 * (1 + 0.25 + 0.25 + 9) / 4 = 1.3125.
VALUES = torch.tensor([[1.0, 1.5, 1.5, 0.0, 123.0]], dtype=F64)
OLD_VALUES = torch.tensor([[0.9, 1.0, 1.0, 1.0, -40.0]], dtype=F64)
RETURNS = torch.tensor([[2.0, 2.0, 1.0, 3.0, 7.0]], dtype=F64)
VALUE_MASK = torch.tensor([[True, True, True, True, False]])


def test_value_loss_with_clip_by_hand():
    values = VALUES.clone().requires_grad_(True)
    loss, stats = value_loss(values, OLD_VALUES, RETURNS, VALUE_MASK, value_clip_eps=0.2)
    torch.testing.assert_close(loss, torch.tensor(1.36125, dtype=F64), **TIGHT)
    torch.testing.assert_close(stats.clip_fraction, torch.tensor(0.25, dtype=F64), **TIGHT)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[-0.25, 0.0, 0.125, -0.75, 0.0]], dtype=F64), **TIGHT)
    assert values.grad[0, 1].item() == 0.0  # the clipped term dominates: exactly no gradient


def test_value_loss_without_clip_by_hand():
    values = VALUES.clone().requires_grad_(True)
    loss, stats = value_loss(values, OLD_VALUES, RETURNS, VALUE_MASK, value_clip_eps=None)
    torch.testing.assert_close(loss, torch.tensor(1.3125, dtype=F64), **TIGHT)
    assert stats.clip_fraction.item() == 0.0
    loss.backward()
    # 0.5 * (V - R)^2 / 4 -> (V - R) / 4
    torch.testing.assert_close(values.grad, torch.tensor([[-0.25, -0.125, 0.125, -0.75, 0.0]], dtype=F64), **TIGHT)


def test_a_value_inside_the_clip_range_is_never_counted_as_clipped():
    """Float rounding of ``old + (v - old)`` must not count as clipping. In float32, 0.0951585 + (1.7645634 - 0.0951585)
    rounds to 1.7645636, whose squared error to the return 1.6357816 is larger than the value's own, so a plain
    comparison of the two squared errors called this value, 1.67 from its old value with a clip of 2, clipped: 3.6% of
    random tokens were, a clip fraction that moved with batch shapes (one training process against two)."""
    old, values, returns = (
        torch.tensor([[x]], dtype=torch.float32) for x in (0.09515851736068726, 1.7645634412765503, 1.6357816457748413)
    )
    assert (old + (values - old)).item() != values.item()  # the rounding the statistic must not see
    _, stats = value_loss(values, old, returns, torch.tensor([[True]]), value_clip_eps=2.0)
    assert stats.clip_fraction.item() == 0.0


def test_value_loss_sequence_mean_by_hand():
    # rows: [0.25, 0.64] (mean 0.445) and [9.0] (mean 9.0): 0.5 * (0.445 + 9.0) / 2 = 2.36125
    values = torch.tensor([[1.5, 1.5], [0.0, 5.0]], dtype=F64)
    old = torch.tensor([[1.0, 1.0], [1.0, 5.0]], dtype=F64)
    returns = torch.tensor([[1.0, 2.0], [3.0, 5.0]], dtype=F64)
    mask = torch.tensor([[True, True], [True, False]])
    loss, _ = value_loss(values, old, returns, mask, value_clip_eps=0.2, aggregation="sequence_mean")
    torch.testing.assert_close(loss, torch.tensor(2.36125, dtype=F64), **TIGHT)


def reference_value_loss(values, old_values, returns, mask, *, value_clip_eps, aggregation):
    rows, length = mask.shape
    per_row = []
    for b in range(rows):
        row = []
        for t in range(length):
            if mask[b, t]:
                v, old, ret = float(values[b, t]), float(old_values[b, t]), float(returns[b, t])
                loss = (v - ret) ** 2
                if value_clip_eps is not None:
                    clipped = old + min(max(v - old, -value_clip_eps), value_clip_eps)
                    loss = max(loss, (clipped - ret) ** 2)
                row.append(0.5 * loss)
        per_row.append(row)
    return reference_aggregate(per_row, aggregation, norm_tokens=NORM_TOKENS)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("value_clip_eps", [None, 0.1])
def test_value_loss_equals_the_reference_loop(aggregation, value_clip_eps):
    generator = torch.Generator().manual_seed(3)
    shape = (6, 5)
    old = torch.randn(shape, generator=generator, dtype=F64)
    values = old + 0.3 * torch.randn(shape, generator=generator, dtype=F64)
    returns = torch.randn(shape, generator=generator, dtype=F64)
    mask = ragged_mask(*shape, generator)
    loss, _ = value_loss(
        values, old, returns, mask, value_clip_eps=value_clip_eps, aggregation=aggregation, norm_tokens=NORM_TOKENS
    )
    expected = reference_value_loss(values, old, returns, mask, value_clip_eps=value_clip_eps, aggregation=aggregation)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=F64), **TIGHT)


# ----------------------------------------------------------------------------- padding never matters


@pytest.mark.parametrize("poison", [None, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_padding_positions_never_change_losses_or_gradients(poison, aggregation):
    generator = torch.Generator().manual_seed(4)
    shape = (4, 6)
    mask = ragged_mask(*shape, generator)
    tensors = [torch.randn(shape, generator=generator, dtype=F64) for _ in range(7)]
    if poison is None:
        garbage = [100 * torch.randn(shape, generator=generator, dtype=F64) for _ in range(7)]
    else:
        garbage = [torch.full(shape, poison, dtype=F64) for _ in range(7)]
    results = []
    options = dict(aggregation=aggregation, norm_tokens=NORM_TOKENS)
    for fill in (None, garbage):
        logprobs, old, advantages, values, old_values, returns, ref = (
            tensor if fill is None else torch.where(mask, tensor, junk)
            for tensor, junk in zip(tensors, fill or tensors, strict=True)
        )
        logprobs = logprobs.clone().requires_grad_(True)
        values = values.clone().requires_grad_(True)
        actor_loss, policy_stats = policy_loss(logprobs, old, advantages, mask, dual_clip=3.0, **options)
        kl_loss, kl_stats = reference_kl_loss(logprobs, ref, mask, **options)
        critic_loss, value_stats = value_loss(values, old_values, returns, mask, **options)
        (actor_loss + kl_loss + critic_loss).backward()
        results.append(
            (actor_loss, kl_loss, critic_loss, *policy_stats, *kl_stats, *value_stats, logprobs.grad, values.grad)
        )
    for clean, dirty in zip(*results, strict=True):
        torch.testing.assert_close(dirty, clean, **EXACT)
    logprobs_grad, values_grad = results[0][-2:]
    assert bool((logprobs_grad[~mask] == 0).all()) and bool((values_grad[~mask] == 0).all())


# ----------------------------------------------------------------------------- aggregation


def test_token_mean_and_sequence_mean_by_hand():
    # rows [1, 2, 3] and [4] (the rest padding) and an empty row:
    #   token mean: (1 + 2 + 3 + 4) / 4 = 2.5; sequence mean: (2 + 4) / 2 = 3 (the empty row is left out)
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0], [7.0, 8.0, 9.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    torch.testing.assert_close(aggregate_loss(loss, mask, mode="token_mean"), torch.tensor(2.5, dtype=F64))
    torch.testing.assert_close(aggregate_loss(loss, mask, mode="sequence_mean"), torch.tensor(3.0, dtype=F64))
    with pytest.raises(ValueError, match="`mode`"):
        aggregate_loss(loss, mask, mode="sum")  # type: ignore[arg-type]


def test_token_sum_norm_divides_the_sum_by_rows_times_the_budget_by_hand():
    # Dr. GRPO: (1 + 2 + 3 + 4) / (3 rows * budget 4) = 10 / 12, whatever the lengths or padding hold.
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0], [7.0, 8.0, 9.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    result = aggregate_loss(loss, mask, mode="token_sum_norm", norm_tokens=4)
    torch.testing.assert_close(result, torch.tensor(10 / 12, dtype=F64), **TIGHT)
    with pytest.raises(ValueError, match="`norm_tokens`"):
        aggregate_loss(loss, mask, mode="token_sum_norm")


# ----------------------------------------------------------------------------- KL to the reference in the loss


def test_reference_kl_loss_is_k3_with_its_gradient_by_hand():
    # d = logprobs - ref = [0.5, 0.0 | pad]: k3 = exp(-d) - 1 + d = [0.1065307, 0]; token mean over 2 tokens
    # = 0.0532653. d k3 / d logprobs = 1 - exp(-d) = [0.3934693, 0], divided by the 2 tokens.
    logprobs = torch.tensor([[-1.0, -2.0, 7.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, float("nan")]], dtype=F64)
    mask = torch.tensor([[True, True, False]])
    loss, stats = reference_kl_loss(logprobs, ref, mask)
    k3 = math.exp(-0.5) - 1 + 0.5
    torch.testing.assert_close(loss, torch.tensor(k3 / 2, dtype=F64), **TIGHT)
    torch.testing.assert_close(stats.kl, torch.tensor(k3 / 2, dtype=F64), **TIGHT)
    assert abs(k3 - 0.1065307) < 1e-7
    loss.backward()
    expected_grad = torch.tensor([[(1 - math.exp(-0.5)) / 2, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(logprobs.grad, expected_grad, **TIGHT)


def test_reference_kl_loss_is_zero_with_zero_gradient_at_the_reference():
    ref = torch.randn(3, 4, dtype=F64)
    logprobs = ref.clone().requires_grad_(True)
    loss, _ = reference_kl_loss(logprobs, ref, torch.ones(3, 4, dtype=torch.bool), aggregation="sequence_mean")
    loss.backward()
    assert loss.item() == 0.0 and bool((logprobs.grad == 0).all())


# ----------------------------------------------------------------------------- entropy


def test_entropy_equals_minus_sum_p_log_p():
    generator = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(2, 3, 11, generator=generator, dtype=F64)
    p = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1), **TIGHT)


def test_entropy_of_uniform_logits_is_log_vocabulary_size():
    for vocabulary in (2, 7, 32):
        logits = torch.full((2, 3, vocabulary), 4.2, dtype=F64)
        torch.testing.assert_close(entropy_from_logits(logits), torch.full((2, 3), math.log(vocabulary), dtype=F64))


def test_entropy_is_stable_for_huge_logits_and_ignores_minus_infinity():
    # One dominant logit: entropy ~ 0, not NaN. Tokens at -inf have p = 0 and 0 * log 0 = 0, so two
    # finite equal logits among -inf ones give log 2.
    peaked = torch.tensor([[[1e4, 0.0, 0.0]]])
    assert entropy_from_logits(peaked).abs().item() < 1e-6
    filtered = torch.tensor([[[0.5, float("-inf"), 0.5, float("-inf")]]], dtype=F64)
    filtered.requires_grad_(True)
    entropy = entropy_from_logits(filtered)
    torch.testing.assert_close(entropy, torch.tensor([[math.log(2)]], dtype=F64), **TIGHT)
    entropy.sum().backward()
    # At the maximum-entropy point of the two kept tokens the gradient is 0, and never NaN.
    torch.testing.assert_close(filtered.grad, torch.zeros_like(filtered), **TIGHT)


# ----------------------------------------------------------------------------- Bradley-Terry


def test_bradley_terry_is_log_two_at_equal_scores():
    scores = torch.tensor([0.0, 1.5, -3.0], dtype=F64, requires_grad=True)
    loss, stats = pairwise_reward_loss(scores, scores.detach().clone())
    torch.testing.assert_close(loss, torch.tensor(math.log(2), dtype=F64), **TIGHT)
    assert stats.accuracy.item() == 0.0  # ties are not correct answers
    loss.backward()
    # d/dr_c of -log sigmoid(r_c - r_r) / B = -sigmoid(-(gap)) / B = -0.5 / 3 at gap 0
    torch.testing.assert_close(scores.grad, torch.full((3,), -0.5 / 3, dtype=F64), **TIGHT)


def test_bradley_terry_by_hand_with_and_without_margin():
    chosen = torch.tensor([2.0, 0.0, 1.0], dtype=F64)
    rejected = torch.tensor([0.0, 1.0, 1.0], dtype=F64)
    # gaps 2, -1, 0: -log sigmoid(g) = log(1 + e^-g) = 0.126928, 1.313262, 0.693147
    loss, stats = pairwise_reward_loss(chosen, rejected)
    expected = (math.log1p(math.exp(-2)) + math.log1p(math.exp(1)) + math.log(2)) / 3
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=F64), **TIGHT)
    torch.testing.assert_close(stats.accuracy, torch.tensor(1 / 3, dtype=F64), **TIGHT)  # only the first pair
    torch.testing.assert_close(stats.margin, torch.tensor(1 / 3, dtype=F64), **TIGHT)  # mean gap (2 - 1 + 0) / 3
    # A margin m shifts the gap: gaps 2 - 2 = 0, -1 - 0 = -1, 0 - (-1) = 1.
    margin = torch.tensor([2.0, 0.0, -1.0], dtype=F64)
    shifted, shifted_stats = pairwise_reward_loss(chosen, rejected, margin=margin)
    expected = (math.log(2) + math.log1p(math.exp(1)) + math.log1p(math.exp(-1))) / 3
    torch.testing.assert_close(shifted, torch.tensor(expected, dtype=F64), **TIGHT)
    torch.testing.assert_close(shifted_stats.accuracy, stats.accuracy, **EXACT)  # accuracy ignores the margin


def test_bradley_terry_equals_a_plain_loop_and_is_stable():
    generator = torch.Generator().manual_seed(6)
    chosen, rejected, margin = (torch.randn(9, generator=generator, dtype=F64) * 5 for _ in range(3))
    loss, stats = pairwise_reward_loss(chosen, rejected, margin=margin)
    terms = [
        math.log1p(math.exp(-(float(c) - float(r) - float(m))))
        for c, r, m in zip(chosen, rejected, margin, strict=True)
    ]
    torch.testing.assert_close(loss, torch.tensor(sum(terms) / 9, dtype=F64), **TIGHT)
    accuracy = sum(float(c) > float(r) for c, r in zip(chosen, rejected, strict=True)) / 9
    torch.testing.assert_close(stats.accuracy, torch.tensor(accuracy, dtype=F64), **TIGHT)
    # A huge wrong-way gap stays finite: -log sigmoid(-1000) = 1000.
    huge, _ = pairwise_reward_loss(torch.tensor([-500.0]), torch.tensor([500.0]))
    torch.testing.assert_close(huge, torch.tensor(1000.0), **TIGHT)


def test_bradley_terry_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="`chosen_scores`"):
        pairwise_reward_loss(torch.zeros(3), torch.zeros(4))
