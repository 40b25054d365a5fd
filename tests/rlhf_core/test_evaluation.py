"""Evaluation maths: per-response KL through the estimators, and the win rate with ties counting half."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.evaluation import correlation, episode_success, response_kl, win_rate
from rlhf_core.rewards import kl_estimate


def test_win_rate_by_hand():
    # wins: 3 > 1, 2 == 2 (half), 0 < 5, 4 > -1  ->  (1 + 0.5 + 0 + 1) / 4 = 0.625
    scores = torch.tensor([3.0, 2.0, 0.0, 4.0])
    baseline = torch.tensor([1.0, 2.0, 5.0, -1.0])
    assert win_rate(scores, baseline).item() == 0.625
    assert win_rate(baseline, scores).item() == 0.375  # the two sides' rates sum to 1
    with pytest.raises(ValueError, match="non-empty 1-D"):
        win_rate(torch.zeros(0), torch.zeros(0))
    with pytest.raises(ValueError, match="must be equal"):
        win_rate(torch.zeros(3), torch.zeros(2))


def test_response_kl_by_hand():
    # Row 0: d = 0.5, -0.25 over two actions; row 1: d = 1.0 over one action, then padding.
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 9.0, 9.0]])
    ref_logprobs = torch.tensor([[-1.5, -1.75, 0.0], [-1.5, -9.0, -9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    torch.testing.assert_close(response_kl(logprobs, ref_logprobs, mask), torch.tensor([0.25, 1.0]))  # k1: sum of d
    # k3 = exp(-d) - 1 + d per token, summed: never negative
    expected_k3 = torch.tensor(
        [
            (torch.exp(torch.tensor(-0.5)) - 1 + 0.5) + (torch.exp(torch.tensor(0.25)) - 1 - 0.25),
            torch.exp(torch.tensor(-1.0)) - 1 + 1.0,
        ]
    )
    torch.testing.assert_close(response_kl(logprobs, ref_logprobs, mask, estimator="k3"), expected_k3)


def test_response_kl_equals_the_reference_loop_and_ignores_padding():
    generator = torch.Generator().manual_seed(0)
    logprobs, ref_logprobs = -torch.rand(5, 7, generator=generator), -torch.rand(5, 7, generator=generator)
    mask = torch.arange(7)[None, :] < torch.tensor([7, 3, 1, 0, 5])[:, None]
    for estimator in ("k1", "k2", "k3"):
        expected = torch.stack(
            [kl_estimate(logprobs[b], ref_logprobs[b], estimator=estimator)[mask[b]].sum() for b in range(5)]
        )
        fast = response_kl(logprobs, ref_logprobs, mask, estimator=estimator)
        torch.testing.assert_close(fast, expected)
        poisoned = response_kl(logprobs.masked_fill(~mask, float("inf")), ref_logprobs, mask, estimator=estimator)
        torch.testing.assert_close(poisoned, fast, rtol=0.0, atol=0.0)


def test_issue35_the_correlation_of_scores_with_lengths_by_hand():
    # lengths 1, 2, 3 centre to -1, 0, 1; scores 3, 1, 2 centre to 1, -1, 0:
    # sum of products -1, sums of squares 2 and 2: -1 / sqrt(4) = -0.5
    lengths = torch.tensor([1.0, 2.0, 3.0])
    assert correlation(torch.tensor([3.0, 1.0, 2.0]), lengths).item() == pytest.approx(-0.5)
    assert correlation(2 * lengths + 1, lengths).item() == pytest.approx(1.0)  # scores that are the length
    assert correlation(torch.tensor([1.0, 1.0, 1.0]), lengths).item() == 0.0  # a constant: undefined, reported 0


def test_episode_success_by_turn_and_recovery_by_hand():
    # Four episodes of up to 3 turns, a turn succeeding when its reward is > 0:
    #   0: [0, 1, -]   fails turn 1, succeeds at turn 2: recovered
    #   1: [1, -, -]   succeeds at turn 1
    #   2: [-0.5, 0, 0] never succeeds: not recovered
    #   3: [-, -, -]   its reset failed (no turn): in no recovery, a failure at every turn; its 9.0 lies past its turns
    rewards = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [-0.5, 0.0, 0.0], [9.0, 0.0, 0.0]])
    turns = torch.tensor([2, 1, 3, 0])
    success = episode_success(rewards, turns)
    # by turn 1: episode 1 (1/4); by turn 2: episodes 0 and 1 (2/4); by turn 3: the same
    torch.testing.assert_close(success.by_turn, torch.tensor([0.25, 0.5, 0.5], dtype=torch.float64))
    # first turns played and failed: episodes 0 and 2; recovered: episode 0 -> 1/2
    assert success.recovered.item() == 0.5
    assert episode_success(torch.tensor([[1.0, 0.0]]), torch.tensor([1])).recovered.isnan()  # none failed turn 1
