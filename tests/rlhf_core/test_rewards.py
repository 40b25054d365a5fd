"""KL estimators and shaped per-token rewards: hand values, closed forms, a reference loop, invariances."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf_core.rewards import (
    ScoreMoments,
    fold_normalisation,
    kl_estimate,
    last_action_index,
    normalize_scores,
    shaped_rewards,
    update_moments,
)
from rlhf_core.sequences import action_mask_from_tokens

EXACT = dict(rtol=0.0, atol=0.0)
TIGHT = dict(rtol=1e-12, atol=1e-12)
F64 = torch.float64


# ----------------------------------------------------------------------------- KL estimators


def test_kl_estimators_by_hand():
    # d = logp - ref = 0.5, -1, 0 and ln 2 (p = 0.5 against ref = 0.25).
    logprobs = torch.tensor([[0.0, -1.0, -0.3, math.log(0.5)]], dtype=F64)
    ref_logprobs = torch.tensor([[-0.5, 0.0, -0.3, math.log(0.25)]], dtype=F64)
    ln2 = math.log(2.0)
    # k1 = d
    torch.testing.assert_close(
        kl_estimate(logprobs, ref_logprobs, estimator="k1"), torch.tensor([[0.5, -1.0, 0.0, ln2]], dtype=F64), **TIGHT
    )
    # k2 = d^2 / 2: 0.125, 0.5, 0, (ln 2)^2 / 2
    torch.testing.assert_close(
        kl_estimate(logprobs, ref_logprobs, estimator="k2"),
        torch.tensor([[0.125, 0.5, 0.0, ln2**2 / 2]], dtype=F64),
        **TIGHT,
    )
    # k3 = exp(-d) - 1 + d: e^-0.5 - 0.5 = 0.10653066, e - 2 = 0.71828183, 0, 1/2 - 1 + ln 2 = 0.19314718
    torch.testing.assert_close(
        kl_estimate(logprobs, ref_logprobs, estimator="k3"),
        torch.tensor([[0.1065306597126334, 0.7182818284590451, 0.0, 0.1931471805599453]], dtype=F64),
        **TIGHT,
    )


def test_default_estimator_is_k1_and_an_unknown_one_is_an_error():
    logprobs, ref = torch.tensor([[-1.0]]), torch.tensor([[-3.0]])
    assert kl_estimate(logprobs, ref).item() == 2.0
    with pytest.raises(ValueError, match="`estimator`"):
        kl_estimate(logprobs, ref, estimator="k4")  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(3))
def test_k1_and_k3_expectations_equal_the_exact_kl_of_two_categoricals(seed):
    # Under samples x ~ p, E[k1] = sum p log(p/q) = KL(p||q) and
    # E[k3] = sum p (q/p - 1 + log(p/q)) = sum q - 1 + KL = KL exactly; E[k2] = sum p log(p/q)^2 / 2.
    generator = torch.Generator().manual_seed(seed)
    log_p = torch.log_softmax(torch.randn(7, generator=generator, dtype=F64), dim=0)
    log_q = torch.log_softmax(torch.randn(7, generator=generator, dtype=F64), dim=0)
    p = log_p.exp()
    exact_kl = (p * (log_p - log_q)).sum()
    for estimator in ("k1", "k3"):
        expectation = (p * kl_estimate(log_p[None], log_q[None], estimator=estimator)[0]).sum()
        torch.testing.assert_close(expectation, exact_kl, **TIGHT)
    expectation_k2 = (p * kl_estimate(log_p[None], log_q[None], estimator="k2")[0]).sum()
    torch.testing.assert_close(expectation_k2, 0.5 * (p * (log_p - log_q) ** 2).sum(), **TIGHT)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.floats(-30, 30), st.floats(-30, 30))
def test_k3_and_k2_are_never_negative(logprob, ref_logprob):
    logprobs, ref = torch.tensor([[logprob]], dtype=F64), torch.tensor([[ref_logprob]], dtype=F64)
    assert kl_estimate(logprobs, ref, estimator="k3").item() >= 0.0
    assert kl_estimate(logprobs, ref, estimator="k2").item() >= 0.0


# ----------------------------------------------------------------------------- shaped rewards


def test_score_lands_on_the_eos_or_on_the_last_generated_token_when_truncated():
    eos = 2
    response = torch.tensor(
        [
            [5, 6, 7, 8],  # truncated, no EOS: score on token 3
            [5, eos, 0, 0],  # EOS at 1: score on token 1
            [eos, 0, 0, 0],  # EOS first: score on token 0
            [5, 6, 7, eos],  # EOS in the last slot: score on token 3
        ]
    )
    action_mask = action_mask_from_tokens(response, eos_token_id=eos)
    zeros = torch.zeros(4, 4)
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
    rewards, kl = shaped_rewards(scores, zeros, zeros, action_mask, kl_coef=0.1)
    expected = torch.tensor(
        [[0.0, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 4.0]],
    )
    torch.testing.assert_close(rewards, expected, **EXACT)
    torch.testing.assert_close(kl, zeros, **EXACT)
    torch.testing.assert_close(last_action_index(action_mask), torch.tensor([3, 1, 0, 3]), **EXACT)


def test_shaped_rewards_by_hand():
    # Row 0 is truncated (3 actions), row 1 stopped at EOS after 2 (its 3rd slot is padding).
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.4, -9.0]], dtype=F64)
    ref_logprobs = torch.tensor([[-1.5, -1.0, -0.5], [-0.7, -0.1, 5.0]], dtype=F64)
    action_mask = torch.tensor([[True, True, True], [True, True, False]])
    scores = torch.tensor([2.0, -1.0], dtype=F64)
    # k1: d = logp - ref = [0.5, -1, 0], [0.5, -0.3, (padding)]
    # r = -0.1 * d, plus the score on the last action: row 0 token 2, row 1 token 1.
    #   row 0: -0.05, 0.1, 0 + 2 = 2
    #   row 1: -0.05, 0.03 - 1 = -0.97, 0
    rewards, kl = shaped_rewards(scores, logprobs, ref_logprobs, action_mask, kl_coef=0.1)
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.0], [0.5, -0.3, 0.0]], dtype=F64), **TIGHT)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1, 2.0], [-0.05, -0.97, 0.0]], dtype=F64), **TIGHT)


def test_score_clip_bounds_the_score_before_it_lands():
    # scores 5 and -5 clipped to [-1, 1]; 0.3 passes unchanged. No KL (equal log-probs).
    zeros = torch.zeros(3, 2)
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    rewards, _ = shaped_rewards(torch.tensor([5.0, -5.0, 0.3]), zeros, zeros, mask, kl_coef=1.0, score_clip=1.0)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 1.0], [-1.0, 0.0], [0.0, 0.3]]), **EXACT)


def test_rewards_are_linear_in_kl_coef():
    # r(beta) = score_on_last - beta * kl, so r(0) is the bare score and r(2) - r(0) = -2 * kl.
    generator = torch.Generator().manual_seed(0)
    logprobs, ref = -torch.rand(2, 4, generator=generator, dtype=F64), -torch.rand(2, 4, generator=generator, dtype=F64)
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    scores = torch.tensor([0.7, -0.2], dtype=F64)
    for estimator in ("k1", "k2", "k3"):
        bare, kl = shaped_rewards(scores, logprobs, ref, mask, kl_coef=0.0, estimator=estimator)
        penalised, kl_again = shaped_rewards(scores, logprobs, ref, mask, kl_coef=2.0, estimator=estimator)
        torch.testing.assert_close(kl, kl_again, **EXACT)
        torch.testing.assert_close(penalised - bare, -2.0 * kl, **TIGHT)
        torch.testing.assert_close(bare, torch.tensor([[0, 0, 0.7, 0], [0, 0, 0, -0.2]], dtype=F64), **EXACT)
        torch.testing.assert_close(kl, kl_estimate(logprobs, ref, estimator=estimator) * mask, **EXACT)


def test_a_row_without_actions_gets_no_reward():
    mask = torch.tensor([[False, False], [True, False]])
    rewards, _ = shaped_rewards(torch.tensor([9.0, 1.0]), torch.zeros(2, 2), torch.zeros(2, 2), mask, kl_coef=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 0.0], [1.0, 0.0]]), **EXACT)


def test_scores_of_the_wrong_shape_are_an_error():
    zeros, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="`scores` must have shape"):
        shaped_rewards(torch.zeros(3), zeros, zeros, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="`scores` must have shape"):
        shaped_rewards(torch.zeros(2, 1), zeros, zeros, mask, kl_coef=0.1)


def reference_shaped_rewards(scores, logprobs, ref_logprobs, action_mask, *, kl_coef, estimator, score_clip):
    """The docstring's naive loop, in plain Python floats."""
    rows, length = action_mask.shape
    rewards = [[0.0] * length for _ in range(rows)]
    for b in range(rows):
        score = float(scores[b])
        if score_clip is not None:
            score = min(max(score, -score_clip), score_clip)
        last = int(action_mask[b].sum()) - 1
        for t in range(length):
            if action_mask[b, t]:
                d = float(logprobs[b, t] - ref_logprobs[b, t])
                kl = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[estimator]
                rewards[b][t] = -kl_coef * kl + (score if t == last else 0.0)
    return torch.tensor(rewards, dtype=F64)


