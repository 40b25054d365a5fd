"""Experience: shape validation, selection, minibatches, devices and re-padding concatenation."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.experience import Experience, concat_experience
from rlhf_core.experience_maker import reference_logprobs
from tests.conftest import PAD, left_padded, tiny_causal_lm

TOKEN_FIELDS = ("action_log_probs", "ref_log_probs", "values")
SCORED_FIELDS = ("reward", "kl", "advantages", "returns")


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
    "name", ["attention_mask", "action_log_probs", "ref_log_probs", "values", "scores", *SCORED_FIELDS]
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
    setattr(experience, name, bad)  # a mutation after construction is caught by an explicit validate()
    with pytest.raises(ValueError, match=f"`{name}` must have shape"):
        experience.validate()


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
        experience.replace(reward=torch.zeros(3, 4))


def test_select_keeps_the_given_rows_in_order():
    experience = make_experience(batch=5)
    chosen = experience.select(torch.tensor([3, 0]))
    assert chosen.scores.tolist() == [3.0, 0.0]
    for name in ("sequences", "attention_mask", "action_mask", *TOKEN_FIELDS, *SCORED_FIELDS):
        assert torch.equal(getattr(chosen, name), getattr(experience, name)[[3, 0]]), name
    assert make_experience(scored=False).select(torch.tensor([1])).reward is None


def test_replace_returns_a_new_validated_experience():
    experience = make_experience()
    new_values = torch.zeros(3, 4)
    replaced = experience.replace(values=new_values)
    assert replaced is not experience and replaced.values is new_values
    assert not torch.equal(experience.values, new_values)


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


def test_to_device_moves_every_tensor():
    experience = make_experience()
    experience.to_device("meta")
    for name in ("sequences", "attention_mask", "action_mask", "scores", *TOKEN_FIELDS, *SCORED_FIELDS):
        assert getattr(experience, name).device.type == "meta", name
    unscored = make_experience(scored=False)
    unscored.to_device("cpu")
    assert unscored.reward is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pin_memory_pins_every_tensor():
    experience = make_experience().pin_memory()
    for name in ("sequences", "attention_mask", "action_mask", "scores", *TOKEN_FIELDS, *SCORED_FIELDS):
        assert getattr(experience, name).is_pinned(), name


def test_concat_experience_re_pads_ragged_parts():
    short = make_experience(batch=2, prompt=2, response=3, seed=1)
    long = make_experience(batch=3, prompt=4, response=2, seed=2)
    merged = concat_experience([short, long], pad_token_id=PAD)
    assert merged.batch_size == 5 and merged.prompt_length == 4 and merged.response_length == 3
    # short: 2 extra prompt columns on the left; long: 1 extra response column on the right.
    assert torch.equal(merged.sequences[:2, 2:], short.sequences)
    assert bool((merged.sequences[:2, :2] == PAD).all()) and bool((merged.attention_mask[:2, :2] == 0).all())
    assert torch.equal(merged.attention_mask[:2, 2:], short.attention_mask)
    assert torch.equal(merged.sequences[2:, :6], long.sequences)
    assert bool((merged.sequences[2:, 6] == PAD).all()) and bool((merged.attention_mask[2:, 6] == 0).all())
    assert torch.equal(merged.action_mask[:2], short.action_mask)
    assert torch.equal(merged.action_mask[2:, :2], long.action_mask) and not bool(merged.action_mask[2:, 2].any())
    for name in (*TOKEN_FIELDS, *SCORED_FIELDS):
        assert torch.equal(getattr(merged, name)[:2], getattr(short, name)), name
        assert torch.equal(getattr(merged, name)[2:, :2], getattr(long, name)), name
        assert bool((getattr(merged, name)[2:, 2] == 0).all()), name
    assert merged.scores.tolist() == [0.0, 1.0, 0.0, 1.0, 2.0]
    assert merged.action_mask.dtype == torch.bool and merged.sequences.dtype == torch.long


def test_concat_experience_of_unscored_parts_stays_unscored():
    merged = concat_experience([make_experience(scored=False), make_experience(scored=False)], pad_token_id=PAD)
    assert merged.batch_size == 6 and not merged.is_scored
    with pytest.raises(ValueError, match="`parts` is empty"):
        concat_experience([], pad_token_id=PAD)


def test_concat_experience_keeps_every_response_token_at_column_p_plus_t():
    # Re-padding must not move a response token relative to its logits: the reference log-probs
    # of the merged batch equal those of each part.
    model = tiny_causal_lm("gpt2").eval()
    parts = []
    for prompts, response in (([[3, 4], [5]], [[6, 7, 2], [8, 2, PAD]]), ([[9, 10, 11, 12]], [[13, 14]])):
        ids, mask = left_padded(prompts)
        response_ids = torch.tensor(response)
        action_mask = response_ids != PAD
        sequences = torch.cat([ids, response_ids], dim=1)
        attention_mask = torch.cat([mask, action_mask.long()], dim=1)
        logprobs = reference_logprobs(model, sequences, attention_mask, ids.shape[1], temperature=1.0) * action_mask
        zeros = torch.zeros_like(logprobs)
        parts.append(
            Experience(
                sequences=sequences,
                attention_mask=attention_mask,
                action_mask=action_mask,
                action_log_probs=logprobs,
                ref_log_probs=logprobs,
                values=zeros,
                scores=torch.zeros(len(prompts)),
            )
        )
    merged = concat_experience(parts, pad_token_id=PAD)
    recomputed = reference_logprobs(
        model, merged.sequences, merged.attention_mask, merged.prompt_length, temperature=1.0
    )
    torch.testing.assert_close(recomputed * merged.action_mask, merged.action_log_probs, rtol=0.0, atol=1e-5)


def test_concat_experience_refuses_to_mix_scored_and_unscored_parts():
    # Dropping the scored fields of some parts would silently lose advantages and returns.
    with pytest.raises(ValueError, match="mixes scored and unscored"):
        concat_experience([make_experience(scored=True), make_experience(scored=False)], pad_token_id=PAD)
