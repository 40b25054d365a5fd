"""Experience <-> Arrow: bit-identical round trips, ragged and empty responses, refused layouts."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import torch

from rlhf_core.config import AdvantageConfig, SamplingConfig
from rlhf_core.experience import Experience
from rlhf_core.experience_maker import ExperienceMaker, score_experience
from rlhf_core.models import Critic
from storage.experience_io import experience_to_table, table_to_experience, with_values
from storage.schemas import CRITIC_VALUES, EXPERIENCE, SCORED_EXPERIENCE
from storage.shards import read_table, write_shards
from tests.conftest import EOS, PAD, left_padded, tiny_causal_lm, tiny_config

FLOAT_FIELDS = ("old_logprobs", "ref_logprobs", "old_values", "engine_logprobs")
SCORED_FIELDS = ("rewards", "kl", "advantages", "returns")


def _experience(
    prompts: list[list[int]], responses: list[list[int]], *, scored: bool, seed: int = 0, pad: int = PAD
) -> Experience:
    """A batch padded to its longest prompt (left) and response (right), floats 0 at padding.

    Shapes: returns sequences (B, P + R) with P, R the longest prompt and response.
    """
    generator = torch.Generator().manual_seed(seed)
    prompt_ids, prompt_mask = left_padded(prompts)  # (B, P)
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, pad)
    width = max(len(response) for response in responses)
    response_ids = torch.tensor([r + [pad] * (width - len(r)) for r in responses], dtype=torch.long)  # (B, R)
    action_mask = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in responses], dtype=torch.bool)
    action_mask = action_mask.reshape(len(responses), width)  # (B, R), also when R = 0
    response_ids = response_ids.reshape(len(responses), width)  # (B, R)

    def noise() -> torch.Tensor:
        return torch.randn(len(responses), width, generator=generator) * action_mask  # (B, R)

    fields = {name: noise() for name in FLOAT_FIELDS + (SCORED_FIELDS if scored else ())}
    return Experience(
        sequences=torch.cat([prompt_ids, response_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, action_mask.long()], dim=1),
        action_mask=action_mask,
        scores=torch.randn(len(responses), generator=generator),
        group_ids=torch.arange(len(responses)),
        policy_versions=torch.arange(len(responses)) % 2 + 3,
        **fields,
    )


def _assert_identical(expected: Experience, actual: Experience) -> None:
    names = ("sequences", "attention_mask", "action_mask", "scores", "group_ids", "policy_versions")
    for name in (*names, *FLOAT_FIELDS, *SCORED_FIELDS):
        left, right = getattr(expected, name), getattr(actual, name)
        if left is None:
            assert right is None, name
            continue
        assert right.dtype == left.dtype, name
        assert torch.equal(left, right), name
        if left.is_floating_point():  # valid positions bit for bit (padding may be -0.0 on one side)
            valid = expected.action_mask if left.dim() == 2 else torch.ones_like(left, dtype=torch.bool)
            assert torch.equal(left[valid].view(torch.int32), right[valid].view(torch.int32)), name


RAGGED_PROMPTS = [[3, 4, 5], [6], [7, 8, 9, 10], [11, 12]]
RAGGED_RESPONSES = [[13, 14, EOS], [], [15], [16, 17, 18, 19, 20]]


@pytest.mark.parametrize("scored", [False, True])
def test_round_trip_is_bit_identical(scored: bool) -> None:
    experience = _experience(RAGGED_PROMPTS, RAGGED_RESPONSES, scored=scored).replace(
        group_ids=torch.tensor([40, 41, 42, 43])
    )
    table = experience_to_table(experience, first_row=100)
    assert table.schema == (SCORED_EXPERIENCE if scored else EXPERIENCE)
    assert table.column("row").to_pylist() == [100, 101, 102, 103]
    assert table.column("prompt_id").to_pylist() == [40, 41, 42, 43]
    assert table.column("prompt_ids").to_pylist() == RAGGED_PROMPTS
    assert table.column("response_ids").to_pylist() == RAGGED_RESPONSES
    for name in FLOAT_FIELDS:
        assert [len(values) for values in table.column(name).to_pylist()] == [3, 0, 1, 5]
    _assert_identical(experience, table_to_experience(table, pad_token_id=PAD))


def test_round_trip_through_parquet_shards(tmp_path: Path) -> None:
    experience = _experience(RAGGED_PROMPTS * 3, RAGGED_RESPONSES * 3, scored=True, seed=1)
    write_shards(
        tmp_path,
        "experience",
        experience_to_table(experience),
        schema=SCORED_EXPERIENCE,
        rows_per_shard=5,
    )
    _assert_identical(experience, table_to_experience(read_table(tmp_path, "experience"), pad_token_id=PAD))


def test_every_response_empty() -> None:
    experience = _experience([[3, 4], [5]], [[], []], scored=False)
    assert experience.response_length == 0
    _assert_identical(experience, table_to_experience(experience_to_table(experience), pad_token_id=PAD))


def test_pad_token_need_not_be_zero() -> None:
    experience = _experience(RAGGED_PROMPTS, RAGGED_RESPONSES, scored=False, pad=EOS)  # GPT-2 pads with EOS
    _assert_identical(experience, table_to_experience(experience_to_table(experience), pad_token_id=EOS))


def test_over_padded_batch_reads_back_padded_to_its_longest_row() -> None:
    experience = _experience(RAGGED_PROMPTS, RAGGED_RESPONSES, scored=True)
    wider = Experience(
        **{
            name: torch.nn.functional.pad(value, (2, 1) if name in ("sequences", "attention_mask") else (0, 1))
            if value is not None and value.dim() == 2
            else value
            for name, value in experience._tensors().items()
        }
    )
    _assert_identical(experience, table_to_experience(experience_to_table(wider), pad_token_id=PAD))


def test_special_float_values_survive() -> None:
    experience = _experience([[3]], [[4, 5, 6, 7]], scored=False)
    values = torch.tensor([[float("nan"), float("-inf"), -0.0, 1e-45]])
    experience = experience.replace(old_values=values)
    back = table_to_experience(experience_to_table(experience), pad_token_id=PAD)
    assert torch.equal(back.old_values.view(torch.int32), values.view(torch.int32))


def test_slices_and_chunked_tables_read_correctly() -> None:
    experience = _experience(RAGGED_PROMPTS, RAGGED_RESPONSES, scored=False)
    table = experience_to_table(experience)
    chunked = pa.concat_tables([table.slice(0, 1), table.slice(1, 2), table.slice(3)])
    _assert_identical(experience, table_to_experience(chunked, pad_token_id=PAD))
    part = table_to_experience(table.slice(2, 2), pad_token_id=PAD)
    assert part.sequences.tolist() == [[7, 8, 9, 10, 15, 0, 0, 0, 0], [0, 0, 11, 12, 16, 17, 18, 19, 20]]


def test_low_precision_floats_widen_exactly() -> None:
    experience = _experience([[3]], [[4, 5]], scored=False)
    half = experience.replace(old_values=experience.old_values.bfloat16())
    back = table_to_experience(experience_to_table(half), pad_token_id=PAD)
    assert torch.equal(back.old_values, half.old_values.float())


def test_float64_is_refused() -> None:
    experience = _experience([[3]], [[4, 5]], scored=False)
    with pytest.raises(ValueError, match="`old_values` is torch.float64"):
        experience_to_table(experience.replace(old_values=experience.old_values.double()))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda f: f["attention_mask"].__setitem__((0, 2), 0), "`attention_mask` row 0 is not left-padded"),
        (lambda f: f["action_mask"].__setitem__((0, 0), False), "must equal `action_mask`"),
        (lambda f: f["attention_mask"].__setitem__((0, 0), 2), "only 0 and 1"),
        (lambda f: f["sequences"].__setitem__((0, 2), 2**31), "fit int32"),
    ],
)
def test_unrepresentable_layouts_are_refused(edit, message: str) -> None:
    fields = _experience([[3, 4, 5], [6]], [[7, 8], [9]], scored=False)._tensors()
    fields = {name: value.clone() for name, value in fields.items() if value is not None}
    edit(fields)
    with pytest.raises(ValueError, match=message):
        experience_to_table(Experience(**fields))


def test_response_not_right_padded_is_refused() -> None:
    fields = _experience([[3], [6]], [[7, 8, 9], [9]], scored=False)._tensors()
    fields = {name: value.clone() for name, value in fields.items() if value is not None}
    fields["action_mask"][0, 1] = False
    fields["attention_mask"][0, 2] = 0
    with pytest.raises(ValueError, match="`action_mask` row 0 is not right-padded"):
        experience_to_table(Experience(**fields))


def test_group_ids_are_required_and_must_match_the_batch() -> None:
    experience = _experience([[3], [4]], [[5], [6]], scored=False)
    with pytest.raises(ValueError, match="`group_ids` is None"):
        experience_to_table(experience.replace(group_ids=None))
    with pytest.raises(ValueError, match=r"`group_ids` must have shape \(2,\)"):
        experience.replace(group_ids=torch.tensor([0]))


def test_a_rollout_without_a_critic_stores_null_values_and_reads_back_none() -> None:
    """Schema 3: a critic-free rollout has no values; the column is null in every row, not zeros."""
    experience = _experience(RAGGED_PROMPTS, RAGGED_RESPONSES, scored=True).replace(old_values=None)
    table = experience_to_table(experience)
    assert table.column("old_values").null_count == 4
    back = table_to_experience(table, pad_token_id=PAD)
    assert back.old_values is None
    _assert_identical(experience, back)


def test_values_null_in_some_rows_only_are_refused() -> None:
    table = experience_to_table(_experience([[3], [4]], [[5], [6, 7]], scored=False))
    broken = table.set_column(
        table.schema.get_field_index("old_values"), "old_values", pa.array([[0.5], None], pa.list_(pa.float32()))
    )
    with pytest.raises(ValueError, match="column `old_values` is null in 1 of 2 rows"):
        table_to_experience(broken, pad_token_id=PAD)


def test_issue42_another_critics_values_read_in_place_of_the_experiences_and_only_for_the_same_rows() -> None:
    table = experience_to_table(_experience([[3], [4, 5]], [[5, 6], [6, 7, 8]], scored=False), first_row=10)
    values = pa.table({"row": [10, 11], "old_values": [[0.5, -1.0], [2.0, 0.0, 0.25]]}, schema=CRITIC_VALUES)
    back = table_to_experience(with_values(table, values), pad_token_id=PAD)
    assert back.old_values.tolist() == [[0.5, -1.0, 0.0], [2.0, 0.0, 0.25]]  # padded as the experience's own
    _assert_identical(table_to_experience(table, pad_token_id=PAD).replace(old_values=back.old_values), back)
    with pytest.raises(ValueError, match="other rows than the experience"):
        with_values(table, values.set_column(0, "row", pa.array([11, 10])))


def test_mismatched_list_lengths_name_the_column_and_row() -> None:
    table = experience_to_table(_experience([[3], [4]], [[5], [6, 7]], scored=False))
    broken = table.set_column(
        table.schema.get_field_index("old_values"), "old_values", pa.array([[0.5], [0.5]], pa.list_(pa.float32()))
    )
    with pytest.raises(ValueError, match="column `old_values` row 1 has 1 values but `response_ids` has 2"):
        table_to_experience(broken, pad_token_id=PAD)


def test_empty_table_is_refused() -> None:
    with pytest.raises(ValueError, match="no rows"):
        table_to_experience(EXPERIENCE.empty_table(), pad_token_id=PAD)


def test_real_rollout_round_trips() -> None:
    """Experience from the real sampler: GPT-2, left-padded prompts, EOS-truncated responses, GAE."""
    actor, reference = tiny_causal_lm("gpt2", seed=0), tiny_causal_lm("gpt2", seed=0)
    torch.manual_seed(1)
    critic = Critic(config=tiny_config("gpt2"))
    maker = ExperienceMaker(
        actor,
        critic,
        lambda sequences, mask: (sequences * mask).float().mean(dim=1),
        reference,
        sampling=SamplingConfig(max_new_tokens=6, batch_size=4),
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    input_ids, attention_mask = left_padded([[3, 4, 5, 6], [7], [8, 9], [10, 11, 12]])
    experience = maker.make_experience(
        input_ids, attention_mask, group_ids=torch.tensor([5, 5, 9, 9]), generator=torch.Generator().manual_seed(4)
    )
    experience = score_experience(experience, AdvantageConfig(normalize_scores=False))
    assert experience.is_scored
    # The sampler pads to the longest prompt and stops at the longest response, with zeros in
    # padded float positions, so the whole batch comes back identical, not only its valid part.
    _assert_identical(experience, table_to_experience(experience_to_table(experience), pad_token_id=PAD))


def test_issue33_each_row_keeps_the_version_of_the_policy_that_sampled_it_and_schema_5_reads_as_on_policy() -> None:
    experience = _experience(RAGGED_PROMPTS, RAGGED_RESPONSES, scored=True)
    table = experience_to_table(experience)
    assert table.column("policy_version").to_pylist() == [3, 4, 3, 4]
    # Experience written before versions were kept (schema 5) has no such column: its rows were all on-policy.
    older = table_to_experience(table.drop_columns(["policy_version"]), pad_token_id=PAD)
    assert older.policy_versions is None
    assert experience_to_table(older).column("policy_version").null_count == 4
    with pytest.raises(ValueError, match="`policy_version` is null in 1 of 4 rows"):
        table_to_experience(
            table.set_column(
                table.schema.get_field_index("policy_version"), "policy_version", pa.array([3, None, 3, 4])
            ),
            pad_token_id=PAD,
        )


def test_issue44_an_episode_keeps_its_whole_response_window_its_model_mask_and_turn_rewards() -> None:
    experience = _experience(RAGGED_PROMPTS, RAGGED_RESPONSES, scored=True)
    # Row 3's response [16, 17, 18, 19, 20]: model 16, 17; the environment's 18; model 19, 20. Row 0 failed: kept,
    # with no model token (out of the loss).
    actions = experience.attention_mask[:, -5:].bool().clone()  # (B, R)
    actions[3, 2] = False
    actions[0] = False
    turns = torch.tensor([[0.5, 0.0], [0.0, 0.0], [1.0, 0.0], [-0.5, 1.0]])
    episodes = experience.replace(action_mask=actions, turn_rewards=turns)
    table = experience_to_table(episodes)
    assert table.column("response_ids").to_pylist()[3] == [16, 17, 18, 19, 20]
    assert table.column("action_mask").to_pylist()[3] == [True, True, False, True, True]
    assert table.column("action_mask").to_pylist()[0] == [False] * 3
    back = table_to_experience(table, pad_token_id=PAD)
    assert torch.equal(back.action_mask, actions) and torch.equal(back.turn_rewards, turns)
    assert torch.equal(back.attention_mask, experience.attention_mask)
    # Single-turn rows keep both columns null, and experience of schema 6 (neither column) reads as single-turn rows.
    single = experience_to_table(experience)
    assert single.column("action_mask").null_count == single.column("turn_rewards").null_count == 4
    for written in (single, single.drop_columns(["action_mask", "turn_rewards"])):
        read = table_to_experience(written, pad_token_id=PAD)
        assert read.turn_rewards is None and torch.equal(read.action_mask, experience.action_mask)