def random_prefix_mask(rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(0, length + 1, (rows,), generator=generator)
    return torch.arange(length)[None, :] < lengths[:, None]  # (B, R)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("score_clip", [None, 0.5])
def test_shaped_rewards_equal_the_reference_loop(estimator, score_clip):
    generator = torch.Generator().manual_seed(1)
    rows, length = 6, 5
    logprobs = -3 * torch.rand(rows, length, generator=generator, dtype=F64)
    ref = -3 * torch.rand(rows, length, generator=generator, dtype=F64)
    mask = random_prefix_mask(rows, length, generator)
    scores = torch.randn(rows, generator=generator, dtype=F64)
    rewards, _ = shaped_rewards(scores, logprobs, ref, mask, kl_coef=0.2, estimator=estimator, score_clip=score_clip)
    expected = reference_shaped_rewards(
        scores, logprobs, ref, mask, kl_coef=0.2, estimator=estimator, score_clip=score_clip
    )
    torch.testing.assert_close(rewards, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("poison", [None, float("nan"), float("inf"), float("-inf")])
def test_values_at_padding_positions_never_matter(estimator, poison):
    generator = torch.Generator().manual_seed(2)
    rows, length = 5, 6
    logprobs = -2 * torch.rand(rows, length, generator=generator)
    ref = -2 * torch.rand(rows, length, generator=generator)
    mask = random_prefix_mask(rows, length, generator)
    mask[0] = True  # at least one full row and, almost surely, some padded ones
    scores = torch.randn(rows, generator=generator)
    if poison is None:
        garbage_logprobs = 100 * torch.randn(rows, length, generator=generator)
        garbage_ref = 100 * torch.randn(rows, length, generator=generator)
    else:
        garbage_logprobs = garbage_ref = torch.full((rows, length), poison)
    clean = shaped_rewards(scores, logprobs, ref, mask, kl_coef=0.1, estimator=estimator)
    dirty = shaped_rewards(
        scores,
        torch.where(mask, logprobs, garbage_logprobs),
        torch.where(mask, ref, garbage_ref),
        mask,
        kl_coef=0.1,
        estimator=estimator,
    )
    torch.testing.assert_close(dirty.rewards, clean.rewards, **EXACT)
    torch.testing.assert_close(dirty.kl, clean.kl, **EXACT)
    assert bool((clean.rewards[~mask] == 0).all()) and bool((clean.kl[~mask] == 0).all())


def test_inputs_are_not_modified():
    scores, logprobs, ref = torch.tensor([3.0]), torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.5]])
    mask = torch.tensor([[True, False]])
    copies = [scores.clone(), logprobs.clone(), ref.clone()]
    shaped_rewards(scores, logprobs, ref, mask, kl_coef=0.1, score_clip=1.0)
    for original, copy in zip([scores, logprobs, ref], copies, strict=True):
        torch.testing.assert_close(original, copy, **EXACT)


