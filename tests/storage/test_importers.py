"""Importers: prompts, preference pairs and SFT examples from JSONL, Parquet and CSV; bad rows named precisely."""

from __future__ import annotations

import csv
import json
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage.importers import (
    MAX_ROW_BYTES,
    ImportFormatError,
    import_preferences,
    import_prompts,
    import_sft_examples,
    render_chat,
)
from storage.schemas import PREFERENCES, PROMPTS, SFT_EXAMPLES

HH_CHOSEN = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Tell a joke\n\nAssistant: Why did the chicken..."
HH_REJECTED = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Tell a joke\n\nAssistant: No."
HH_PROMPT = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Tell a joke\n\nAssistant:"


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


# Prompts ---------------------------------------------------------------------------------------

PROMPT_ROWS = [{"prompt": "Write a poem"}, {"prompt": 'multi\nline, with "quotes"'}]


@pytest.mark.parametrize("writer", [_jsonl, _parquet, _csv])
def test_prompts_from_a_text_column(tmp_path: Path, writer) -> None:
    suffix = {_jsonl: ".jsonl", _parquet: ".parquet", _csv: ".csv"}[writer]
    table = import_prompts(writer(tmp_path / f"prompts{suffix}", PROMPT_ROWS))
    assert table.schema == PROMPTS
    assert table.to_pylist() == [
        {"prompt_id": 0, "prompt": "Write a poem", "messages": []},
        {"prompt_id": 1, **PROMPT_ROWS[1], "messages": []},
    ]


def test_prompts_from_another_column_with_ids(tmp_path: Path) -> None:
    path = _csv(tmp_path / "p.csv", [{"prompt_id": "7", "text": "a"}, {"prompt_id": "3", "text": "b"}])
    assert import_prompts(path, text_column="text").to_pylist() == [
        {"prompt_id": 7, "prompt": "a", "messages": []},
        {"prompt_id": 3, "prompt": "b", "messages": []},
    ]


@pytest.mark.parametrize("writer", [_jsonl, _parquet])
def test_prompts_from_chat_messages(tmp_path: Path, writer) -> None:
    turns = [_user("Hi there"), _assistant("Hello!"), _user("Tell a joke")]
    suffix = ".jsonl" if writer is _jsonl else ".parquet"
    table = import_prompts(writer(tmp_path / f"chat{suffix}", [{"messages": turns}]))
    assert table.to_pylist() == [{"prompt_id": 0, "prompt": HH_PROMPT, "messages": turns}]  # the turns are kept


def test_chat_messages_in_csv_are_json(tmp_path: Path) -> None:
    path = _csv(
        tmp_path / "chat.csv", [{"messages": json.dumps([{"role": "system", "content": "Be brief."}, _user("Hi")])}]
    )
    assert import_prompts(path).column("prompt").to_pylist() == ["\n\nSystem: Be brief.\n\nHuman: Hi\n\nAssistant:"]


def test_render_chat_is_the_hh_format() -> None:
    conversation = [_user("Hi there"), _assistant("Hello!"), _user("Tell a joke"), _assistant("Why did the chicken...")]
    assert render_chat(conversation, add_generation_prompt=False) == HH_CHOSEN
    assert render_chat(conversation[:3], add_generation_prompt=True) == HH_PROMPT


