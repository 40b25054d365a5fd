"""Import prompts, preference pairs and supervised fine-tuning examples from the files people already have.

Supported inputs (a file, or a folder a Hugging Face ``datasets.Dataset`` was saved to with
``save_to_disk``, read like a Parquet file):

* Prompts (:func:`import_prompts`): JSONL, Parquet or CSV with a text column, or a ``messages``
  column of chat turns (in CSV, a JSON string). An optional integer ``prompt_id`` column is kept;
  otherwise prompts are numbered from 0.
* Preferences (:func:`import_preferences`), JSONL or Parquet, one pair per row:

  - ``prompt`` / ``chosen`` / ``rejected`` strings (TRL's explicit-prompt format), optional ``margin``;
  - the same as chat message lists (TRL conversational): the prompt is the shared conversation,
    chosen and rejected are its final assistant turns;
  - UltraFeedback's binarised rows (HuggingFaceH4/ultrafeedback_binarized): a ``prompt`` string and ``chosen`` /
    ``rejected`` as whole conversations that end with the two answers (the string is their last user turn); its
    ``prompt_id``, ``messages`` and ``score_*`` columns are left alone;
  - ``chosen`` / ``rejected`` only, as message lists (TRL implicit prompt) or as Anthropic HH
    transcripts (``"\\n\\nHuman: ...\\n\\nAssistant: ..."``), read as chat turns.
* Supervised fine-tuning examples (:func:`import_sft_examples`), JSONL or Parquet, one example per row, in TRL's two
  SFT formats: a ``messages`` conversation (system, user and assistant turns, at least one assistant turn, none
  empty; TRL "conversational language modeling") or ``prompt`` / ``completion`` strings (TRL "standard
  prompt-completion"). A ``prompt`` column beside ``messages`` with no ``completion`` is a dataset's own and left
  alone (HuggingFaceH4/ultrachat_200k has one).

Chat prompts keep their turns (the ``messages`` column): the models see them through their own
tokenizer's chat template (:mod:`tasks.text`). The ``prompt`` column then holds a readable
rendering in the Anthropic HH format, which is also the plain format for a tokenizer without a
chat template (:func:`render_chat`): each turn becomes ``"\\n\\nHuman: {content}"`` (user),
``"\\n\\nAssistant: {content}"`` (assistant) or ``"\\n\\nSystem: {content}"`` (system), and a prompt
ends with ``"\\n\\nAssistant:"``. For a chat pair, ``chosen`` and ``rejected`` are the contents of
the final assistant turns.

Errors: the first malformed row raises :class:`ImportFormatError`, whose message names the file,
the 1-based row (the line, for JSONL) and the field. Nothing is returned half-imported.

Memory: files are read row by row (Parquet in record batches), and a row (a JSONL line, a CSV or
Parquet text field) longer than :data:`MAX_ROW_BYTES` is refused before it is parsed, so a file
with one enormous line costs a bounded amount of memory, not the whole line several times over.
"""

from __future__ import annotations

import csv
import difflib
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core.errors import UserError
from storage.schemas import (
    CHAT_MESSAGES,
    CHOSEN,
    COMPLETION,
    EXAMPLE_ID,
    LABELER,
    MARGIN,
    MESSAGES,
    PAIR_ID,
    PREFERENCES,
    PROMPT,
    PROMPT_ID,
    PROMPTS,
    REJECTED,
    SFT_EXAMPLES,
)

MAX_ROW_BYTES = 4 << 20
"""The longest row (or text field) read: 4 MiB of text is about a million tokens, more than any model's context."""
_PARQUET_BATCH_ROWS = 1024

ASSISTANT_CUE = "\n\nAssistant:"
_ROLE_PREFIX = {"user": "\n\nHuman:", "assistant": ASSISTANT_CUE, "system": "\n\nSystem:"}
_TURN = re.compile(r"\n\n(Human|Assistant|System):")
_ROLE_OF_PREFIX = {"Human": "user", "Assistant": "assistant", "System": "system"}
Message = dict[str, str]
"""``{"role": "user" | "assistant" | "system", "content": str}``."""