def test_normalize_scores_by_hand():
    # (s - 1) / 2: 3 -> 1, -1 -> -1, 1 -> 0
    torch.testing.assert_close(
        normalize_scores(torch.tensor([3.0, -1.0, 1.0]), mean=1.0, std=2.0, eps=0.0), torch.tensor([1.0, -1.0, 0.0])
    )


def test_issue43_the_normalisation_folded_into_a_score_head_by_hand():
    # Head 2 h1 - 4 h2 + 1, mean 3, std 2: weight (1, -2), bias (1 - 3) / 2 = -1. At h = (1, 1) the head scored -1,
    # normalised (-1 - 3) / 2 = -2, and the folded head gives 1 - 2 - 1 = -2; at h = (0.5, -3) it scored
    # 1 + 12 + 1 = 14, normalised (14 - 3) / 2 = 5.5, folded 0.5 + 6 - 1 = 5.5.
    head = torch.nn.Linear(2, 1)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[2.0, -4.0]]))
        head.bias.fill_(1.0)
    raw = head(torch.tensor([[1.0, 1.0], [0.5, -3.0]])).squeeze(-1).detach()
    fold_normalisation(head, mean=3.0, std=2.0, eps=0.0)
    assert head.weight.tolist() == [[1.0, -2.0]] and head.bias.tolist() == [-1.0]
    folded = head(torch.tensor([[1.0, 1.0], [0.5, -3.0]])).squeeze(-1).detach()
    torch.testing.assert_close(folded, normalize_scores(raw, mean=3.0, std=2.0, eps=0.0))
    assert folded.tolist() == [-2.0, 5.5]
    with pytest.raises(ValueError, match="one output and a bias"):
        fold_normalisation(torch.nn.Linear(2, 1, bias=False), mean=0.0, std=1.0)