@pytest.mark.parametrize(
    ("name", "content", "row", "field", "problem"),
    [
        ("missing.jsonl", '{"prompt": "ok"}\n{"text": "no prompt"}\n', 2, "prompt", "missing.*fields: 'text'"),
        # issue 27: a misspelt column is named, not silently ignored; a dataset's own columns are kept out of it
        ("typo.jsonl", '{"mesages": [{"role": "user", "content": "x"}]}\n', 1, "mesages", "did you mean 'messages'"),
        ("typo2.jsonl", '{"prompt": "a", "answer": "4"}\n{"promt": "b"}\n', 2, "promt", "did you mean 'prompt'"),
        ("type.jsonl", '{"prompt": "ok"}\n\n{"prompt": 5}\n', 3, "prompt", "expected a string, got int"),
        ("json.jsonl", '{"prompt": "ok"}\n{"prompt": "cut\n', 2, None, "invalid JSON"),
        ("array.jsonl", '["prompt"]\n', 1, None, "expected a JSON object"),
        ("empty.jsonl", '{"prompt": "  "}\n', 1, "prompt", "empty"),
        ("role.jsonl", '{"messages": [{"role": "robot", "content": "x"}]}\n', 1, "messages[0].role", "expected one of"),
        ("content.jsonl", '{"messages": [{"role": "user", "content": 3}]}\n', 1, "messages[0].content", "string"),
        ("ends.jsonl", '{"messages": [{"role": "assistant", "content": "x"}]}\n', 1, "messages", "assistant turn"),
        ("ids.jsonl", '{"prompt": "a", "prompt_id": 1}\n{"prompt": "b"}\n', 2, "prompt_id", "some rows"),
        ("badid.jsonl", '{"prompt": "a", "prompt_id": 1.5}\n', 1, "prompt_id", "expected an integer"),
        (
            "dup.jsonl",
            '{"prompt": "a", "prompt_id": 1}\n{"prompt": "b", "prompt_id": 1}\n',
            None,
            "prompt_id",
            "duplicate",
        ),
        ("ragged.csv", "prompt\nok\nok,extra\n", 2, None, "more values"),
        ("bad.parquet", "not parquet", None, None, "not a readable Parquet file"),
        ("prompts.txt", "hello", None, None, "unsupported file type"),
    ],
)
def test_bad_prompt_files_name_file_row_and_field(
    tmp_path: Path, name: str, content: str, row: int | None, field: str | None, problem: str
) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ImportFormatError, match=problem) as caught:
        import_prompts(path)
    error = caught.value
    assert (error.path, error.row, error.field) == (path, row, field)
    assert str(path) in str(error)
    if row is not None:
        assert f"row {row}" in str(error)
    if field is not None:
        assert repr(field) in str(error)


def test_parquet_with_a_wrongly_typed_column(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "p.parquet", [{"prompt": "ok"}, {"prompt": None}])
    with pytest.raises(ImportFormatError, match=r"row 2, field 'prompt'.*missing"):
        import_prompts(path)