class ImportFormatError(UserError, ValueError):
    """A malformed row (or file) in an imported dataset.

    Attributes:
        path: the file.
        row: the 1-based row (line for JSONL), or None for a whole-file problem.
        field: the offending field, or None.
    """

    def __init__(self, path: Path, row: int | None, field: str | None, problem: str) -> None:
        where = str(path) if row is None else f"{path}, row {row}"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {problem}")
        self.path, self.row, self.field = path, row, field


def render_chat(messages: list[Message], *, add_generation_prompt: bool) -> str:
    """Render chat turns in the HH text format (see the module docstring).

    Args:
        messages: ``{"role": "user" | "assistant" | "system", "content": str}`` dicts.
        add_generation_prompt: end with ``"\\n\\nAssistant:"`` (for a prompt).
    """
    text = "".join(f"{_ROLE_PREFIX[message['role']]} {message['content']}" for message in messages)
    return text + ASSISTANT_CUE if add_generation_prompt else text


# Reading rows ----------------------------------------------------------------------------------


def _too_long(path: Path, row: int, field: str | None) -> ImportFormatError:
    return ImportFormatError(
        path, row, field, f"longer than {MAX_ROW_BYTES >> 20} MiB, more than any model's context can hold"
    )


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, "rb") as handle:
        number = 0
        while raw := handle.readline(MAX_ROW_BYTES + 1):
            number += 1
            if len(raw) > MAX_ROW_BYTES:
                raise _too_long(path, number, None)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ImportFormatError(path, number, None, f"not UTF-8: {error}") from error
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ImportFormatError(path, number, None, f"invalid JSON: {error}") from error
            if not isinstance(record, dict):
                raise ImportFormatError(path, number, None, f"expected a JSON object, got {type(record).__name__}")
            yield number, record


def _read_parquet(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH_ROWS)
        number = 0
        for batch in batches:
            for record in batch.to_pylist():
                number += 1
                yield number, record
    except (pa.ArrowInvalid, OSError) as error:
        raise ImportFormatError(path, None, None, f"not a readable Parquet file: {error}") from error


