"""Stale rows and their correction (rlhf_core.off_policy): staleness as a query, the bound, decoupled PPO's loss by
hand, and that on-policy rows change nothing."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from rlhf_core.config import PPOConfig
from rlhf_core.experience import Experience
from rlhf_core.off_policy import (
    check_staleness,
    decoupled_weights,
    off_policy_stats,
    proximal_logprobs,
    row_staleness,
)
from rlhf_core.ppo import Denominators, _minibatch_losses, ppo_update
from tests.rlhf_core.test_ppo import setup

LOG = math.log


class FixedLogits(nn.Module):
    """A causal LM whose logits are given: position t scores token t + 1; the log-probs of the tokens it is asked about
    are then exactly the ones written down below."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits
        self.weight = nn.Parameter(torch.zeros(()))  # the loss needs a graph back to a parameter

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        return SimpleNamespace(logits=self.logits + self.weight)


def hand_batch() -> tuple[FixedLogits, Experience]:
    """One row: a prompt token, then the actions 0 and 1 and a padding position.

    The policy being trained gives them 0.66 and 0.35; the proximal policy (where the update started) 0.6 and 0.5; the
    behaviour policy (which sampled them, a version older) 0.5 and 0.2. Advantages 1 and -2 (5 at the padding, which
    must change nothing).
    """
    vocabulary = [[LOG(0.66), LOG(0.34)], [LOG(0.65), LOG(0.35)], [0.0, 0.0], [0.0, 0.0]]
    actor = FixedLogits(torch.tensor([vocabulary]))  # (1, T=4, V=2)
    zeros = torch.zeros(1, 3)
    experience = Experience(
        sequences=torch.tensor([[0, 0, 1, 0]]),
        attention_mask=torch.tensor([[1, 1, 1, 0]]),
        action_mask=torch.tensor([[True, True, False]]),
        old_logprobs=torch.tensor([[LOG(0.5), LOG(0.2), 0.0]]),
        ref_logprobs=zeros,
        old_values=None,
        scores=torch.zeros(1),
        rewards=zeros,
        kl=zeros,
        advantages=torch.tensor([[1.0, -2.0, 5.0]]),
        returns=zeros,
        policy_versions=torch.tensor([3]),
        prox_logprobs=torch.tensor([[LOG(0.6), LOG(0.5), 0.0]]),
    )
    return actor, experience


def hand_loss(correction: str, *, cap: float = 2.0) -> float:
    actor, experience = hand_batch()
    config = PPOConfig(clip_eps=0.2, off_policy=correction, behaviour_weight_cap=cap)
    denominators = Denominators(tokens=torch.tensor(2.0), loss=torch.tensor(2.0))
    losses = _minibatch_losses(
        actor, None, experience, config, temperature=1.0, norm_tokens=None, denominators=denominators
    )
    return float(losses.actor_loss.detach())


def test_decoupled_ppo_by_hand():
    # Behaviour weights w = min(pi_prox / pi_behaviour, 2): 0.6 / 0.5 = 1.2, and 0.5 / 0.2 = 2.5 capped at 2.
    # Ratios to the proximal policy r = pi / pi_prox: 0.66 / 0.6 = 1.1 (inside [0.8, 1.2]), 0.35 / 0.5 = 0.7.
    # Token 0 (A = 1):  max(-1 * 1.1, -1 * 1.1) = -1.1, weighed 1.2: -1.32.
    # Token 1 (A = -2): max(2 * 0.7, 2 * clip(0.7) = 2 * 0.8) = 1.6, weighed 2: 3.2.
    # Token mean over the 2 actions: (-1.32 + 3.2) / 2 = 0.94.
    assert hand_loss("decoupled") == pytest.approx(0.94, abs=1e-5)
    # A cap of 1.5 truncates the first weight too: (-1.1 * 1.2 + 1.6 * 1.5) / 2 = (-1.32 + 2.4) / 2 = 0.54.
    assert hand_loss("decoupled", cap=1.5) == pytest.approx(0.54, abs=1e-5)


