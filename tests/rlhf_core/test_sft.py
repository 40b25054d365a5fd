"""Supervised fine-tuning: the loss pinned by hand on a tiny example (the mean over the assistant's tokens of the
whole batch), padding and prompt tokens changing nothing, an update that moves every parameter and lowers the loss, and
a resume after any optimizer step (mid-epoch) that ends where the uninterrupted run does, packed or not; packing that
changes the padding (hand-worked shares) but not the run (tests/rlhf_core/test_packing.py pins the maths)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rlhf_core.config import SFTConfig
from rlhf_core.sft import SFTExamples, SFTProgress, example_loss, padding_share, sft_loss, sft_update
from runtime.models import accelerator_for
from tests.conftest import tiny_causal_lm

NAN = float("nan")
LN3 = math.log(3)


def hand_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of 3 tokens over a vocabulary of 2; the logits at column t score the token at t + 1.

    Row 0, ids [0, 1, 0], learned at columns 1 and 2:
        column 0 logits [0, ln 3] -> p(1) = 3/4 -> nll ln(4/3);
        column 1 logits [0, 0]    -> p(0) = 1/2 -> nll ln 2;
        column 2 scores nothing (the last column): nan.
    Row 1, ids [1, 1, 1], learned at column 2 only (columns 0-1 are its prompt):
        column 0 scores a prompt token: nan, which must not leak;
        column 1 logits [ln 3, 0] -> p(1) = 1/4 -> nll ln 4.
    """
    logits = torch.tensor(
        [
            [[0.0, LN3], [0.0, 0.0], [NAN, NAN]],
            [[NAN, NAN], [LN3, 0.0], [NAN, NAN]],
        ]
    )  # (B=2, T=3, V=2)
    input_ids = torch.tensor([[0, 1, 0], [1, 1, 1]])
    loss_mask = torch.tensor([[False, True, True], [False, False, True]])
    return logits, input_ids, loss_mask


def test_the_loss_is_the_mean_over_the_batchs_assistant_tokens_by_hand():
    logits, input_ids, loss_mask = hand_example()
    # Row 0 alone: (ln(4/3) + ln 2) / 2 = ln(8/3) / 2.
    row0 = sft_loss(logits[:1], input_ids[:1], loss_mask[:1])
    torch.testing.assert_close(row0, torch.tensor(math.log(8 / 3) / 2), rtol=0, atol=1e-6)
    # Both rows: the three tokens' mean, (ln(4/3) + ln 2 + ln 4) / 3 = ln(32/3) / 3 ~ 0.789, not the mean of the two
    # rows' means ((ln(8/3)/2 + ln 4) / 2 ~ 0.938).
    both = sft_loss(logits, input_ids, loss_mask)
    torch.testing.assert_close(both, torch.tensor(math.log(32 / 3) / 3), rtol=0, atol=1e-6)
    # A share of a minibatch divides by the whole minibatch's tokens.
    torch.testing.assert_close(
        sft_loss(logits, input_ids, loss_mask, tokens=6), torch.tensor(math.log(32 / 3) / 6), rtol=0, atol=1e-6
    )


def test_padding_changes_nothing():
    """Columns of padding (any ids, nan logits, mask off) after a row leave the loss as it was, to the bit."""
    logits, input_ids, loss_mask = hand_example()
    padded_logits = torch.cat([logits, torch.full((2, 4, 2), NAN)], dim=1)  # (2, 7, 2)
    padded_ids = torch.cat([input_ids, torch.randint(0, 2, (2, 4))], dim=1)
    padded_mask = torch.cat([loss_mask, torch.zeros(2, 4, dtype=torch.bool)], dim=1)
    assert torch.equal(sft_loss(padded_logits, padded_ids, padded_mask), sft_loss(logits, input_ids, loss_mask))


def test_no_token_to_learn_is_refused():
    logits, input_ids, _ = hand_example()
    with pytest.raises(ValueError, match="no assistant token"):
        sft_loss(logits, input_ids, torch.zeros_like(input_ids, dtype=torch.bool))


