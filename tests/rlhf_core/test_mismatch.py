"""The sampler's mismatch to the trainer's log-probs, and truncated importance sampling: hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.losses import policy_loss
from rlhf_core.mismatch import logprob_mismatch, tis_weights

TIGHT = dict(rtol=1e-6, atol=1e-7)


def test_mismatch_of_two_tokens_by_hand():
    # Differences |old - engine|: |-1 - -1.5| = 0.5 and |-2 - -2| = 0; the third token is padding (its 9.0 is
    # ignored). max = 0.5; token_mult_prob_error = (e^0.5 + e^0) / 2 = (1.6487213 + 1) / 2 = 1.3243606.
    old = torch.tensor([[-1.0, -2.0, 0.0]])
    engine = torch.tensor([[-1.5, -2.0, 9.0]])
    mask = torch.tensor([[True, True, False]])
    mismatch = logprob_mismatch(old, engine, mask)
    torch.testing.assert_close(mismatch.max_abs_diff, torch.tensor(0.5), **TIGHT)
    torch.testing.assert_close(mismatch.token_mult_prob_error, torch.tensor((math.exp(0.5) + 1) / 2), **TIGHT)


def test_equal_log_probs_give_no_mismatch():
    values = torch.randn(3, 4)
    mismatch = logprob_mismatch(values, values.clone(), torch.ones(3, 4, dtype=torch.bool))
    assert float(mismatch.max_abs_diff) == 0.0 and float(mismatch.token_mult_prob_error) == 1.0


def test_tis_weights_by_hand():
    # exp(old - engine): exp(-1 - -1.5) = e^0.5 = 1.6487 > cap 1.5 -> 1.5; exp(-1 - -0.5) = e^-0.5 = 0.60653 (kept:
    # only the upper side is truncated); exp(0) = 1; padding -> 1 whatever sits there.
    old = torch.tensor([[-1.0, -1.0, -2.0, 0.0]])
    engine = torch.tensor([[-1.5, -0.5, -2.0, float("nan")]])
    mask = torch.tensor([[True, True, True, False]])
    weights = tis_weights(old, engine, mask, cap=1.5)
    torch.testing.assert_close(weights, torch.tensor([[1.5, math.exp(-0.5), 1.0, 1.0]]), **TIGHT)


def test_tis_cap_must_be_positive():
    with pytest.raises(ValueError, match="`cap`"):
        tis_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), cap=0.0)


def test_policy_loss_weighs_each_token_by_its_tis_weight():
    # Ratio 1 (logprobs = old): per-token loss -A = [-1, 2]; weighted by [0.5, 1.5] -> [-0.5, 3.0];
    # token mean 1.25 (unweighted: 0.5). No gradient flows through the weights.
    old = torch.tensor([[-1.0, -2.0]])
    logprobs = old.clone().requires_grad_(True)
    advantages = torch.tensor([[1.0, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    weights = torch.tensor([[0.5, 1.5]], requires_grad=True)
    loss, _ = policy_loss(logprobs, old, advantages, mask, weights=weights)
    unweighted, _ = policy_loss(logprobs, old, advantages, mask)
    torch.testing.assert_close(loss, torch.tensor(1.25), **TIGHT)
    torch.testing.assert_close(unweighted, torch.tensor(0.5), **TIGHT)
    loss.backward()
    assert weights.grad is None
    # d loss / d logprobs_t = -A_t * w_t / 2 tokens: [-0.25, 1.5].
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, 1.5]]), **TIGHT)