def test_issue14_a_huge_line_is_refused_with_its_row_in_bounded_memory(tmp_path: Path) -> None:
    """A 10 MB JSONL line: refused once MAX_ROW_BYTES are read, never parsed (it used to end in an OOM kill)."""
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": "word " * 2_000_000}) + "\n")
    tracemalloc.start()
    try:
        with pytest.raises(ImportFormatError, match=r"row 2: longer than 4 MiB") as caught:
            import_prompts(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert caught.value.row == 2
    assert peak < 3 * MAX_ROW_BYTES, f"reading the file took {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("writer", [_parquet, _csv])
def test_issue14_a_huge_field_is_refused_with_its_row_and_field(tmp_path: Path, writer) -> None:
    suffix = {_parquet: ".parquet", _csv: ".csv"}[writer]
    path = writer(tmp_path / f"huge{suffix}", [{"prompt": "ok"}, {"prompt": "x" * (MAX_ROW_BYTES + 1)}])
    with pytest.raises(ImportFormatError, match="longer than 4 MiB") as caught:
        import_prompts(path)
    assert caught.value.row == 2
    if writer is _parquet:
        assert caught.value.field == "prompt"


def test_a_long_csv_field_below_the_limit_is_read(tmp_path: Path) -> None:
    """Python's csv module refuses fields over 128 KiB by default; a long prompt is not a malformed file."""
    path = _csv(tmp_path / "long.csv", [{"prompt": "y" * 200_000}])
    assert len(import_prompts(path).column("prompt")[0].as_py()) == 200_000


# Preferences -----------------------------------------------------------------------------------

EXPECTED_JOKE = {"prompt": HH_PROMPT, "chosen": " Why did the chicken...", "rejected": " No."}
JOKE_TURNS = [_user("Hi there"), _assistant("Hello!"), _user("Tell a joke")]
EXPECTED_CHAT_JOKE = {
    "prompt": HH_PROMPT,
    "messages": JOKE_TURNS,
    "chosen": "Why did the chicken...",
    "rejected": "No.",
}


@pytest.mark.parametrize("writer", [_jsonl, _parquet])
@pytest.mark.parametrize(
    "row",
    [
        pytest.param({"chosen": HH_CHOSEN, "rejected": HH_REJECTED}, id="anthropic-hh"),
        pytest.param(
            {
                "prompt": [_user("Hi there"), _assistant("Hello!"), _user("Tell a joke")],
                "chosen": [_assistant("Why did the chicken...")],
                "rejected": [_assistant("No.")],
            },
            id="explicit-prompt-messages",
        ),
        pytest.param(
            {
                "chosen": [
                    _user("Hi there"),
                    _assistant("Hello!"),
                    _user("Tell a joke"),
                    _assistant("Why did the chicken..."),
                ],
                "rejected": [_user("Hi there"), _assistant("Hello!"), _user("Tell a joke"), _assistant("No.")],
            },
            id="implicit-prompt-messages",
        ),
    ],
)
def test_every_chat_preference_format_lands_in_the_same_chat_pair(tmp_path: Path, writer, row: dict) -> None:
    suffix = ".jsonl" if writer is _jsonl else ".parquet"
    path = writer(tmp_path / f"pairs{suffix}", [row, row])
    table = import_preferences(path)
    assert table.schema == PREFERENCES
    label = f"import:pairs{suffix}"
    expected = {**EXPECTED_CHAT_JOKE, "margin": 0.0, "labeler": label}
    assert table.to_pylist() == [{"pair_id": 0, **expected}, {"pair_id": 1, **expected}]


def test_issue35_an_ultrafeedback_binarised_row_lands_in_the_same_chat_pair(tmp_path: Path) -> None:
    """HuggingFaceH4/ultrafeedback_binarized's columns: the prompt string repeats the last user turn of the two
    conversations; its id, messages and scores are the dataset's own."""
    chosen = [*JOKE_TURNS, _assistant("Why did the chicken...")]
    row = {
        "prompt": "Tell a joke", "prompt_id": "9f86d0", "chosen": chosen,
        "rejected": [*JOKE_TURNS, _assistant("No.")], "messages": chosen, "score_chosen": 8.5, "score_rejected": 2.0,
    }  # fmt: skip
    for writer, suffix in ((_jsonl, ".jsonl"), (_parquet, ".parquet")):
        table = import_preferences(writer(tmp_path / f"uf{suffix}", [row]))
        assert table.to_pylist() == [
            {"pair_id": 0, **EXPECTED_CHAT_JOKE, "margin": 0.0, "labeler": f"import:uf{suffix}"}
        ]
    wrong = _jsonl(tmp_path / "wrong.jsonl", [{**row, "prompt": "Tell a story"}])
    with pytest.raises(ImportFormatError, match="is not the last user turn of the 'chosen' conversation"):
        import_preferences(wrong)


def test_a_text_pair_stays_text(tmp_path: Path) -> None:
    table = import_preferences(_jsonl(tmp_path / "pairs.jsonl", [EXPECTED_JOKE]))
    assert table.to_pylist() == [
        {"pair_id": 0, **EXPECTED_JOKE, "messages": [], "margin": 0.0, "labeler": "import:pairs.jsonl"}
    ]


def test_margins_are_kept(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "m.jsonl", [{**EXPECTED_JOKE, "margin": 2}, {**EXPECTED_JOKE, "margin": 0.5}, EXPECTED_JOKE]
    )
    assert import_preferences(path).column("margin").to_pylist() == [2.0, 0.5, 0.0]


def test_empty_file_gives_an_empty_table(tmp_path: Path) -> None:
    path = tmp_path / "none.jsonl"
    path.write_text("\n")
    table = import_preferences(path)
    assert table.num_rows == 0 and table.schema == PREFERENCES


@pytest.mark.parametrize(
    ("row", "field", "problem"),
    [
        ({"prompt": "p", "chosen": "c"}, "rejected", "missing"),
        ({"prompt": "p", "chosen": "c", "rejected": "r", "choosen": "x"}, "choosen", "did you mean 'chosen'"),
        ({"prompt": "p", "chosen": "c", "rejected": 4}, "rejected", "expected a string, got int"),
        ({"prompt": 1, "chosen": "c", "rejected": "r"}, "prompt", "expected a string"),
        ({"prompt": "p", "chosen": "c", "rejected": "r", "margin": "big"}, "margin", "expected a number"),
        ({"prompt": "p", "chosen": "c", "rejected": "r", "margin": True}, "margin", "expected a number"),
        ({"chosen": "no assistant turn", "rejected": HH_REJECTED}, "chosen", "not a transcript"),
        ({"chosen": HH_CHOSEN, "rejected": "\n\nHuman: other\n\nAssistant: x"}, "rejected", "differs"),
        ({"chosen": [_user("a"), _assistant("b")], "rejected": [_user("z"), _assistant("c")]}, "rejected", "differs"),
        ({"chosen": [_user("a"), _assistant("b")], "rejected": [_user("a")]}, "rejected", "assistant turn"),
        ({"chosen": [_user("a"), _assistant("b")], "rejected": []}, "rejected", "non-empty list"),
        (
            {"prompt": "p", "chosen": [_assistant("b")], "rejected": [_assistant("c")]},
            "prompt",
            "needs string 'chosen'",
        ),
        (
            {"prompt": [_user("p")], "chosen": [{"role": "assistant"}], "rejected": [_assistant("c")]},
            "chosen[0].content",
            "string",
        ),
    ],
)
def test_bad_preference_rows_name_file_row_and_field(tmp_path: Path, row: dict, field: str, problem: str) -> None:
    path = _jsonl(tmp_path / "pairs.jsonl", [EXPECTED_JOKE, EXPECTED_JOKE, row, EXPECTED_JOKE])
    with pytest.raises(ImportFormatError, match=problem) as caught:
        import_preferences(path)
    assert (caught.value.path, caught.value.row, caught.value.field) == (path, 3, field)
    assert f"{path}, row 3, field {field!r}" in str(caught.value)


def test_bad_json_line_in_preferences(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(EXPECTED_JOKE) + "\n{oops\n")
    with pytest.raises(ImportFormatError, match=r"pairs.jsonl, row 2: invalid JSON"):
        import_preferences(path)


def test_preferences_do_not_read_csv(tmp_path: Path) -> None:
    path = _csv(tmp_path / "pairs.csv", [EXPECTED_JOKE])
    with pytest.raises(ImportFormatError, match="unsupported file type '.csv'"):
        import_preferences(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        import_preferences(tmp_path / "absent.jsonl")


def test_datasets_folders_are_read_like_parquet(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(PROMPT_ROWS).save_to_disk(str(tmp_path / "prompts"))
    assert import_prompts(tmp_path / "prompts").column("prompt").to_pylist() == [row["prompt"] for row in PROMPT_ROWS]
    chat = {"prompt": JOKE_TURNS, "chosen": [_assistant("Why did the chicken...")], "rejected": [_assistant("No.")]}
    datasets.Dataset.from_list([chat]).save_to_disk(str(tmp_path / "pairs"))
    assert import_preferences(tmp_path / "pairs").to_pylist()[0]["messages"] == JOKE_TURNS
    datasets.DatasetDict({"train": datasets.Dataset.from_list(PROMPT_ROWS)}).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(ImportFormatError, match="holds the splits \\['train'\\]: point at one split"):
        import_prompts(tmp_path / "splits")


# Supervised fine-tuning examples -------------------------------------------------------------------

SFT_CHAT = [
    {"role": "system", "content": "Be brief."},
    _user("Hi"),
    _assistant("Hello!"),
    _user("Joke?"),
    _assistant("No."),
]
SFT_PLAIN = {"prompt": "2 + 2 =", "completion": " 4"}


@pytest.mark.parametrize("writer", [_jsonl, _parquet])
def test_sft_examples_are_conversations_or_prompt_completion_pairs(tmp_path: Path, writer) -> None:
    """Both TRL SFT formats, in one file; a dataset's own ``prompt`` beside ``messages`` (ultrachat) is left alone."""
    rows = [
        {"messages": SFT_CHAT, "prompt": "Hi", "completion": None, "prompt_id": "a1"},
        {"messages": None, **SFT_PLAIN, "prompt_id": "a2"},
    ]
    suffix = ".jsonl" if writer is _jsonl else ".parquet"
    table = import_sft_examples(writer(tmp_path / f"sft{suffix}", rows))
    assert table.schema == SFT_EXAMPLES
    assert table.to_pylist() == [
        {"example_id": 0, "messages": SFT_CHAT, "prompt": "", "completion": ""},
        {"example_id": 1, "messages": [], "prompt": "2 + 2 =", "completion": " 4"},  # the completion as written
    ]


def test_sft_examples_from_a_datasets_folder(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"messages": SFT_CHAT}]).save_to_disk(str(tmp_path / "sft"))
    assert import_sft_examples(tmp_path / "sft").column("messages").to_pylist() == [SFT_CHAT]


@pytest.mark.parametrize(
    ("row", "field", "problem"),
    [
        ({"messages": [_user("Hi"), _user("Anyone?")]}, "messages", "has no assistant turn"),
        ({"messages": [_assistant("Hello!"), _user("Hi")]}, "messages", "starts with an assistant turn"),
        ({"messages": [_user("Hi"), {"role": "tool", "content": "x"}]}, "messages[1].role", "expected one of"),
        ({"messages": [_user("Hi"), _assistant(" ")]}, "messages[1].content", "empty"),
        ({"messages": [_user("Hi"), {"role": "assistant"}]}, "messages[1].content", "expected a string"),
        ({"messages": []}, "messages", "non-empty list"),
        ({"text": "Hi there"}, None, "neither 'messages' nor 'prompt'/'completion' is set.*fields: 'text'"),
        ({"prompt": "Hi"}, "completion", "missing"),
        ({"prompt": "Hi", "completion": ""}, "completion", "empty"),
        ({"prompt": " ", "completion": "Hello"}, "prompt", "empty"),
        ({"prompt": [_user("Hi")], "completion": [_assistant("Hello")]}, "prompt", "chat turns go in a 'messages'"),
        ({"messages": SFT_CHAT, "completion": "x"}, "completion", "give one or the other"),
        ({"messages": SFT_CHAT, "completions": "x"}, "completions", "did you mean 'completion'"),
    ],
)
def test_bad_sft_rows_are_refused_in_one_line_naming_file_row_and_field(
    tmp_path: Path, row: dict, field: str | None, problem: str
) -> None:
    path = _jsonl(tmp_path / "sft.jsonl", [SFT_PLAIN, {"messages": SFT_CHAT}, row, SFT_PLAIN])
    with pytest.raises(ImportFormatError, match=problem) as caught:
        import_sft_examples(path)
    assert (caught.value.path, caught.value.row, caught.value.field) == (path, 3, field)
    where = f"{path}, row 3" + ("" if field is None else f", field {field!r}")
    assert str(caught.value).startswith(where + ": ") and "\n" not in str(caught.value)


def test_an_sft_file_with_no_example_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "none.jsonl"
    path.write_text("\n")
    with pytest.raises(ImportFormatError, match=r"none.jsonl: holds no example"):
        import_sft_examples(path)
