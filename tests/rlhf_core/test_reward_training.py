"""Reward-model training: batch validation, held-out statistics by hand, margin use, parameters move."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from rlhf_core.config import RewardModelConfig
from rlhf_core.models import RewardModel
from rlhf_core.reward_training import (
    PreferenceBatch,
    arrival_split,
    evaluate_reward_model,
    fit_reward_model,
    replayed_rows,
)
from runtime.models import accelerator_for
from tests.conftest import tiny_config


class FirstTokenScore(nn.Module):
    """A stand-in reward model: the score is the first token id, as a float. Shapes: returns (B,)."""

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return ids[:, 0].float()


def pairs(chosen_first: list[int], rejected_first: list[int], *, margin: list[float] | None = None) -> PreferenceBatch:
    chosen = torch.tensor(chosen_first)[:, None].repeat(1, 3)
    rejected = torch.tensor(rejected_first)[:, None].repeat(1, 3)
    ones = torch.ones_like(chosen)
    margins = torch.zeros(len(chosen_first)) if margin is None else torch.tensor(margin)
    return PreferenceBatch(chosen, ones, rejected, ones, margins)


def test_preference_batch_validates_shapes_and_selects_rows():
    batch = pairs([5, 6, 7], [1, 2, 3], margin=[0.0, 1.0, 2.0])
    assert len(batch) == 3
    picked = batch.select(torch.tensor([2, 0]))
    assert picked.chosen_ids[:, 0].tolist() == [7, 5] and picked.margin.tolist() == [2.0, 0.0]
    with pytest.raises(ValueError, match="`rejected_ids` must have shape"):
        PreferenceBatch(batch.chosen_ids, batch.chosen_mask, batch.rejected_ids[:2], batch.rejected_mask, batch.margin)
    with pytest.raises(ValueError, match="`margin` must have shape"):
        PreferenceBatch(batch.chosen_ids, batch.chosen_mask, batch.rejected_ids, batch.rejected_mask, torch.zeros(2))


@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_held_out_statistics_by_hand(batch_size):
    # chosen scores 3, 1, 2; rejected 1, 2, 2 (the stand-in reads the first token).
    #   gaps 2, -1, 0 -> loss = (log(1 + e^-2) + log(1 + e) + log 2) / 3; accuracy 1/3
    #   all six scores 3, 1, 2, 1, 2, 2: mean 11/6, unbiased std sqrt(((7/6)^2 + 2 (5/6)^2 + 3 (1/6)^2) / 5)
    loss, accuracy, mean, std = evaluate_reward_model(
        FirstTokenScore(), pairs([3, 1, 2], [1, 2, 2]), batch_size=batch_size
    )
    assert loss == pytest.approx((math.log1p(math.exp(-2)) + math.log1p(math.e) + math.log(2)) / 3, rel=1e-6)
    assert accuracy == pytest.approx(1 / 3)
    assert mean == pytest.approx(11 / 6)
    assert std == pytest.approx(math.sqrt(((7 / 6) ** 2 + 2 * (5 / 6) ** 2 + 3 * (1 / 6) ** 2) / 5), rel=1e-6)


def make_model_and_pairs(seed: int = 0):
    torch.manual_seed(seed)
    model = RewardModel(config=tiny_config("gpt2"))
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 30, (8, 5), generator=generator)
    other = torch.randint(3, 30, (8, 5), generator=generator)
    ones = torch.ones_like(ids)
    return model, PreferenceBatch(ids, ones, other, ones, torch.full((8,), 3.0))


@pytest.mark.parametrize("use_margin", [True, False])
def test_fit_moves_every_parameter_and_counts_steps(use_margin):
    accelerator = accelerator_for(torch.device("cpu"), "fp32")
    model, train = make_model_and_pairs()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    before = {name: value.detach().clone() for name, value in model.named_parameters()}
    config = RewardModelConfig(epochs=2, batch_size=3, use_margin=use_margin)
    stats = fit_reward_model(
        model, optimizer, train, train.select(torch.arange(4)), config,
        accelerator=accelerator, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert stats.optimizer_steps == 2 * 3  # ceil(8 / 3) = 3 steps per epoch
    assert [name for name, value in model.named_parameters() if torch.equal(value, before[name])] == []
    assert all(math.isfinite(value) for value in stats[:-1])
    # A margin of 3 at near-equal initial scores costs about -log sigmoid(-3) = 3.05 per pair, far above log 2.
    assert (stats.train_loss > 2.5) == use_margin


def test_issue43_a_tables_pairs_are_split_alike_by_every_later_iteration_and_none_held_out_is_trained_on():
    # Iteration 0's table of 4 pairs, then iteration 1's of 6: with 0.25, 1 of the first 4 is held out, then
    # ceil(10 / 4) = 3 of all 10; iteration 0's held-out pair is still held out, its training pairs still train.
    first_train, first_held = arrival_split([4], [11], 0.25)
    train, held = arrival_split([4, 6], [11, 22], 0.25)
    assert len(first_held) == 1 and len(held) == 3 and len(train) == 7
    assert set(first_held.tolist()) <= set(held.tolist())
    assert set(first_train.tolist()) <= set(train.tolist())
    assert sorted(train.tolist() + held.tolist()) == list(range(10))
    assert arrival_split([4, 6], [11, 22], 0.25)[1].tolist() == held.tolist()  # the seeds decide, nothing else
    assert [len(part) for part in arrival_split([], [], 0.25)] == [0, 0]


def test_issue43_a_table_of_pairs_asked_by_margin_holds_out_its_random_head_and_leaves_the_others_split_as_before():
    # Tables: iteration 0's 4 pairs (every compared pair asked), iteration 1's 6 asked by margin, its first 2 drawn
    # at random to be held out. Iteration 0's split is the one it had alone; iteration 1 holds out rows 4 and 5
    # (its head) and trains on rows 6-9, whatever its seed.
    alone_train, alone_held = arrival_split([4], [11], 0.25)
    train, held = arrival_split([4, 6], [11, 22], 0.25, held_out_heads=[None, 2])
    assert held.tolist() == [*alone_held.tolist(), 4, 5]
    assert train.tolist() == [*alone_train.tolist(), 6, 7, 8, 9]
    assert arrival_split([4, 6], [11, 99], 0.25, held_out_heads=[None, 2])[1].tolist() == held.tolist()
    # Without heads (or with None for every table) the split is today's, to the row.
    for a, b in zip(
        arrival_split([4, 6], [11, 22], 0.25, held_out_heads=[None, None]),
        arrival_split([4, 6], [11, 22], 0.25),
        strict=True,
    ):
        assert a.tolist() == b.tolist()


def test_issue43_a_continuing_reward_model_trains_on_the_new_pairs_and_a_replay_of_older_ones():
    # Rows 0-9 from earlier iterations, 10-13 new: ratio 0.5 replays round(0.5 x 4) = 2 older rows, ratio 10 all 10.
    train = torch.tensor([0, 2, 3, 5, 6, 7, 8, 9, 11, 1, 4, 10, 12, 13])
    rows = replayed_rows(train, new_from=10, ratio=0.5, generator=torch.Generator().manual_seed(0))
    assert rows[:4].tolist() == [11, 10, 12, 13] and len(rows) == 6
    assert set(rows[4:].tolist()) <= set(range(10)) and len(set(rows.tolist())) == 6  # drawn without replacement
    everything = replayed_rows(train, new_from=10, ratio=10.0, generator=torch.Generator().manual_seed(0))
    assert sorted(everything.tolist()) == sorted(train.tolist())
    assert replayed_rows(train, new_from=10, ratio=0.0, generator=torch.Generator()).tolist() == [11, 10, 12, 13]
    again = replayed_rows(train, new_from=10, ratio=0.5, generator=torch.Generator().manual_seed(0))
    assert again.tolist() == rows.tolist()  # the stage's generator decides, nothing else


def test_fit_needs_training_and_held_out_pairs():
    accelerator = accelerator_for(torch.device("cpu"), "fp32")
    model, train = make_model_and_pairs()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    empty = train.select(torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="need training and held-out pairs"):
        fit_reward_model(model, optimizer, train, empty, RewardModelConfig(), accelerator=accelerator)


def test_resuming_after_an_epoch_gives_exactly_the_uninterrupted_training():
    """With dropout on, so the global RNG matters as much as the shuffling stream."""
    accelerator = accelerator_for(torch.device("cpu"), "fp32")
    config = RewardModelConfig(epochs=3, batch_size=3)

    def fresh(seed: int = 0):
        model, train = make_model_and_pairs(seed)
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.2
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        return (*accelerator.prepare(model, optimizer), train)

    model, optimizer, train = fresh()
    torch.manual_seed(7)
    expected = fit_reward_model(
        model, optimizer, train, train, config, accelerator=accelerator, generator=torch.Generator().manual_seed(0)
    )
    expected_parameters = [value.detach().clone() for value in model.parameters()]

    crashed, crashed_optimizer, train = fresh()
    generator = torch.Generator().manual_seed(0)
    snapshot = {}

    def save(progress):
        if progress.epochs_done == 1:
            snapshot.update(
                progress=progress,
                model=copy.deepcopy(crashed.state_dict()),
                optimizer=copy.deepcopy(crashed_optimizer.state_dict()),
                generator=generator.get_state(),
                rng=torch.get_rng_state(),
            )

    torch.manual_seed(7)
    fit_reward_model(
        crashed,
        crashed_optimizer,
        train,
        train,
        config,
        accelerator=accelerator,
        generator=generator,
        on_epoch_end=save,
    )

    resumed, resumed_optimizer, _ = fresh(seed=1)  # different initial weights: everything comes from the snapshot
    resumed.load_state_dict(snapshot["model"])
    resumed_optimizer.load_state_dict(snapshot["optimizer"])
    resumed_generator = torch.Generator()
    resumed_generator.set_state(snapshot["generator"])
    torch.set_rng_state(snapshot["rng"])
    stats = fit_reward_model(
        resumed, resumed_optimizer, train, train, config,
        accelerator=accelerator, generator=resumed_generator, resume=snapshot["progress"],
    )  # fmt: skip
    assert stats == expected
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), expected_parameters, strict=True))