def _rows(count: int = 6, seed: int = 0) -> list[tuple[list[int], list[bool]]]:
    """``count`` rows of random tokens: a prompt of 2-4 tokens, then 1-4 learned tokens."""
    generator = torch.Generator().manual_seed(seed)

    def length(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    rows = []
    for _ in range(count):
        prompt, answer = length(2, 4), length(1, 4)
        ids = torch.randint(3, 30, (prompt + answer,), generator=generator).tolist()
        rows.append((ids, [False] * prompt + [True] * answer))
    return rows


def test_a_model_batch_padded_equals_its_rows_alone():
    """Under a real model, right-padding a row to the batch's width changes none of its assistant tokens' losses: the
    batch's loss is the token-weighted mean of its rows' losses, each computed unpadded."""
    model = tiny_causal_lm("gpt2").eval()
    rows = _rows()
    batch = SFTExamples.of(rows, pad_token_id=0)
    with torch.no_grad():
        together = example_loss(model, batch)
        alone = [example_loss(model, SFTExamples.of([row], pad_token_id=0)) for row in rows]
    tokens = [sum(mask[1:]) for _, mask in rows]
    expected = sum(loss * count for loss, count in zip(alone, tokens, strict=True)) / sum(tokens)
    torch.testing.assert_close(together, expected, rtol=1e-5, atol=1e-6)


def _training(config: SFTConfig):
    accelerator = accelerator_for(torch.device("cpu"), "fp32")
    model = tiny_causal_lm("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer, SFTExamples.of(_rows(), pad_token_id=0)


def test_an_update_moves_every_parameter_and_lowers_the_loss():
    config = SFTConfig(epochs=4, batch_size=4, learning_rate=1e-2)
    accelerator, model, optimizer, examples = _training(config)
    before = {name: value.detach().clone() for name, value in model.named_parameters()}
    with torch.no_grad():
        start = example_loss(model.eval(), examples).item()
    stats = sft_update(model, optimizer, examples, config, accelerator=accelerator, seed=0)
    assert stats.optimizer_steps == 4 * 2  # ceil(6 / 4) = 2 steps per epoch
    assert [name for name, value in model.named_parameters() if torch.equal(value, before[name])] == []
    with torch.no_grad():
        assert example_loss(model.eval(), examples).item() < start


@pytest.mark.parametrize("packing", [False, True])
def test_resuming_mid_epoch_gives_exactly_the_uninterrupted_run(packing):
    """Stopped after step 3 of 3 epochs of 2 steps (in the middle of epoch 2), continued from what was saved there."""
    config = SFTConfig(
        epochs=3, batch_size=4, learning_rate=1e-2, packing=packing, packed_length=16 if packing else None
    )
    accelerator, model, optimizer, examples = _training(config)
    expected = sft_update(model, optimizer, examples, config, accelerator=accelerator, seed=7)

    accelerator, crashed, crashed_optimizer, examples = _training(config)
    snapshot = {}

    def save(progress: SFTProgress) -> None:
        if progress.steps_done == 3:
            snapshot.update(
                progress=progress, model=copy.deepcopy(crashed.state_dict()),
                optimizer=copy.deepcopy(crashed_optimizer.state_dict()),
            )  # fmt: skip

    sft_update(crashed, crashed_optimizer, examples, config, accelerator=accelerator, seed=7, on_step_end=save)
    accelerator, resumed, resumed_optimizer, examples = _training(config)
    resumed.load_state_dict(snapshot["model"])
    resumed_optimizer.load_state_dict(snapshot["optimizer"])
    stats = sft_update(
        resumed, resumed_optimizer, examples, config, accelerator=accelerator, seed=7, resume=snapshot["progress"]
    )
    assert stats == expected
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), model.parameters(), strict=True))


def test_padding_share_by_hand():
    """One minibatch of 4 examples of 4, 1, 3 and 2 tokens (10 tokens). Padded to the longest: 16 cells, 6 of padding.
    Packed into rows of the longest example (4): [4], [3, 1], [2]: 12 cells, 2 of padding. Into rows of up to 8:
    [4, 1], [3, 2]: 10 cells, none."""
    rows = [([5] * n, [False] + [True] * (n - 1)) for n in (4, 1, 3, 2)]
    examples = SFTExamples.of(rows, pad_token_id=0)
    assert padding_share(examples, SFTConfig(batch_size=4, epochs=1), seed=0) == 6 / 16
    assert padding_share(examples, SFTConfig(batch_size=4, epochs=1, packing=True), seed=0) == 2 / 12
    assert padding_share(examples, SFTConfig(batch_size=4, epochs=1, packing=True, packed_length=8), seed=0) == 0
    # Four processes, an example each: no padding either way.
    for packing in (False, True):
        assert padding_share(examples, SFTConfig(batch_size=4, epochs=1, packing=packing), seed=0, world=4) == 0


def test_a_packed_run_is_the_padded_run_to_rounding():
    """The same steps and losses, 3 epochs of 2 steps on a real tiny GPT-2, packed into rows of the longest example or
    not (each step's loss depends on every earlier step's weights)."""
    losses = {}
    for packing in (False, True):
        config = SFTConfig(epochs=3, batch_size=4, learning_rate=1e-2, packing=packing)
        accelerator, model, optimizer, examples = _training(config)
        steps = losses[packing] = []
        stats = sft_update(
            model, optimizer, examples, config, accelerator=accelerator, seed=7,
            on_step=lambda step, metrics, steps=steps: steps.append(metrics["loss"]),
        )  # fmt: skip
        assert stats.optimizer_steps == len(steps) == 6
    assert padding_share(examples, config, seed=7) < padding_share(examples, SFTConfig(epochs=3, batch_size=4), seed=7)
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)
