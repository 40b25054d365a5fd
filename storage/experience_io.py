"""Experience <-> Arrow: the one place rollouts become rows and rows become padded tensors again.

Choices:

1. A row stores only real tokens: the unpadded prompt (``prompt_ids``) and the action tokens
   (``response_ids``, up to and including EOS). Every per-token float list has the length of
   ``response_ids``. Padding is a property of a batch, not of the data, so it is re-created on read.
2. Writing requires the layout :mod:`rlhf_core` produces: prompts left-padded (attention 0s then
   1s), responses right-padded (action mask 1s then 0s), and the response half of the attention
   mask equal to the action mask. Anything else could not be re-created, so it is refused.
3. Floats are stored as float32 bit for bit (float16/bfloat16 widen exactly; float64 is refused
   rather than rounded silently). Token ids are stored as int32 and read back as int64.
4. Reading pads to the longest prompt and response in the table: prompt left-padded with
   ``pad_token_id`` and attention 0, response right-padded with ``pad_token_id``, attention 0,
   action mask False and 0.0 in every float field. So a batch written padded to its longest row
   reads back equal (``torch.equal``) field by field.
5. ``Experience.group_ids`` is the ``prompt_id`` column; ``old_values`` (a rollout without a critic) or
   ``engine_logprobs`` None is a null in every row of its column, and only all or none may be null.
6. ``Experience.policy_versions`` is the ``policy_version`` column; None is a null in every row. Experience of
   schema 5 has no such column and reads as None (it was all sampled on-policy).
7. A multi-turn episode (``Experience.turn_rewards`` set) stores its whole response window: ``response_ids`` are the
   tokens of the response half of ``attention_mask`` (the model's and the environment's, one right-padded run),
   ``action_mask`` the model's among them, ``turn_rewards`` each row's turn rewards as the batch held them
   (zero-padded to its most turns). Single-turn experience stores both as nulls, and experience of schema 5 and 6
   has neither column: both read as single-turn rows (``action_mask`` the response, ``turn_rewards`` None).
8. Another critic's values of stored rows (:data:`storage.schemas.CRITIC_VALUES`) take the place of the
   ``old_values`` column before the rows are read (:func:`with_values`), so they are padded and checked as the
   experience's own.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from rlhf_core.experience import Experience
from storage.schemas import (
    ACTION_MASK,
    EXPERIENCE,
    EXPERIENCE_TOKEN_COLUMNS,
    NULLABLE_TOKEN_COLUMNS,
    OLD_VALUES,
    POLICY_VERSION,
    PROMPT_ID,
    PROMPT_IDS,
    RESPONSE_IDS,
    ROW,
    SCORED_EXPERIENCE,
    SCORED_TOKEN_COLUMNS,
    SCORES,
    TOKEN_FLOATS,
    TURN_REWARDS,
    conform,
)

_EXACT_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INT32 = torch.iinfo(torch.int32)


def _check_runs(mask: torch.Tensor, *, ones_first: bool, name: str) -> None:
    """Each row of a 0/1 mask must be one run of 1s at the end (prompt) or start (response).

    Shapes:
        mask: (B, L).
    """
    if mask.shape[1] < 2:
        return
    step = mask[:, 1:].long() - mask[:, :-1].long()  # (B, L - 1)
    bad = (step > 0) if ones_first else (step < 0)
    if bool(bad.any()):
        row = int(bad.any(dim=1).nonzero()[0, 0])
        side = "right-padded (1s then 0s)" if ones_first else "left-padded (0s then 1s)"
        raise ValueError(f"`{name}` row {row} is not {side}: {mask[row].long().tolist()}")


def _list_array(values: torch.Tensor, lengths: torch.Tensor, value_type: pa.DataType) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths.numpy(), out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.numpy(), type=value_type))


def _float_values(experience: Experience, name: str, mask: torch.Tensor) -> torch.Tensor:
    tensor = getattr(experience, name).detach().cpu()
    if tensor.dtype not in _EXACT_FLOATS:
        raise ValueError(f"`{name}` is {tensor.dtype}; it is stored as float32, so convert it explicitly first")
    return tensor.float()[mask]  # (sum of lengths,)


def experience_to_table(experience: Experience, *, first_row: int = 0) -> pa.Table:
    """Turn a padded Experience batch into rows with unpadded token and per-token float lists.

    Args:
        experience: the batch, with ``group_ids`` (each row's prompt id, stored as ``prompt_id``);
            scored (rewards, kl, advantages, returns set) or not.
        first_row: the ``row`` value of the first row (rows are numbered consecutively from it).

    Returns:
        A table with the ``SCORED_EXPERIENCE`` schema if ``experience.is_scored``, else ``EXPERIENCE``.

    Raises:
        ValueError: ``group_ids`` is missing, the padding is not the left-prompt/right-response
            layout, the response half of the attention mask differs from the action mask, a float
            field is float64, or a token id does not fit int32.

    Shapes:
        experience: sequences (B, T), action_mask (B, R), group_ids (B,), ...
    """
    batch, prompt_length = experience.batch_size, experience.prompt_length
    if experience.group_ids is None:
        raise ValueError("`group_ids` is None: every stored row needs its prompt's id (the `prompt_id` column)")
    row_prompt_ids = experience.group_ids.detach().cpu().long()  # (B,)
    sequences = experience.sequences.detach().cpu().long()  # (B, T)
    attention = experience.attention_mask.detach().cpu()  # (B, T)
    action_mask = experience.action_mask.detach().cpu()  # (B, R)
    if bool(((attention != 0) & (attention != 1)).any()):
        raise ValueError("`attention_mask` must hold only 0 and 1")
    prompt_mask = attention[:, :prompt_length].bool()  # (B, P)
    response_mask = attention[:, prompt_length:].bool()  # (B, R): the response window (choice 7)
    episodes = experience.turn_rewards is not None
    if not episodes and not torch.equal(response_mask, action_mask):
        raise ValueError("the response half of `attention_mask` must equal `action_mask`")
    if bool((action_mask & ~response_mask).any()):
        raise ValueError("`action_mask` is True outside the response half of `attention_mask`")
    _check_runs(prompt_mask, ones_first=False, name="attention_mask")
    _check_runs(response_mask, ones_first=True, name="action_mask" if not episodes else "attention_mask")
    prompt_tokens = sequences[:, :prompt_length][prompt_mask]  # (sum of prompt lengths,)
    response_tokens = sequences[:, prompt_length:][response_mask]  # (sum of response lengths,)
    for tokens in (prompt_tokens, response_tokens):
        if tokens.numel() and (int(tokens.min()) < _INT32.min or int(tokens.max()) > _INT32.max):
            raise ValueError("token ids must fit int32")
    prompt_lengths = prompt_mask.sum(dim=1)  # (B,)
    response_lengths = response_mask.sum(dim=1)  # (B,)
    columns: dict[str, pa.Array] = {
        ROW: pa.array(np.arange(first_row, first_row + batch, dtype=np.int64)),
        PROMPT_ID: pa.array(row_prompt_ids.numpy()),
        PROMPT_IDS: _list_array(prompt_tokens.int(), prompt_lengths, pa.int32()),
        RESPONSE_IDS: _list_array(response_tokens.int(), response_lengths, pa.int32()),
    }
    token_columns = EXPERIENCE_TOKEN_COLUMNS + (SCORED_TOKEN_COLUMNS if experience.is_scored else ())
    for name in token_columns:
        if getattr(experience, name) is None:
            columns[name] = pa.nulls(batch, type=TOKEN_FLOATS)
            continue
        columns[name] = _list_array(_float_values(experience, name, response_mask), response_lengths, pa.float32())
    scores = experience.scores.detach().cpu()
    if scores.dtype not in _EXACT_FLOATS:
        raise ValueError(f"`scores` is {scores.dtype}; it is stored as float32, so convert it explicitly first")
    columns[SCORES] = pa.array(scores.float().numpy())
    versions = experience.policy_versions
    columns[POLICY_VERSION] = (
        pa.nulls(batch, type=pa.int64()) if versions is None else pa.array(versions.detach().cpu().long().numpy())
    )
    if episodes:
        assert experience.turn_rewards is not None
        turns = experience.turn_rewards.detach().cpu().float()  # (B, N)
        columns[ACTION_MASK] = _list_array(action_mask[response_mask], response_lengths, pa.bool_())
        columns[TURN_REWARDS] = _list_array(turns.flatten(), torch.full((batch,), turns.shape[1]), pa.float32())
    else:
        columns[ACTION_MASK] = pa.nulls(batch, type=pa.list_(pa.bool_()))
        columns[TURN_REWARDS] = pa.nulls(batch, type=TOKEN_FLOATS)
    schema = SCORED_EXPERIENCE if experience.is_scored else EXPERIENCE
    return pa.Table.from_arrays([columns[field.name] for field in schema], schema=schema)


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """Flattened values and per-row lengths of a list column."""
    array = column.combine_chunks()
    lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False).astype(np.int64)
    return pc.list_flatten(array).to_numpy(zero_copy_only=False), lengths


def table_to_experience(table: pa.Table, *, pad_token_id: int) -> Experience:
    """Re-pad experience rows into an Experience batch, in table order.

    Args:
        table: rows with the ``EXPERIENCE`` or ``SCORED_EXPERIENCE`` schema (or castable to it);
            scored when it has the reward, kl, advantages and returns columns.
        pad_token_id: the token put in padded positions of ``sequences``.

    Returns:
        An Experience with ``P`` / ``R`` the longest prompt / response in the table; int64
        ``sequences``, ``attention_mask`` and ``group_ids``, bool ``action_mask``, float32
        everything else; ``old_values`` None when the column is null.

    Raises:
        ValueError: the table is empty, does not match the schema, a per-token list's length
            differs from its row's ``response_ids`` (the message names the column and row), or
            ``old_values`` is null in some rows only.

    Shapes:
        returns sequences, attention_mask: (B, P + R); action_mask and per-token fields: (B, R); scores: (B,).
    """
    scored = all(name in table.column_names for name in SCORED_TOKEN_COLUMNS)
    schema = SCORED_EXPERIENCE if scored else EXPERIENCE
    for name, kind in ((POLICY_VERSION, pa.int64()), (ACTION_MASK, pa.list_(pa.bool_())), (TURN_REWARDS, TOKEN_FLOATS)):
        if name not in table.column_names:  # schema 5 has none of them, 6 not the last two (choices 6 and 7)
            table = table.append_column(pa.field(name, kind), pa.nulls(table.num_rows, type=kind))
    table = conform(table, schema)
    batch = table.num_rows
    if batch == 0:
        raise ValueError("cannot build an Experience from a table with no rows")
    prompt_values, prompt_lengths = _flat(table.column(PROMPT_IDS))
    response_values, response_lengths = _flat(table.column(RESPONSE_IDS))
    prompt_length, response_length = int(prompt_lengths.max()), int(response_lengths.max())
    if prompt_length == 0:
        raise ValueError("every prompt in the table is empty; an Experience needs at least one prompt token")
    # Left padding: prompt token j of a row of length n sits at column P - n + j.
    prompt_mask = torch.arange(prompt_length) >= torch.from_numpy(prompt_length - prompt_lengths)[:, None]  # (B, P)
    response_mask = torch.arange(response_length) < torch.from_numpy(response_lengths)[:, None]  # (B, R)
    prompt = torch.full((batch, prompt_length), pad_token_id, dtype=torch.long)  # (B, P)
    prompt[prompt_mask] = torch.from_numpy(prompt_values.astype(np.int64))
    response = torch.full((batch, response_length), pad_token_id, dtype=torch.long)  # (B, R)
    response[response_mask] = torch.from_numpy(response_values.astype(np.int64))
    fields: dict[str, torch.Tensor | None] = {
        "sequences": torch.cat([prompt, response], dim=1),  # (B, T)
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1).long(),  # (B, T)
        "action_mask": response_mask,
        "group_ids": torch.from_numpy(table.column(PROMPT_ID).to_numpy().astype(np.int64, copy=True)),  # (B,)
    }
    fields.update(_episode_fields(table, response_mask, response_lengths))
    for name in EXPERIENCE_TOKEN_COLUMNS + (SCORED_TOKEN_COLUMNS if scored else ()):
        nulls = table.column(name).null_count
        if name in NULLABLE_TOKEN_COLUMNS and nulls == batch:
            fields[name] = None
            continue
        if nulls:
            raise ValueError(f"column `{name}` is null in {nulls} of {batch} rows: all or none may be null")
        values, lengths = _flat(table.column(name))
        if not np.array_equal(lengths, response_lengths):
            row = int(np.nonzero(lengths != response_lengths)[0][0])
            raise ValueError(
                f"column `{name}` row {row} has {lengths[row]} values but `{RESPONSE_IDS}` has {response_lengths[row]}"
            )
        padded = torch.zeros((batch, response_length), dtype=torch.float32)  # (B, R)
        padded[response_mask] = torch.from_numpy(values.astype(np.float32))
        fields[name] = padded
    fields["scores"] = torch.from_numpy(table.column(SCORES).to_numpy().astype(np.float32, copy=True))  # (B,)
    versions = table.column(POLICY_VERSION)
    if versions.null_count not in (0, batch):
        raise ValueError(
            f"column `{POLICY_VERSION}` is null in {versions.null_count} of {batch} rows: all or none may be"
        )
    fields["policy_versions"] = (
        None if versions.null_count else torch.from_numpy(versions.to_numpy().astype(np.int64, copy=True))  # (B,)
    )
    return Experience(**fields)


def _episode_fields(
    table: pa.Table, response_mask: torch.Tensor, response_lengths: np.ndarray
) -> dict[str, torch.Tensor | None]:
    """``action_mask`` and ``turn_rewards`` of episode rows (choice 7); nothing for single-turn rows.

    Shapes:
        response_mask: (B, R); returns action_mask (B, R) and turn_rewards (B, N).
    """
    masks, turns = table.column(ACTION_MASK), table.column(TURN_REWARDS)
    batch = table.num_rows
    for column, name in ((masks, ACTION_MASK), (turns, TURN_REWARDS)):
        if column.null_count not in (0, batch):
            raise ValueError(f"column `{name}` is null in {column.null_count} of {batch} rows: all or none may be")
    if masks.null_count != turns.null_count:
        raise ValueError(f"columns `{ACTION_MASK}` and `{TURN_REWARDS}` must be null together")
    if masks.null_count:
        return {}
    values, lengths = _flat(masks)
    if not np.array_equal(lengths, response_lengths):
        row = int(np.nonzero(lengths != response_lengths)[0][0])
        raise ValueError(
            f"column `{ACTION_MASK}` row {row} has {lengths[row]} values but `{RESPONSE_IDS}` has {response_lengths[row]}"
        )
    action_mask = torch.zeros_like(response_mask)  # (B, R)
    action_mask[response_mask] = torch.from_numpy(values.astype(bool))
    rewards, counts = _flat(turns)
    turn_rewards = torch.zeros((batch, int(counts.max(initial=0))), dtype=torch.float32)  # (B, N)
    turn_rewards[torch.arange(turn_rewards.shape[1]) < torch.from_numpy(counts)[:, None]] = torch.from_numpy(
        rewards.astype(np.float32)
    )
    return {"action_mask": action_mask, "turn_rewards": turn_rewards}


def with_values(table: pa.Table, values: pa.Table) -> pa.Table:
    """The experience ``table`` with the ``old_values`` of ``values`` (a :data:`storage.schemas.CRITIC_VALUES` table
    of the same rows: another critic's values of them) in place of its own (choice 8).

    Raises:
        ValueError: ``values`` holds other rows than ``table``, or in another order.
    """
    if not table.column(ROW).equals(values.column(ROW)):
        raise ValueError("the critic values hold other rows than the experience, or in another order")
    index = table.schema.get_field_index(OLD_VALUES)
    return table.set_column(index, table.schema.field(index), values.column(OLD_VALUES))