def test_issue35_running_score_moments_by_hand():
    # First batch 1, 3: count 2, mean 2, M2 = 1 + 1 = 2, std sqrt(2 / 1).
    first = update_moments(None, torch.tensor([1.0, 3.0]))
    assert first == ScoreMoments(2, 2.0, 2.0) and first.std == pytest.approx(math.sqrt(2.0))
    # Then 5, 7, 9: mean 7, M2 8; merged: count 5, delta 5, mean 2 + 5 * 3 / 5 = 5,
    # M2 = 2 + 8 + 25 * 2 * 3 / 5 = 40 (all five: 16 + 4 + 0 + 4 + 16), std sqrt(40 / 4) = sqrt(10).
    merged = update_moments(first, torch.tensor([5.0, 7.0, 9.0]))
    assert merged == ScoreMoments(5, 5.0, 40.0) and merged.std == pytest.approx(math.sqrt(10.0))
    assert ScoreMoments(1, 4.0, 0.0).std == 1.0  # one score: no spread known yet


@given(st.lists(st.lists(st.floats(-100, 100), min_size=1, max_size=6), min_size=1, max_size=5))
@settings(max_examples=50, deadline=None)
def test_issue35_running_moments_equal_those_of_every_score_at_once(batches):
    moments = None
    for batch in batches:
        moments = update_moments(moments, torch.tensor(batch, dtype=F64))
    every = torch.tensor([value for batch in batches for value in batch], dtype=F64)
    assert moments.count == every.numel()
    assert moments.mean == pytest.approx(float(every.mean()), abs=1e-9)
    assert moments.m2 == pytest.approx(float((every - every.mean()).square().sum()), rel=1e-9, abs=1e-6)


def test_last_action_index_by_hand():
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    torch.testing.assert_close(last_action_index(mask), torch.tensor([2, 0, 0]), **EXACT)


def test_last_action_index_of_a_mask_with_gaps_is_its_last_true():
    # An episode: model tokens at 0, 1 and 4 (2 and 3 are the environment's, 5 is padding). The last
    # action is token 4, not sum - 1 = 2 (an environment token): the score must never land there.
    mask = torch.tensor([[True, True, False, False, True, False], [False, True, False, True, False, False]])
    torch.testing.assert_close(last_action_index(mask), torch.tensor([4, 3]), **EXACT)
    rewards, _ = shaped_rewards(torch.tensor([1.0, 2.0]), torch.zeros(2, 6), torch.zeros(2, 6), mask, kl_coef=0.1)
    assert torch.equal(rewards, torch.tensor([[0.0, 0, 0, 0, 1, 0], [0, 0, 0, 2, 0, 0]]))
