"""Fixed and adaptive KL controllers (Ziegler et al. 2019): hand values."""

from __future__ import annotations

import pytest

from rlhf_core.kl_control import AdaptiveKLController, FixedKLController


def test_fixed_controller_never_moves():
    controller = FixedKLController(value=0.05)
    for kl in (0.0, 1.0, 100.0):
        assert controller.update(kl, n_steps=256) == 0.05
    assert controller.value == 0.05


@pytest.mark.parametrize(
    ("current_kl", "expected"),
    [
        # e = clip(kl / 6 - 1, -0.2, 0.2); value <- 0.1 * (1 + e * 256 / 10000)
        (6.0, 0.1),  # on target: e = 0
        (6.6, 0.1 * (1 + 0.1 * 0.0256)),  # e = 0.1            -> 0.100256
        (9.0, 0.1 * (1 + 0.2 * 0.0256)),  # e = 0.5, clipped to 0.2 -> 0.100512
        (5.4, 0.1 * (1 - 0.1 * 0.0256)),  # e = -0.1           -> 0.099744
        (0.0, 0.1 * (1 - 0.2 * 0.0256)),  # e = -1, clipped to -0.2 -> 0.099488
    ],
)
def test_adaptive_controller_one_update_by_hand(current_kl, expected):
    controller = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    assert controller.update(current_kl, n_steps=256) == pytest.approx(expected, rel=1e-12)
    assert controller.value == pytest.approx(expected, rel=1e-12)


def test_adaptive_controller_compounds_over_updates():
    # Two updates far above target: 0.1 * 1.00512^2.
    controller = AdaptiveKLController(value=0.1, target=1.0, horizon=10000)
    controller.update(50.0, n_steps=256)
    assert controller.update(50.0, n_steps=256) == pytest.approx(0.1 * 1.00512**2, rel=1e-12)


def test_adaptive_controller_steers_toward_the_target():
    controller = AdaptiveKLController(value=0.1, target=6.0, horizon=1000)
    assert controller.update(12.0, n_steps=100) > 0.1
    lowered = AdaptiveKLController(value=0.1, target=6.0, horizon=1000)
    assert lowered.update(1.0, n_steps=100) < 0.1


@pytest.mark.parametrize(("target", "horizon"), [(0.0, 100), (-1.0, 100), (6.0, 0), (6.0, -5)])
def test_adaptive_controller_rejects_non_positive_target_or_horizon(target, horizon):
    with pytest.raises(ValueError, match="`target` and `horizon` must be positive"):
        AdaptiveKLController(value=0.1, target=target, horizon=horizon)
