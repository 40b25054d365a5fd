"""The one-word task's episode (configs/smollm2_task.py, ``OneWord``), named as configs/smollm2-episodes.yaml names it
and played by the runner in its child process: the row's question first, "Answer in one word." after each turn that
was not one word, the rewards hand-worked."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.environments import DONE, EnvironmentReply, EnvironmentRunner
from runtime.references import EnvironmentReference

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_a_failed_turn_is_told_to_answer_in_one_word_and_scores_one_word_minus_one(monkeypatch):
    monkeypatch.syspath_prepend(str(CONFIGS))  # beside the config file, as the config finds it
    row = json.loads((CONFIGS / "smollm2" / "prompts.jsonl").read_text().splitlines()[0])
    question = row["messages"][-1]["content"]
    with EnvironmentRunner(EnvironmentReference.of("smollm2_task:OneWord"), step_timeout_s=20) as runner:
        assert runner.reset("a", seed=0, row={**row, "prompt": "unused"}).observation == question
        # 4 words: 1/4 - 1; none: 0 - 1; then one word ends it with 1.0 (the sum: -0.75).
        replies = [runner.step("a", action) for action in ("The capital is Rome.", "...", "Rome.")]
        assert replies == [
            EnvironmentReply("Answer in one word.", -0.75, False, None),
            EnvironmentReply("Answer in one word.", -1.0, False, None),
            EnvironmentReply(None, 1.0, True, DONE),
        ]
        # A plain-text row's prompt is its question; two words then one: 1/2 - 1 + 1.
        runner.reset("b", seed=0, row={"prompt": "Name a fruit."})
        assert [runner.step("b", action).reward for action in ("A pear", "pear")] == [-0.5, 1.0]


def test_the_shipped_instruction_set_answers_training_topics_in_one_word(monkeypatch):
    """configs/smollm2/sft.jsonl (configs/smollm2-sft.yaml's `sft.data`) is what the module writes, each assistant turn
    passes the exact rubric, and no held-out topic is asked about: the held-out rubric measures the instruction."""
    monkeypatch.syspath_prepend(str(CONFIGS))
    import smollm2_task

    from storage.importers import import_sft_examples

    shipped = CONFIGS / "smollm2" / "sft.jsonl"
    rows = [json.loads(line) for line in shipped.read_text().splitlines()]
    assert rows == smollm2_task.demonstrations(seed=2) and len(rows) == 100
    for row in rows:
        user, assistant = row["messages"]
        assert smollm2_task.exactly_one_word(None, assistant["content"]) == 1.0
        assert not any(topic in user["content"] for topic in smollm2_task.HELD_OUT_TOPICS), user["content"]
    assert import_sft_examples(shipped).num_rows == 100