def _read_csv(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    if csv.field_size_limit() < MAX_ROW_BYTES:
        csv.field_size_limit(MAX_ROW_BYTES)  # the default, 128 KiB, would refuse a long prompt as "invalid CSV"
    number = 0
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            for number, record in enumerate(csv.DictReader(handle), start=1):
                if None in record:
                    raise ImportFormatError(path, number, None, "more values than header columns")
                yield number, record
    except UnicodeDecodeError as error:
        raise ImportFormatError(path, None, None, f"not UTF-8: {error}") from error
    except csv.Error as error:
        if "field larger than field limit" in str(error):
            raise _too_long(path, number + 1, None) from error
        raise ImportFormatError(path, number + 1, None, f"invalid CSV: {error}") from error


def _read_dataset_folder(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Rows of a ``datasets.Dataset`` saved with ``save_to_disk`` (one split; a DatasetDict is refused)."""
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as error:
        raise ImportFormatError(path, None, None, f"not a folder `datasets.save_to_disk` wrote: {error}") from error
    if isinstance(dataset, datasets.DatasetDict):
        raise ImportFormatError(
            path, None, None, f"holds the splits {sorted(dataset)}: point at one split's folder, e.g. {path / 'train'}"
        )
    yield from enumerate(dataset, start=1)


def _is_dataset_folder(path: Path) -> bool:
    return path.is_dir() and any(
        (path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def _rows(path: Path, readers: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    if _is_dataset_folder(path):
        return _read_dataset_folder(path)
    suffix = path.suffix.lower()
    if suffix not in readers:
        raise ImportFormatError(path, None, None, f"unsupported file type {suffix!r}; use one of {sorted(readers)}")
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    return readers[suffix](path)


# Field checks ----------------------------------------------------------------------------------


def _string(path: Path, row: int, record: dict[str, Any], field: str, *, allow_empty: bool = True) -> str:
    if field not in record or record[field] is None:
        raise ImportFormatError(path, row, field, "missing")
    value = record[field]
    if not isinstance(value, str):
        raise ImportFormatError(path, row, field, f"expected a string, got {type(value).__name__}")
    if len(value) > MAX_ROW_BYTES:  # a Parquet cell: the JSONL and CSV readers refuse long rows before parsing
        raise _too_long(path, row, field)
    if not allow_empty and not value.strip():
        raise ImportFormatError(path, row, field, "empty")
    return value


def _messages(path: Path, row: int, value: Any, field: str) -> list[Message]:
    if isinstance(value, str):  # CSV cells hold the list as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ImportFormatError(path, row, field, f"invalid JSON message list: {error}") from error
    if not isinstance(value, list) or not value:
        raise ImportFormatError(path, row, field, "expected a non-empty list of {role, content} messages")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise ImportFormatError(path, row, f"{field}[{index}]", f"expected an object, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in _ROLE_PREFIX:
            raise ImportFormatError(
                path, row, f"{field}[{index}].role", f"expected one of {sorted(_ROLE_PREFIX)}, got {role!r}"
            )
        if not isinstance(content, str):
            raise ImportFormatError(
                path, row, f"{field}[{index}].content", f"expected a string, got {type(content).__name__}"
            )
        if len(content) > MAX_ROW_BYTES:
            raise _too_long(path, row, f"{field}[{index}].content")
        messages.append({"role": role, "content": content})
    return messages


def _misspelt_columns(path: Path, row: int, record: dict[str, Any], known: tuple[str, ...]) -> None:
    """Refuse a column whose name is close to, but not, one of the ``known`` columns (``mesages``): its data would
    be silently ignored. Other columns (``answer``, ``source``) are a dataset's own and are left alone.

    Raises:
        ImportFormatError: naming the column and the one it resembles.
    """
    for name in record:
        if name not in known and (close := difflib.get_close_matches(str(name), known, n=1, cutoff=0.8)):
            raise ImportFormatError(
                path, row, str(name), f"not a column this file is read by: did you mean {close[0]!r}?"
            )


def _margin(path: Path, row: int, record: dict[str, Any]) -> float:
    value = record.get(MARGIN)
    if value is None or value == "":
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ImportFormatError(path, row, MARGIN, f"expected a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ImportFormatError(path, row, MARGIN, f"must be finite, got {value}")
    return float(value)


# Prompts ---------------------------------------------------------------------------------------


def prompt_rows(path: Path, *, text_column: str = "prompt") -> Iterator[tuple[int, dict[str, Any], str, list[Message]]]:
    """``(row, record, prompt text, chat turns or [])`` of each row of a prompts file or folder, checked, in
    file order (see :func:`import_prompts`).

    Raises:
        ImportFormatError: a malformed row or file (the message names file, row and field).
    """
    path = Path(path)
    readers = {".jsonl": _read_jsonl, ".parquet": _read_parquet, ".csv": _read_csv}
    for row, record in _rows(path, readers):
        _misspelt_columns(path, row, record, (text_column, MESSAGES, PROMPT_ID))
        messages: list[Message] = []
        if record.get(text_column) is not None:
            prompt = _string(path, row, record, text_column, allow_empty=False)
        elif record.get(MESSAGES) is not None:
            messages = _messages(path, row, record[MESSAGES], MESSAGES)
            if messages[-1]["role"] == "assistant":
                raise ImportFormatError(path, row, MESSAGES, "a prompt must not end with an assistant turn")
            prompt = render_chat(messages, add_generation_prompt=True)
        else:
            found = ", ".join(repr(name) for name in record) or "none"
            raise ImportFormatError(
                path, row, text_column, f"missing, and no {MESSAGES!r} field either (the row's fields: {found})"
            )
        yield row, record, prompt, messages


def import_prompts(path: Path, *, text_column: str = "prompt") -> pa.Table:
    """Read prompts from a ``.jsonl``, ``.parquet`` or ``.csv`` file, or a ``datasets`` folder.

    Args:
        path: the file or folder.
        text_column: the column holding the prompt text; rows without it may have ``messages``
            (chat turns, kept as turns; ``prompt`` is then their readable rendering).

    Returns:
        A table with the ``PROMPTS`` schema, in file order.

    Raises:
        ImportFormatError: a malformed row or file (the message names file, row and field).
    """
    path = Path(path)
    ids: list[int] = []
    prompts: list[str] = []
    conversations: list[list[Message]] = []
    explicit_ids: bool | None = None
    for row, record, prompt, messages in prompt_rows(path, text_column=text_column):
        has_id = record.get(PROMPT_ID) not in (None, "")
        if explicit_ids is None:
            explicit_ids = has_id
        if has_id != explicit_ids:
            raise ImportFormatError(path, row, PROMPT_ID, "given for some rows but not others")
        ids.append(_prompt_id(path, row, record[PROMPT_ID]) if has_id else len(ids))
        prompts.append(prompt)
        conversations.append(messages)
    seen: set[int] = set()
    for value in ids:
        if value in seen:
            raise ImportFormatError(path, None, PROMPT_ID, f"duplicate id {value}")
        seen.add(value)
    return pa.table(
        {
            PROMPT_ID: pa.array(ids, pa.int64()),
            PROMPT: pa.array(prompts, pa.string()),
            MESSAGES: pa.array(conversations, CHAT_MESSAGES),
        },
        schema=PROMPTS,
    )


def prompt_columns(path: Path, *, text_column: str = "prompt") -> list[dict[str, Any]]:
    """The columns of each row of a prompts file or folder besides the prompt (its text or ``messages``), in file
    order: what a reward function receives beside the prompt (a reference answer, a test case).

    Raises:
        ImportFormatError: a malformed row or file (the message names file, row and field).
    """
    return [
        {name: value for name, value in record.items() if name not in (text_column, MESSAGES)}
        for _, record, _, _ in prompt_rows(Path(path), text_column=text_column)
    ]


def _prompt_id(path: Path, row: int, value: Any) -> int:
    if isinstance(value, str):  # CSV cells are text
        try:
            return int(value)
        except ValueError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ImportFormatError(path, row, PROMPT_ID, f"expected an integer, got {value!r}")


# Preferences -----------------------------------------------------------------------------------


def _transcript_messages(path: Path, row: int, text: str, field: str) -> list[Message]:
    """The turns of an Anthropic HH transcript (``"\\n\\nHuman: ...\\n\\nAssistant: ..."``)."""
    parts = _TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise ImportFormatError(path, row, field, f"not a transcript of {ASSISTANT_CUE.strip()!r} / 'Human:' turns")
    return [
        {"role": _ROLE_OF_PREFIX[prefix], "content": content.strip()}
        for prefix, content in zip(parts[1::2], parts[2::2], strict=True)
    ]


Pair = tuple[str, list[Message], str, str]
"""``(prompt, messages, chosen, rejected)``: a plain prompt has no messages."""


def _split_conversation(path: Path, row: int, chosen: list[Message], rejected: list[Message]) -> Pair:
    for field, messages in ((CHOSEN, chosen), (REJECTED, rejected)):
        if messages[-1]["role"] != "assistant":
            raise ImportFormatError(path, row, field, "the last message must be an assistant turn")
        if len(messages) < 2:
            raise ImportFormatError(path, row, field, "needs at least one turn before the final assistant turn")
    if chosen[:-1] != rejected[:-1]:
        raise ImportFormatError(path, row, REJECTED, "its conversation before the last turn differs from 'chosen'")
    context = chosen[:-1]
    return render_chat(context, add_generation_prompt=True), context, chosen[-1]["content"], rejected[-1]["content"]


def _preference(path: Path, row: int, record: dict[str, Any]) -> Pair:
    for field in (CHOSEN, REJECTED):
        if record.get(field) is None:
            raise ImportFormatError(path, row, field, "missing")
    prompt, chosen, rejected = record.get(PROMPT), record[CHOSEN], record[REJECTED]
    if isinstance(chosen, str) or isinstance(rejected, str):
        for field in (CHOSEN, REJECTED):
            _string(path, row, record, field)
        if prompt is not None:
            return _string(path, row, record, PROMPT, allow_empty=False), [], chosen, rejected
        return _split_conversation(
            path,
            row,
            _transcript_messages(path, row, chosen, CHOSEN),
            _transcript_messages(path, row, rejected, REJECTED),
        )
    chosen_messages = _messages(path, row, chosen, CHOSEN)
    rejected_messages = _messages(path, row, rejected, REJECTED)
    if isinstance(prompt, str) and len(chosen_messages) > 1:  # UltraFeedback: the conversations hold the prompt
        return _conversation_of_prompt(path, row, _string(path, row, record, PROMPT, allow_empty=False),
                                       chosen_messages, rejected_messages)  # fmt: skip
    if prompt is not None:
        if isinstance(prompt, str):
            raise ImportFormatError(path, row, PROMPT, "a string prompt needs string 'chosen' and 'rejected'")
        prompt_messages = _messages(path, row, prompt, PROMPT)
        chosen_messages = prompt_messages + chosen_messages
        rejected_messages = prompt_messages + rejected_messages
    return _split_conversation(path, row, chosen_messages, rejected_messages)


def _conversation_of_prompt(path: Path, row: int, prompt: str, chosen: list[Message], rejected: list[Message]) -> Pair:
    """An UltraFeedback row: the conversations of ``chosen`` and ``rejected`` (their shared turns the prompt), whose
    last user turn must be the ``prompt`` string."""
    pair = _split_conversation(path, row, chosen, rejected)
    users = [message["content"] for message in pair[1] if message["role"] == "user"]
    if not users or users[-1].strip() != prompt.strip():
        raise ImportFormatError(path, row, PROMPT, "is not the last user turn of the 'chosen' conversation")
    return pair


def preference_rows(path: Path) -> Iterator[tuple[int, str, list[Message], str, str, float]]:
    """``(row, prompt, prompt turns or [], chosen, rejected, margin)`` of each pair in a preferences file or
    folder, checked, in file order (see :func:`import_preferences`).

    Raises:
        ImportFormatError: a malformed row or file (the message names file, row and field).
    """
    path = Path(path)
    for row, record in _rows(path, {".jsonl": _read_jsonl, ".parquet": _read_parquet}):
        _misspelt_columns(path, row, record, (PROMPT, CHOSEN, REJECTED, MARGIN, PROMPT_ID))
        yield row, *_preference(path, row, record), _margin(path, row, record)


def import_preferences(path: Path) -> pa.Table:
    """Read preference pairs from a ``.jsonl`` or ``.parquet`` file or a ``datasets`` folder (formats in the
    module docstring).

    Args:
        path: the file or folder.

    Returns:
        A table with the ``PREFERENCES`` schema, ``pair_id`` numbered from 0 in file order,
        ``margin`` 0.0 where none is given, ``labeler`` ``"import:<file name>"``.

    Raises:
        ImportFormatError: a malformed row or file (the message names file, row and field).
    """
    path = Path(path)
    columns: dict[str, list[Any]] = {PROMPT: [], MESSAGES: [], CHOSEN: [], REJECTED: [], MARGIN: []}
    for _, prompt, messages, chosen, rejected, margin in preference_rows(path):
        columns[PROMPT].append(prompt)
        columns[MESSAGES].append(messages)
        columns[CHOSEN].append(chosen)
        columns[REJECTED].append(rejected)
        columns[MARGIN].append(margin)
    count = len(columns[PROMPT])
    return pa.table(
        {
            PAIR_ID: pa.array(range(count), pa.int64()),
            PROMPT: pa.array(columns[PROMPT], pa.string()),
            MESSAGES: pa.array(columns[MESSAGES], CHAT_MESSAGES),
            CHOSEN: pa.array(columns[CHOSEN], pa.string()),
            REJECTED: pa.array(columns[REJECTED], pa.string()),
            MARGIN: pa.array(columns[MARGIN], pa.float32()),
            LABELER: pa.array([f"import:{path.name}"] * count, pa.string()),
        },
        schema=PREFERENCES,
    )


# Supervised fine-tuning examples -------------------------------------------------------------------


SftExample = tuple[list[Message], str, str]
"""``(messages, prompt, completion)``: a conversation has empty ``prompt`` and ``completion``, a prompt/completion
pair no messages."""


def _conversation(path: Path, row: int, value: Any) -> list[Message]:
    """The turns of an SFT conversation: each non-empty, the first not the assistant's, at least one the assistant's."""
    messages = _messages(path, row, value, MESSAGES)
    for index, message in enumerate(messages):
        if not message["content"].strip():
            raise ImportFormatError(path, row, f"{MESSAGES}[{index}].content", "empty")
    if messages[0]["role"] == "assistant":
        raise ImportFormatError(path, row, MESSAGES, "starts with an assistant turn: answer a system or user turn")
    if not any(message["role"] == "assistant" for message in messages):
        raise ImportFormatError(path, row, MESSAGES, "has no assistant turn: there is nothing to learn")
    return messages


def _sft_example(path: Path, row: int, record: dict[str, Any]) -> SftExample:
    if record.get(MESSAGES) is not None:
        if record.get(COMPLETION) is not None:
            raise ImportFormatError(path, row, COMPLETION, f"given beside {MESSAGES!r}: give one or the other")
        return _conversation(path, row, record[MESSAGES]), "", ""
    if record.get(PROMPT) is None and record.get(COMPLETION) is None:
        found = ", ".join(repr(name) for name in record) or "none"
        raise ImportFormatError(
            path, row, None, f"neither {MESSAGES!r} nor {PROMPT!r}/{COMPLETION!r} is set (the row's fields: {found})"
        )
    for field in (PROMPT, COMPLETION):
        if isinstance(record.get(field), list):
            raise ImportFormatError(path, row, field, f"expected a string; chat turns go in a {MESSAGES!r} column")
    prompt = _string(path, row, record, PROMPT, allow_empty=False)
    return [], prompt, _string(path, row, record, COMPLETION, allow_empty=False)


def sft_example_rows(path: Path) -> Iterator[tuple[int, SftExample]]:
    """``(row, (messages, prompt, completion))`` of each example in an SFT file or folder, checked, in file order
    (see :func:`import_sft_examples`).

    Raises:
        ImportFormatError: a malformed row or file (the message names file, row and field).
    """
    path = Path(path)
    for row, record in _rows(path, {".jsonl": _read_jsonl, ".parquet": _read_parquet}):
        _misspelt_columns(path, row, record, (MESSAGES, PROMPT, COMPLETION, PROMPT_ID))
        yield row, _sft_example(path, row, record)


def import_sft_examples(path: Path) -> pa.Table:
    """Read supervised fine-tuning examples from a ``.jsonl`` or ``.parquet`` file or a ``datasets`` folder (formats
    in the module docstring).

    Args:
        path: the file or folder.

    Returns:
        A table with the ``SFT_EXAMPLES`` schema, ``example_id`` numbered from 0 in file order.

    Raises:
        ImportFormatError: a malformed row, or a file with no example (the message names file, row and field).
    """
    path = Path(path)
    examples = [example for _, example in sft_example_rows(path)]
    if not examples:
        raise ImportFormatError(path, None, None, "holds no example")
    messages, prompts, completions = zip(*examples, strict=True)
    return pa.table(
        {
            EXAMPLE_ID: pa.array(range(len(examples)), pa.int64()),
            MESSAGES: pa.array(messages, CHAT_MESSAGES),
            PROMPT: pa.array(prompts, pa.string()),
            COMPLETION: pa.array(completions, pa.string()),
        },
        schema=SFT_EXAMPLES,
    )
