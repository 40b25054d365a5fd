"""DPO, IPO and SimPO losses and their metrics: hand values, TRL's values, gradients, padding invariance."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.preference_losses import (
    SequenceLogprob,
    dpo_sigmoid_loss,
    ipo_loss,
    preference_log_ratio,
    preference_loss,
    preference_metrics,
    reduce_logprobs,
    simpo_loss,
)

EXACT = dict(rtol=0.0, atol=0.0)
TIGHT = dict(rtol=1e-12, atol=1e-12)
F64 = torch.float64


def f64(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# The worked pairs, h = (pi_c - ref_c) - (pi_r - ref_r):
#   pair 0: (-3 - -4) - (-6 - -5) = 1 - (-1) = 2
#   pair 1: (-2 - -2) - (-7 - -7) = 0
#   pair 2: (-5 - -4) - (-4 - -5) = -1 - 1 = -2
CHOSEN, REF_CHOSEN = f64(-3.0, -2.0, -5.0), f64(-4.0, -2.0, -4.0)
REJECTED, REF_REJECTED = f64(-6.0, -7.0, -4.0), f64(-5.0, -7.0, -5.0)
WORKED = (CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED)

# TRL's inputs: four pairs of summed log-probs, with response lengths for the length-normalised losses.
TRL_CHOSEN, TRL_REJECTED = f64(-14.2, -31.7, -8.05, -52.3), f64(-17.9, -29.4, -8.05, -61.0)
TRL_REF_CHOSEN, TRL_REF_REJECTED = f64(-15.0, -30.1, -9.3, -50.8), f64(-16.6, -30.0, -7.7, -58.2)
TRL_CHOSEN_LENGTHS, TRL_REJECTED_LENGTHS = f64(5, 12, 3, 20), f64(7, 10, 3, 25)
TRL_PAIRS = (TRL_CHOSEN, TRL_REJECTED, TRL_REF_CHOSEN, TRL_REF_REJECTED)


# ----------------------------------------------------------------------------- sequence log-probs


def test_reduce_logprobs_by_hand():
    # row 0: three tokens, -1 - 2 - 0.5 = -3.5, mean -3.5 / 3; row 1: one token, -4. Padding holds nan and inf.
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, math.nan], [-4.0, math.inf, -math.inf, 7.0]], dtype=F64)
    action_mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    total, mean = reduce_logprobs(logprobs, action_mask)
    torch.testing.assert_close(total, f64(-3.5, -4.0), **EXACT)
    torch.testing.assert_close(mean, f64(-3.5 / 3, -4.0), **EXACT)


def test_reduce_logprobs_equals_the_naive_loop():
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(4, 6, generator=generator, dtype=F64) * 5  # (B, R)
    lengths = [6, 1, 3, 5]
    action_mask = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]  # (B, R)
    total, mean = reduce_logprobs(logprobs, action_mask)
    for b, n in enumerate(lengths):
        tokens = [float(logprobs[b, t]) for t in range(n)]
        assert total[b].item() == pytest.approx(sum(tokens), rel=1e-12)
        assert mean[b].item() == pytest.approx(sum(tokens) / n, rel=1e-12)


@pytest.mark.parametrize("poison", [0.0, -1e30, math.nan, math.inf])
def test_extra_padding_never_changes_a_sequence_logprob_or_its_gradient(poison):
    # The same rows, padded to 5 and to 11 columns with ``poison`` after the last action token: identical values, and
    # the same gradient at every action token (none at padding).
    generator = torch.Generator().manual_seed(1)
    lengths = torch.tensor([5, 2, 4])
    rows = -torch.rand(3, 5, generator=generator, dtype=F64) * 3  # (B, 5)
    short_mask = torch.arange(5)[None, :] < lengths[:, None]  # (B, 5)
    long_mask = torch.arange(11)[None, :] < lengths[:, None]  # (B, 11)
    short = rows.masked_fill(~short_mask, poison).requires_grad_()
    long = torch.cat([rows, torch.full((3, 6), poison, dtype=F64)], dim=1).masked_fill(~long_mask, poison)
    long.requires_grad_()
    a, b = reduce_logprobs(short, short_mask), reduce_logprobs(long, long_mask)
    torch.testing.assert_close(a.total, b.total, **EXACT)
    torch.testing.assert_close(a.mean, b.mean, **EXACT)
    (a.total + a.mean).sum().backward()
    (b.total + b.mean).sum().backward()
    torch.testing.assert_close(short.grad, long.grad[:, :5], **EXACT)
    assert bool((long.grad[~long_mask] == 0).all()) and bool(long.grad.isfinite().all())
    # d(total + mean)/d(token) = 1 + 1/n at each action token.
    torch.testing.assert_close(short.grad[0], torch.full((5,), 1.2, dtype=F64), **TIGHT)


def test_a_response_with_no_action_token_or_mismatched_shapes_is_an_error():
    with pytest.raises(ValueError, match="no action token"):
        reduce_logprobs(torch.zeros(2, 3), torch.tensor([[True, False, False], [False, False, False]]))
    with pytest.raises(ValueError, match="must be equal"):
        reduce_logprobs(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool))


# ----------------------------------------------------------------------------- DPO (sigmoid, cDPO)


def test_log_ratio_by_hand():
    torch.testing.assert_close(preference_log_ratio(*WORKED), f64(2.0, 0.0, -2.0), **EXACT)


def test_dpo_sigmoid_loss_by_hand():
    # beta = 0.5, so beta * h = 1, 0, -1:
    #   -log sigmoid(1)  = log(1 + e^-1) = 0.31326168751822286
    #   -log sigmoid(0)  = log 2         = 0.6931471805599453
    #   -log sigmoid(-1) = log(1 + e)    = 1.3132616875182228
    expected = f64(0.31326168751822286, 0.6931471805599453, 1.3132616875182228)
    torch.testing.assert_close(dpo_sigmoid_loss(*WORKED, beta=0.5), expected, **TIGHT)


def test_label_smoothing_by_hand():
    # eps = 0.25, x = beta * h. Since -log sigmoid(-x) = -log sigmoid(x) + x, the cDPO loss
    # 0.75 * -log sigmoid(x) + 0.25 * -log sigmoid(-x) is -log sigmoid(x) + 0.25 * x:
    #   x = 1:  0.31326168751822286 + 0.25 = 0.5632616875182228
    #   x = 0:  log 2 (whatever eps)
    #   x = -1: 1.3132616875182228 - 0.25 = 1.0632616875182228
    expected = f64(0.5632616875182228, 0.6931471805599453, 1.0632616875182228)
    torch.testing.assert_close(dpo_sigmoid_loss(*WORKED, beta=0.5, label_smoothing=0.25), expected, **TIGHT)


def test_label_smoothing_zero_is_plain_dpo():
    plain = dpo_sigmoid_loss(*TRL_PAIRS, beta=0.1)
    torch.testing.assert_close(dpo_sigmoid_loss(*TRL_PAIRS, beta=0.1, label_smoothing=0.0), plain, **EXACT)
    torch.testing.assert_close(plain, -torch.nn.functional.logsigmoid(0.1 * preference_log_ratio(*TRL_PAIRS)), **EXACT)


@pytest.mark.parametrize(
    ("beta", "label_smoothing", "trl_values"),
    [
        (0.1, 0.0, [0.5936495810217839, 0.8091850189505919, 0.6163437730407396, 0.6302581946816908]),
        (0.5, 0.0, [0.3000584796176435, 1.3873353251154306, 0.37110066594777763, 0.42005533570271575]),
        (0.1, 0.2, [0.6356495810217839, 0.765185018950592, 0.6483437730407396, 0.6562581946816908]),
    ],
)
def test_sigmoid_loss_equals_trl_dpo_trainer(beta, label_smoothing, trl_values):
    # Per-pair values of TRL's formula on TRL_PAIRS, computed once in float64 with plain torch (TRL is no dependency):
    # trl/trainer/dpo_trainer.py, ``DPOTrainer.dpo_loss``, loss_type="sigmoid", at
    # a68fb896f008f58a3d37abf11ae665357b7c679a (label smoothing as cDPO); with label smoothing 0 the same values come
    # from ``DPOTrainer._compute_loss`` at f2cd57710ae345ea6428ae95363267fcf38a3dc8. Here h = 2.1, -2.2, 1.6, 1.3.
    ours = dpo_sigmoid_loss(*TRL_PAIRS, beta=beta, label_smoothing=label_smoothing)
    torch.testing.assert_close(ours, f64(*trl_values), rtol=0.0, atol=1e-12)


def test_dpo_gradient_raises_the_chosen_and_lowers_the_rejected_log_prob():
    # d/d pi_c of -log sigmoid(beta * h) = -beta * sigmoid(-beta * h): at pair 0, -0.5 / (1 + e) = -0.13447071068499755;
    # d/d pi_r is its opposite. So a gradient step raises pi_c and lowers pi_r.
    chosen, rejected = CHOSEN.clone().requires_grad_(), REJECTED.clone().requires_grad_()
    dpo_sigmoid_loss(chosen, rejected, REF_CHOSEN, REF_REJECTED, beta=0.5).sum().backward()
    torch.testing.assert_close(chosen.grad[0], torch.tensor(-0.13447071068499755, dtype=F64), **TIGHT)
    torch.testing.assert_close(rejected.grad, -chosen.grad, **EXACT)
    assert bool((chosen.grad < 0).all())
    # The loss falls as pi_c rises.
    before = dpo_sigmoid_loss(*WORKED, beta=0.5)
    after = dpo_sigmoid_loss(CHOSEN + 0.1, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5)
    assert bool((after < before).all())


def test_label_smoothing_stops_pushing_where_sigmoid_reaches_one_minus_eps():
    # d/dx of (1 - eps) * -log sigmoid(x) + eps * -log sigmoid(-x) = -(1 - eps) * sigmoid(-x) + eps * sigmoid(x),
    # zero where sigmoid(x) = 1 - eps, i.e. x = log((1 - eps) / eps) = log 3 for eps = 0.25; plain DPO never stops.
    # At x = 1 (pair 0, beta = 0.5) the gradient on pi_c is 0.5 * (-0.75 * sigmoid(-1) + 0.25 * sigmoid(1))
    # = -0.009470710684997552.
    chosen = CHOSEN.clone().requires_grad_()
    dpo_sigmoid_loss(chosen, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5, label_smoothing=0.25).sum().backward()
    torch.testing.assert_close(chosen.grad[0], torch.tensor(-0.009470710684997552, dtype=F64), **TIGHT)
    h = f64(math.log(3.0) / 0.5).requires_grad_()
    zero = torch.zeros(1, dtype=F64)
    dpo_sigmoid_loss(h, zero, zero, zero, beta=0.5, label_smoothing=0.25).sum().backward()
    assert abs(h.grad.item()) < 1e-12


# ----------------------------------------------------------------------------- IPO


def test_ipo_loss_by_hand():
    # beta = 0.5: target 1 / (2 * 0.5) = 1; (2 - 1)^2 = 1, (0 - 1)^2 = 1, (-2 - 1)^2 = 9.
    torch.testing.assert_close(ipo_loss(*WORKED, beta=0.5), f64(1.0, 1.0, 9.0), **EXACT)
    # beta = 0.25: target 2, so pair 0 sits at the minimum: 0, 4, 16.
    torch.testing.assert_close(ipo_loss(*WORKED, beta=0.25), f64(0.0, 4.0, 16.0), **EXACT)


@pytest.mark.parametrize("beta", [0.1, 0.25, 0.5, 2.0])
def test_ipo_minimum_is_at_h_equal_one_over_two_beta(beta):
    h = torch.linspace(-10.0, 10.0, 4001, dtype=F64)  # steps of 0.005; every target below is on the grid
    zero = torch.zeros_like(h)
    losses = ipo_loss(h, zero, zero, zero, beta=beta)
    assert h[losses.argmin()].item() == pytest.approx(1.0 / (2.0 * beta), abs=1e-9)
    assert losses.min().item() == pytest.approx(0.0, abs=1e-20)


def test_ipo_gradient_pulls_h_to_its_target_from_both_sides():
    # d/d pi_c of (h - 1/(2 beta))^2 = 2 * (h - target): beta = 0.25 (target 2) gives 2 * (2 - 2) = 0,
    # 2 * (0 - 2) = -4, 2 * (-2 - 2) = -8; beta = 1 (target 0.5) gives +3 at pair 0, past its target: unlike DPO's,
    # IPO's loss rises as pi_c rises there.
    chosen = CHOSEN.clone().requires_grad_()
    ipo_loss(chosen, REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.25).sum().backward()
    torch.testing.assert_close(chosen.grad, f64(0.0, -4.0, -8.0), **EXACT)
    chosen.grad = None
    ipo_loss(chosen, REJECTED, REF_CHOSEN, REF_REJECTED, beta=1.0).sum().backward()
    torch.testing.assert_close(chosen.grad[0], torch.tensor(3.0, dtype=F64), **EXACT)


def test_preference_loss_feeds_ipo_the_mean_log_probs():
    # Chosen: 2 tokens, policy -1, -2 (sum -3, mean -1.5), reference -2, -2 (sum -4, mean -2).
    # Rejected: 4 tokens, policy -3 each (sum -12, mean -3), reference -2 each (sum -8, mean -2).
    # On means h = (-1.5 - -2) - (-3 - -2) = 0.5 + 1 = 1.5; beta = 0.5, target 1: (1.5 - 1)^2 = 0.25.
    # (On sums h = 1 + 4 = 5 and the loss would be 16.)
    mask_c, mask_r = torch.tensor([[True, True, False, False]]), torch.ones(1, 4, dtype=torch.bool)
    chosen = reduce_logprobs(torch.tensor([[-1.0, -2.0, 0.0, 0.0]], dtype=F64), mask_c)
    ref_chosen = reduce_logprobs(torch.tensor([[-2.0, -2.0, 0.0, 0.0]], dtype=F64), mask_c)
    rejected = reduce_logprobs(torch.full((1, 4), -3.0, dtype=F64), mask_r)
    ref_rejected = reduce_logprobs(torch.full((1, 4), -2.0, dtype=F64), mask_r)
    loss = preference_loss(chosen, rejected, ref_chosen, ref_rejected, loss="ipo", beta=0.5)
    torch.testing.assert_close(loss, f64(0.25), **EXACT)
    on_sums = ipo_loss(chosen.total, rejected.total, ref_chosen.total, ref_rejected.total, beta=0.5)
    torch.testing.assert_close(on_sums, f64(16.0), **EXACT)


def test_ipo_equals_trl_dpo_trainer_on_mean_log_probs():
    # TRL's formula on TRL_PAIRS and their lengths, computed once in float64 with plain torch:
    # trl/trainer/dpo_trainer.py, ``DPOTrainer._compute_loss``, loss_type="ipo", at
    # f2cd57710ae345ea6428ae95363267fcf38a3dc8 (each log-ratio divided by its completion length), beta = 0.1.
    trl_values = f64(21.662375510204086, 26.97071111111111, 19.95111111111111, 24.631369)
    sequences = [SequenceLogprob(total, total / n) for total, n in _trl_totals_and_lengths()]
    ours = preference_loss(*sequences, loss="ipo", beta=0.1)
    torch.testing.assert_close(ours, trl_values, rtol=0.0, atol=1e-12)


def _trl_totals_and_lengths():
    return [
        (TRL_CHOSEN, TRL_CHOSEN_LENGTHS),
        (TRL_REJECTED, TRL_REJECTED_LENGTHS),
        (TRL_REF_CHOSEN, TRL_CHOSEN_LENGTHS),
        (TRL_REF_REJECTED, TRL_REJECTED_LENGTHS),
    ]


# ----------------------------------------------------------------------------- SimPO


def test_simpo_loss_by_hand():
    # mean log-probs -1 (chosen) and -2 (rejected), beta = 2: beta * (mean_c - mean_r) = 2.
    #   gamma = 1: -log sigmoid(2 - 1) = log(1 + e^-1) = 0.31326168751822286
    #   gamma = 0: -log sigmoid(2)     = log(1 + e^-2) = 0.1269280110429725
    chosen, rejected = f64(-1.0), f64(-2.0)
    torch.testing.assert_close(simpo_loss(chosen, rejected, beta=2.0, gamma=1.0), f64(0.31326168751822286), **TIGHT)
    torch.testing.assert_close(simpo_loss(chosen, rejected, beta=2.0, gamma=0.0), f64(0.1269280110429725), **TIGHT)


def test_simpo_equals_trl_cpo_trainer_and_reads_no_reference():
    # TRL's formula on the mean log-probs of TRL_CHOSEN and TRL_REJECTED (sum / length), computed once in float64
    # with plain torch: trl/experimental/cpo/cpo_trainer.py, ``CPOTrainer.cpo_loss``, loss_type="simpo",
    # label_smoothing 0, at f2cd57710ae345ea6428ae95363267fcf38a3dc8; beta = 2, simpo_gamma = 0.5.
    trl_values = f64(1.3617228776665513, 0.6459814482806872, 0.9740769841801067, 1.2058650684421957)
    chosen, rejected, _, _ = [SequenceLogprob(total, total / n) for total, n in _trl_totals_and_lengths()]
    ours = preference_loss(chosen, rejected, None, None, loss="simpo", beta=2.0, gamma=0.5)
    torch.testing.assert_close(ours, trl_values, rtol=0.0, atol=1e-12)


def test_simpo_gradient_raises_the_chosen_mean_log_prob():
    # d/d mean_c of -log sigmoid(beta * (mean_c - mean_r) - gamma) = -beta * sigmoid(-1) = -2 / (1 + e) at the
    # worked point above = -0.5378828427399902.
    chosen = f64(-1.0).requires_grad_()
    simpo_loss(chosen, f64(-2.0), beta=2.0, gamma=1.0).sum().backward()
    torch.testing.assert_close(chosen.grad, f64(-0.5378828427399902), **TIGHT)


# ----------------------------------------------------------------------------- dispatch and refusals


def test_preference_loss_feeds_the_sigmoid_loss_the_summed_log_probs():
    means = f64(0.0, 0.0, 0.0)  # never read by the sigmoid loss
    sequences = [SequenceLogprob(total, means) for total in WORKED]
    torch.testing.assert_close(
        preference_loss(*sequences, loss="sigmoid", beta=0.5, label_smoothing=0.25),
        dpo_sigmoid_loss(*WORKED, beta=0.5, label_smoothing=0.25),
        **EXACT,
    )


def test_settings_a_loss_does_not_read_and_bad_inputs_are_refused():
    pair = SequenceLogprob(f64(-1.0), f64(-1.0))
    with pytest.raises(ValueError, match="`loss`"):
        preference_loss(pair, pair, pair, pair, loss="hinge", beta=0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`label_smoothing`"):
        preference_loss(pair, pair, pair, pair, loss="ipo", beta=0.1, label_smoothing=0.1)
    with pytest.raises(ValueError, match="`gamma`"):
        preference_loss(pair, pair, pair, pair, loss="sigmoid", beta=0.1, gamma=0.5)
    with pytest.raises(ValueError, match="reference"):
        preference_loss(pair, pair, None, None, loss="sigmoid", beta=0.1)
    with pytest.raises(ValueError, match="`beta`"):
        dpo_sigmoid_loss(*WORKED, beta=0.0)
    with pytest.raises(ValueError, match="`label_smoothing`"):
        dpo_sigmoid_loss(*WORKED, beta=0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        ipo_loss(CHOSEN, REJECTED[:2], REF_CHOSEN, REF_REJECTED, beta=0.1)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        simpo_loss(CHOSEN[None], REJECTED[None], beta=2.0, gamma=0.5)


# ----------------------------------------------------------------------------- metrics


def test_metrics_by_hand():
    # beta = 0.5; rewards beta * (pi - ref): chosen 0.5, 0, -0.5; rejected -0.5, 0, 0.5.
    # accuracies: 0.5 > -0.5 yes, 0 > 0 no (a tie), -0.5 > 0.5 no: 1/3. margins: 1, 0, -1, mean 0.
    # logps: mean(-3, -2, -5) = -10/3, mean(-6, -7, -4) = -17/3.
    metrics = preference_metrics(*WORKED, beta=0.5)
    expected = {
        "rewards/chosen": 0.0,
        "rewards/rejected": 0.0,
        "rewards/accuracies": 1 / 3,
        "rewards/margins": 0.0,
        "logps/chosen": -10 / 3,
        "logps/rejected": -17 / 3,
    }
    assert list(metrics) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(metrics[name], torch.tensor(value, dtype=F64), **TIGHT)


def test_metrics_equal_trl_dpo_trainer():
    # TRL's logged means on TRL_PAIRS, beta = 0.1, computed once in float64 with plain torch:
    # trl/trainer/dpo_trainer.py, ``DPOTrainer._compute_loss`` (its ``_metrics``), at
    # f2cd57710ae345ea6428ae95363267fcf38a3dc8.
    trl_values = {
        "rewards/chosen": -0.02624999999999994,
        "rewards/rejected": -0.09624999999999985,
        "rewards/accuracies": 0.75,
        "rewards/margins": 0.06999999999999991,
        "logps/chosen": -26.5625,
        "logps/rejected": -29.0875,
    }
    chosen = TRL_CHOSEN.clone().requires_grad_()
    metrics = preference_metrics(chosen, *TRL_PAIRS[1:], beta=0.1)
    for name, value in trl_values.items():
        assert not metrics[name].requires_grad
        torch.testing.assert_close(metrics[name], torch.tensor(value, dtype=F64), rtol=0.0, atol=1e-12)


def test_reference_free_metrics_are_beta_times_the_log_probs():
    # SimPO's reward beta * mean log-prob, beta = 2: chosen -2, rejected -4, margin 2, accuracy 1.
    metrics = preference_metrics(f64(-1.0), f64(-2.0), None, None, beta=2.0)
    assert {name: value.item() for name, value in metrics.items()} == {
        "rewards/chosen": -2.0,
        "rewards/rejected": -4.0,
        "rewards/accuracies": 1.0,
        "rewards/margins": 2.0,
        "logps/chosen": -1.0,
        "logps/rejected": -2.0,
    }
    with pytest.raises(ValueError, match="both responses"):
        preference_metrics(f64(-1.0), f64(-2.0), f64(-1.0), None, beta=2.0)