def test_behaviour_log_probs_as_pi_old_by_hand():
    # Ratios to the behaviour policy: 0.66 / 0.5 = 1.32 and 0.35 / 0.2 = 1.75, no weights.
    # Token 0 (A = 1):  max(-1.32, -1.2) = -1.2.   Token 1 (A = -2): max(2 * 1.75, 2 * 1.2) = 3.5.
    # (-1.2 + 3.5) / 2 = 1.15: the clip is around a policy the update has left, and the stale token's gradient is 0.
    assert hand_loss("behaviour") == pytest.approx(1.15, abs=1e-5)


def test_the_weights_are_one_at_padding_and_the_same_truncated_weight_as_tis():
    weights = decoupled_weights(
        torch.tensor([[LOG(0.6), LOG(0.5), 7.0]]),
        torch.tensor([[LOG(0.5), LOG(0.2), -7.0]]),
        torch.tensor([[True, True, False]]),
        cap=2.0,
    )
    torch.testing.assert_close(weights, torch.tensor([[1.2, 2.0, 1.0]]), rtol=0, atol=1e-6)


def test_staleness_is_the_update_version_less_each_rows_and_the_bound_is_refused_beyond():
    versions = torch.tensor([4, 4, 3, 5])
    staleness = row_staleness(versions, 5, rows=4)
    assert staleness.tolist() == [1, 1, 2, 0]
    check_staleness(staleness, bound=2)
    with pytest.raises(ValueError, match="2 policy versions behind the update; `sampling.staleness` allows 1"):
        check_staleness(staleness, bound=1)
    with pytest.raises(ValueError, match="1 version\\(s\\) newer"):
        check_staleness(row_staleness(versions, 4, rows=4), bound=3)
    # Experience kept before versions were (schema 5) was all sampled on-policy.
    assert row_staleness(None, 7, rows=3).tolist() == [0, 0, 0]


def test_off_policy_statistics_by_hand():
    _, experience = hand_batch()
    stats = off_policy_stats(experience, torch.tensor([1]), cap=2.0)
    assert float(stats.staleness_max) == 1 and float(stats.stale_fraction) == 1
    assert float(stats.behaviour_weight_mean) == pytest.approx((1.2 + 2.0) / 2, abs=1e-6)
    assert float(stats.behaviour_weight_capped) == pytest.approx(0.5)
    fresh = off_policy_stats(experience.replace(prox_logprobs=None), torch.tensor([0]), cap=2.0)
    assert fresh == (0.0, 0.0, 1.0, 0.0)


def test_proximal_log_probs_of_the_starting_policy_make_an_on_policy_update_exactly_sequential():
    """pi_prox is the update's own forward: given an on-policy batch's, decoupled PPO takes exactly the steps PPO
    takes (every weight 1, every ratio the same), whatever batches the forward ran in."""
    accelerator, actor, critic, actor_optimizer, critic_optimizer, experience = setup()
    prox = proximal_logprobs(actor, experience, temperature=0.7, batch_size=3)
    torch.testing.assert_close(
        prox[experience.action_mask], experience.old_logprobs[experience.action_mask], rtol=0, atol=1e-5
    )
    results = []
    for prox_logprobs in (None, experience.old_logprobs):
        models = copy.deepcopy((actor, critic))
        optimizers = (
            torch.optim.Adam(models[0].parameters(), lr=1e-3),
            torch.optim.Adam(models[1].parameters(), lr=1e-3),
        )
        stats = ppo_update(
            *models, *optimizers, experience.replace(prox_logprobs=prox_logprobs), PPOConfig(epochs=1, minibatch_size=4),
            accelerator=accelerator, temperature=0.7, generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        results.append((stats, [parameter.detach().clone() for parameter in models[0].parameters()]))
    (plain, plain_weights), (decoupled, decoupled_weights_) = results
    assert float(plain.policy_loss) == float(decoupled.policy_loss)
    for left, right in zip(plain_weights, decoupled_weights_, strict=True):
        assert torch.equal(left, right)
