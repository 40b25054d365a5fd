"""Experience: shape validation, immutability, selection, minibatches and devices."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlhf_core.experience import SCORED_FIELDS, TOKEN_FIELDS, Experience
from tests.conftest import PAD


def make_experience(
    batch: int = 3, prompt: int = 2, response: int = 4, *, scored: bool = True, seed: int = 0
) -> Experience:
    """Random but well-formed rows; row ``i`` has ``scores[i] == i`` so rows can be traced."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, response + 1, (batch,), generator=generator)
    action_mask = torch.arange(response)[None, :] < lengths[:, None]  # (B, R)
    prompt_mask = torch.ones(batch, prompt, dtype=torch.long)
    prompt_mask[0, 0] = 0  # row 0 has a left-padded prompt
    sequences = torch.randint(3, 30, (batch, prompt + response), generator=generator)
    sequences[:, prompt:][~action_mask] = PAD
    sequences[0, 0] = PAD
    fields = dict(
        sequences=sequences,
        attention_mask=torch.cat([prompt_mask, action_mask.long()], dim=1),
        action_mask=action_mask,
        scores=torch.arange(batch, dtype=torch.float32),
    )
    names = TOKEN_FIELDS + (SCORED_FIELDS if scored else ())
    fields.update({name: torch.randn(batch, response, generator=generator) * action_mask for name in names})
    return Experience(**fields)


def test_a_well_formed_experience_validates():
    experience = make_experience()
    assert experience.batch_size == 3 and experience.prompt_length == 2 and experience.response_length == 4
    assert experience.is_scored and not make_experience(scored=False).is_scored


@pytest.mark.parametrize(
    "name", ["attention_mask", "old_logprobs", "ref_logprobs", "old_values", "scores", *SCORED_FIELDS]
)
@pytest.mark.parametrize("wrong", ["batch", "length"])
def test_validate_catches_each_shape_mismatch_and_names_the_field(name, wrong):
    experience = make_experience()
    value = getattr(experience, name)
    if wrong == "batch":
        bad = torch.cat([value, value[:1]])
    elif value.dim() == 1:
        bad = value[:, None]
    else:
        bad = torch.cat([value, value[:, :1]], dim=1)
    with pytest.raises(ValueError, match=f"`{name}` must have shape"):
        experience.replace(**{name: bad})


def test_an_experience_cannot_be_changed_in_place():
    experience = make_experience()
    with pytest.raises(dataclasses.FrozenInstanceError):
        experience.scores = torch.zeros(3)


def test_validate_catches_action_mask_errors():
    experience = make_experience()
    with pytest.raises(ValueError, match="`action_mask` must have shape"):
        experience.replace(action_mask=torch.cat([experience.action_mask, experience.action_mask[:1]]))
    with pytest.raises(ValueError, match="`action_mask` must be bool"):
        experience.replace(action_mask=experience.action_mask.long())
    with pytest.raises(ValueError, match="`action_mask` length 6 must be shorter than `sequences` length 6"):
        experience.replace(
            action_mask=torch.ones(3, 6, dtype=torch.bool), **{name: torch.zeros(3, 6) for name in TOKEN_FIELDS}
        )
    with pytest.raises(ValueError, match="must be 2-D"):
        experience.replace(sequences=experience.sequences.flatten())


def test_scored_fields_must_be_set_together():
    experience = make_experience(scored=False)
    with pytest.raises(ValueError, match="must be set together"):
        experience.replace(rewards=torch.zeros(3, 4))


def test_select_keeps_the_given_rows_in_order():
    experience = make_experience(batch=5)
    chosen = experience.select(torch.tensor([3, 0]))
    assert chosen.scores.tolist() == [3.0, 0.0]
    for name in ("sequences", "attention_mask", "action_mask", *TOKEN_FIELDS, *SCORED_FIELDS):
        assert torch.equal(getattr(chosen, name), getattr(experience, name)[[3, 0]]), name
    assert make_experience(scored=False).select(torch.tensor([1])).rewards is None


def test_replace_returns_a_new_validated_experience():
    experience = make_experience()
    new_values = torch.zeros(3, 4)
    replaced = experience.replace(old_values=new_values)
    assert replaced is not experience and replaced.old_values is new_values
    assert not torch.equal(experience.old_values, new_values)


@pytest.mark.parametrize(("batch", "size"), [(5, 2), (6, 3), (4, 4), (3, 10)])
def test_minibatches_cover_every_row_exactly_once(batch, size):
    experience = make_experience(batch=batch)
    parts = list(experience.minibatches(size, generator=torch.Generator().manual_seed(0)))
    sizes = [part.batch_size for part in parts]
    assert sizes == [min(size, batch - start) for start in range(0, batch, size)]
    rows = torch.cat([part.scores for part in parts]).long()
    assert sorted(rows.tolist()) == list(range(batch))
    for part in parts:  # each row travels with all of its fields
        for row, index in enumerate(part.scores.long()):
            assert torch.equal(part.sequences[row], experience.sequences[index])
            assert torch.equal(part.advantages[row], experience.advantages[index])


def test_minibatches_shuffle_reproducibly_from_the_generator():
    experience = make_experience(batch=8)

    def order(seed):
        parts = experience.minibatches(3, generator=torch.Generator().manual_seed(seed))
        return torch.cat([part.scores for part in parts]).tolist()

    assert order(0) == order(0)
    assert order(0) != order(1) or order(0) != order(2)
    with pytest.raises(ValueError, match="`size` must be positive"):
        next(experience.minibatches(0))


def test_to_returns_a_new_experience_on_the_device():
    experience = make_experience()
    moved = experience.to("meta")
    for name in ("sequences", "attention_mask", "action_mask", "scores", *TOKEN_FIELDS, *SCORED_FIELDS):
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(experience, name).device.type == "cpu", name
    unscored = make_experience(scored=False)
    assert unscored.to("cpu") is unscored and unscored.to("meta").rewards is None
