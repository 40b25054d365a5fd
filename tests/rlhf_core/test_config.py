"""Stage configs: every __post_init__ check raises with a message naming the field; NaN and infinity are
refused in every numeric field; exact_div; frozen."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlhf_core.config import (
    AdvantageConfig,
    Bounds,
    PPOConfig,
    RewardModelConfig,
    SamplingConfig,
    SettingError,
    exact_div,
    field_bounds,
)

CLASSES = [SamplingConfig, RewardModelConfig, AdvantageConfig, PPOConfig]

INVALID = [
    # (config class, field, bad value)
    (SamplingConfig, "max_new_tokens", 0),
    (SamplingConfig, "temperature", 0.0),
    (SamplingConfig, "temperature", -1.0),
    (SamplingConfig, "batch_size", 0),
    (SamplingConfig, "top_k", -1),
    (SamplingConfig, "top_p", 0.0),
    (SamplingConfig, "top_p", 1.5),
    (RewardModelConfig, "learning_rate", 0.0),
    (RewardModelConfig, "epochs", 0),
    (RewardModelConfig, "batch_size", -2),
    (RewardModelConfig, "max_grad_norm", 0.0),
    (RewardModelConfig, "weight_decay", -0.01),
    (RewardModelConfig, "eval_fraction", 0.0),
    (RewardModelConfig, "eval_fraction", 1.0),
    (AdvantageConfig, "kl_coef", -0.1),
    (AdvantageConfig, "kl_estimator", "k4"),
    (AdvantageConfig, "gamma", 1.1),
    (AdvantageConfig, "gamma", -0.1),
    (AdvantageConfig, "gae_lambda", 1.5),
    (AdvantageConfig, "gae_lambda", -0.5),
    (AdvantageConfig, "score_clip", 0.0),
    (AdvantageConfig, "estimator", "ppo"),
    (AdvantageConfig, "kl_in", "both"),
    (AdvantageConfig, "kl_target", 0.0),
    (AdvantageConfig, "kl_horizon", 0),
    (PPOConfig, "epochs", 0),
    (PPOConfig, "minibatch_size", 0),
    (PPOConfig, "actor_learning_rate", 0.0),
    (PPOConfig, "critic_learning_rate", -1e-5),
    (PPOConfig, "clip_eps", 0.0),
    (PPOConfig, "max_grad_norm", 0.0),
    (PPOConfig, "dual_clip", 1.0),
    (PPOConfig, "dual_clip", 0.5),
    (PPOConfig, "value_clip_eps", 0.0),
    (PPOConfig, "target_kl", 0.0),
    (PPOConfig, "entropy_coef", -0.01),
    (PPOConfig, "aggregation", "sum"),
    (PPOConfig, "kl_loss_coef", -0.01),
]


@pytest.mark.parametrize(("cls", "field", "value"), INVALID, ids=lambda item: getattr(item, "__name__", str(item)))
def test_each_check_raises_with_a_message_naming_the_field(cls, field, value):
    with pytest.raises(ValueError, match=f"`{field}`"):
        cls(**{field: value})


NUMERIC_FIELDS = [
    (cls, f.name) for cls in CLASSES for f in dataclasses.fields(cls) if "float" in f.type or "int" in f.type
]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(("cls", "field"), NUMERIC_FIELDS, ids=lambda item: getattr(item, "__name__", str(item)))
def test_issue14_nan_and_infinity_are_refused_in_every_numeric_field(cls, field, value):
    with pytest.raises(SettingError, match=f"`{field}` must be a finite number") as caught:
        cls(**{field: value})
    assert caught.value.field == field


def test_bounds_are_declared_with_the_field_and_read_back():
    assert field_bounds(SamplingConfig)["top_p"] == Bounds(gt=0, le=1)
    assert str(Bounds(gt=0, le=1)) == "> 0 and <= 1"
    assert "temperature" in field_bounds(SamplingConfig) and "aggregation" not in field_bounds(PPOConfig)
    with pytest.raises(SettingError, match=r"`top_p` must be > 0 and <= 1, got 1.5"):
        SamplingConfig(top_p=1.5)


@pytest.mark.parametrize("cls", CLASSES)
def test_defaults_are_valid_frozen_and_keyword_only(cls):
    config = cls()
    first_field = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, first_field, getattr(config, first_field))
    with pytest.raises(TypeError):
        cls(getattr(config, first_field))


def test_boundary_values_are_accepted():
    SamplingConfig(top_p=1.0, top_k=0)
    AdvantageConfig(kl_coef=0.0, gamma=0.0, gae_lambda=1.0, score_clip=None)
    AdvantageConfig(gamma=1.0, gae_lambda=0.0, score_clip=5.0)
    PPOConfig(dual_clip=None, value_clip_eps=None, target_kl=None, aggregation="sequence_mean")
    PPOConfig(dual_clip=1.5)
    PPOConfig(aggregation="token_sum_norm", kl_loss_coef=0.0)
    for estimator in ("k1", "k2", "k3"):
        AdvantageConfig(kl_estimator=estimator)


def test_the_adaptive_controller_needs_the_kl_in_the_reward():
    with pytest.raises(ValueError, match="`kl_target`.*`kl_in`"):
        AdvantageConfig(kl_target=3.0, kl_in="loss")
    assert AdvantageConfig(kl_in="loss", kl_coef=0.3).reward_kl_coef == 0.0
    assert AdvantageConfig(kl_coef=0.3).reward_kl_coef == 0.3


@pytest.mark.parametrize("estimator", ["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_only_gae_uses_a_critic(estimator):
    assert AdvantageConfig(estimator=estimator).uses_critic == (estimator == "gae")


def test_replace_revalidates():
    with pytest.raises(ValueError, match="`clip_eps`"):
        dataclasses.replace(PPOConfig(), clip_eps=-0.2)


def test_exact_div():
    assert exact_div(12, 4, what="minibatches") == 3
    assert exact_div(0, 5, what="minibatches") == 0
    with pytest.raises(ValueError, match="`minibatch_size` must divide: 4 must divide 10"):
        exact_div(10, 4, what="`minibatch_size` must divide")
    for denominator in (0, -2):
        with pytest.raises(ValueError, match="rows"):
            exact_div(8, denominator, what="rows")


def test_issue43_held_out_pairs_by_hand_one_as_soon_as_there_is_a_pair_and_a_pair_to_train_on_needed():
    from rlhf_core.config import eval_split_error, held_out_pairs, held_out_positions

    assert held_out_pairs(16, 0.25) == 4 and held_out_pairs(16, 0.2) == 4  # ceil(3.2)
    assert held_out_pairs(10, 0.1) == 1 and held_out_pairs(30, 0.1) == 3  # 1/10 exactly: the float 0.1 is above it
    assert held_out_pairs(1, 0.25) == 1 and held_out_pairs(0, 0.25) == 0
    # Position g is held out when one more pair raises ceil(n / 4): the 1st, 5th, 9th, ...
    assert held_out_positions(9, 0.25) == [True, False, False, False, True, False, False, False, True]
    assert eval_split_error(4, 0.25) is None  # 1 held out, 3 to train on: the sparse first iteration runs
    assert eval_split_error(2, 0.25) is None  # 1 and 1
    assert "holds out 1 and leaves 0 to train on" in eval_split_error(1, 0.25)
    assert "holds out 0 and leaves 0" in eval_split_error(0, 0.25)
    assert "lower `reward_model.eval_fraction`" in eval_split_error(4, 0.9)  # ceil(3.6) = 4: none left


@given(st.integers(0, 40), st.integers(0, 40), st.sampled_from([0.1, 0.2, 0.25, 0.3, 1 / 3, 0.5, 0.7]))
def test_issue43_the_held_out_positions_of_the_first_pairs_never_change_as_pairs_are_added(first, more, fraction):
    from rlhf_core.config import held_out_pairs, held_out_positions

    positions = held_out_positions(first + more, fraction)
    assert positions[:first] == held_out_positions(first, fraction)
    assert sum(positions) == held_out_pairs(first + more, fraction)
