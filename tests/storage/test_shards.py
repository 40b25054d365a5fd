"""Parquet shards: round trips for every table, schema enforcement, atomic no-overwrite writes."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage.schemas import (
    CANDIDATES,
    EXPERIENCE,
    PREFERENCES,
    PROMPTS,
    SCHEMAS,
    SCORED_EXPERIENCE,
    conform,
)
from storage.shards import read_table, write_shards


def _rows(schema: pa.Schema, count: int) -> pa.Table:
    """``count`` rows of ``schema`` with ragged lists: row ``i`` has ``i % 4`` response tokens (0 = empty)."""
    columns = {}
    for field in schema:
        if pa.types.is_integer(field.type):  # row, prompt_id, pair_id, example_id, candidate_index, policy_version
            columns[field.name] = list(range(count))
        elif field.name == "prompt_ids":
            columns[field.name] = [list(range(1, 2 + i % 3)) for i in range(count)]
        elif field.name == "response_ids":
            columns[field.name] = [[7 + i] * (i % 4) for i in range(count)]
        elif pa.types.is_list(field.type) and pa.types.is_integer(field.type.value_type):  # chosen_ids, ...
            columns[field.name] = [[11 + i] * (i % 3) for i in range(count)]
        elif field.name == "messages":  # a chat prompt every other row
            columns[field.name] = [[{"role": "user", "content": f"turn {i}"}] * (i % 2) for i in range(count)]
        elif field.name == "action_mask":  # an episode's model mask: as long as the response
            columns[field.name] = [[k % 3 != 1 for k in range(i % 4)] for i in range(count)]
        elif pa.types.is_boolean(field.type):  # done
            columns[field.name] = [i % 2 == 0 for i in range(count)]
        elif pa.types.is_list(field.type):  # per-token floats: as long as the response
            columns[field.name] = [[0.5 * i - 1.25 + k / 3 for k in range(i % 4)] for i in range(count)]
        elif pa.types.is_floating(field.type):
            columns[field.name] = [float(i) / 7 for i in range(count)]
        else:
            columns[field.name] = [f"{field.name} {i} ü\n" * (i % 3) for i in range(count)]
    return conform(pa.table(columns), schema)


@pytest.mark.parametrize("table_name", sorted(SCHEMAS))
@pytest.mark.parametrize("rows_per_shard", [3, 4096])
def test_round_trip_every_table(tmp_path: Path, table_name: str, rows_per_shard: int) -> None:
    schema = SCHEMAS[table_name]
    table = _rows(schema, 10)
    entries = write_shards(tmp_path, table_name, table, schema=schema, rows_per_shard=rows_per_shard)
    expected_shards = -(-10 // rows_per_shard)
    assert [entry.path for entry in entries] == [f"{table_name}-{i:05d}.parquet" for i in range(expected_shards)]
    assert sum(entry.rows for entry in entries) == 10
    back = read_table(tmp_path, table_name)
    assert back.schema == schema
    assert back.equals(table)


def test_shards_are_zstd_compressed_and_sized(tmp_path: Path) -> None:
    entries = write_shards(tmp_path, "prompts", _rows(PROMPTS, 5), schema=PROMPTS, rows_per_shard=2)
    assert [entry.rows for entry in entries] == [2, 2, 1]
    for entry in entries:
        metadata = pq.read_metadata(tmp_path / entry.path)
        assert metadata.row_group(0).column(0).compression == "ZSTD"
        assert entry.bytes == (tmp_path / entry.path).stat().st_size
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")]  # no temporaries left


def test_empty_table_keeps_its_schema(tmp_path: Path) -> None:
    entries = write_shards(tmp_path, "experience", EXPERIENCE.empty_table(), schema=EXPERIENCE)
    assert [(entry.path, entry.rows) for entry in entries] == [("experience-00000.parquet", 0)]
    back = read_table(tmp_path, "experience")
    assert back.num_rows == 0 and back.schema == EXPERIENCE


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    table = _rows(PREFERENCES, 4)
    write_shards(tmp_path, "preferences", table, schema=PREFERENCES)
    before = (tmp_path / "preferences-00000.parquet").read_bytes()
    with pytest.raises(FileExistsError, match="preferences-00000.parquet"):
        write_shards(tmp_path, "preferences", _rows(PREFERENCES, 2), schema=PREFERENCES)
    assert (tmp_path / "preferences-00000.parquet").read_bytes() == before


def test_a_table_name_prefix_is_another_table(tmp_path: Path) -> None:
    write_shards(tmp_path, "experience", _rows(EXPERIENCE, 2), schema=EXPERIENCE)
    write_shards(tmp_path, "experience_scored", _rows(SCORED_EXPERIENCE, 3), schema=SCORED_EXPERIENCE)
    assert read_table(tmp_path, "experience").num_rows == 2
    assert read_table(tmp_path, "experience_scored").num_rows == 3


def test_casts_within_a_type_family(tmp_path: Path) -> None:
    table = pa.table(
        {
            "labeler": ["gold"],
            "margin": pa.array([1], pa.int64()),  # int -> float32
            "pair_id": pa.array([3], pa.int32()),  # int32 -> int64, columns reordered
            "prompt": pa.array(["p"], pa.large_string()),
            "messages": [[{"role": "user", "content": "p"}]],  # struct fields nullable -> not null
            "chosen": ["c"],
            "rejected": ["r"],
        }
    )
    write_shards(tmp_path, "preferences", table, schema=PREFERENCES)
    back = read_table(tmp_path, "preferences")
    assert back.schema == PREFERENCES and back.column("margin").to_pylist() == [1.0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.drop_columns(["prompt"]), r"missing columns \['prompt'\]"),
        (lambda t: t.append_column("extra", pa.array([1, 2])), r"unexpected columns \['extra'\]"),
        (lambda t: t.set_column(0, "prompt_id", pa.array(["0", "1"])), "column `prompt_id` has type string"),
        (lambda t: t.set_column(0, "prompt_id", pa.array([0, None])), "column `prompt_id` has 1 null"),
        (lambda t: t.set_column(5, "prompt_ids", pa.array([[1], [2**40]])), "column `prompt_ids` cannot be cast"),
        (lambda t: t.set_column(5, "prompt_ids", pa.array([[1], [None]])), "column `prompt_ids` has null values"),
        (
            lambda t: t.set_column(6, "response_ids", pa.array([[1.5], []])),
            "column `response_ids` has type list<item: double>",
        ),
    ],
)
def test_schema_mismatch_names_the_column(tmp_path: Path, change, message: str) -> None:
    table = change(_rows(CANDIDATES, 2))
    with pytest.raises(ValueError, match=message):
        write_shards(tmp_path, "candidates", table, schema=CANDIDATES)
    assert not list(tmp_path.iterdir())


def test_missing_table_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="prompts"):
        read_table(tmp_path, "prompts")
