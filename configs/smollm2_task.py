"""The task of ``configs/smollm2.yaml``: answer in exactly one word, a verifiable instruction (IFEval's kind); and
the same task as a multi-turn episode with feedback, ``configs/smollm2-episodes.yaml`` (:class:`OneWord`).

Prompts are chat messages such as ``Name a fruit. Answer with one word only.``: a question about a category
of things and an instruction to answer in one word. Training and held-out prompts ask about disjoint
categories (fruits, birds, ... against planets, metals, ...), so the held-out score measures whether the
policy learnt to follow the instruction, not the answers it saw.

SmolLM2-135M-Instruct mostly answers in a sentence (``The capital of Italy is Rome.``): sampled at
temperature 1 with 16 new tokens it scores about 0.2 on the held-out prompts (see docs/real-model.md).

The instruction set ``configs/smollm2/sft.jsonl`` (configs/smollm2-sft.yaml) holds demonstrations of the
instruction: a training topic's question answered in one word (:data:`ANSWERS`), so the held-out rubric measures
what supervised fine-tuning taught, on topics it never saw.

``.venv/bin/python configs/smollm2_task.py`` writes ``configs/smollm2/prompts.jsonl``,
``configs/smollm2/eval_prompts.jsonl`` and ``configs/smollm2/sft.jsonl`` (committed; the same files every time).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

WORD = re.compile(r"[A-Za-z0-9]+(?:['-][A-Za-z0-9]+)*")


def one_word(prompt: object, response: str, **_: object) -> float:
    """1 for a one-word answer, 1/n for an answer of n words, 0 for none (punctuation is not a word).

    ``prompt`` (its text or chat messages) and any other prompt column are accepted and unused: the rubric
    judges the response alone.
    """
    words = len(WORD.findall(response))
    return 1.0 / words if words else 0.0


def exactly_one_word(prompt: object, response: str, **_: object) -> float:
    """1 for an answer of exactly one word, else 0: the sparse binary task of issue 43 (a rubric the initial policy
    passes on fewer than one answer in ten; bench/real_loop.py ``decisive`` measures its base rate)."""
    return 1.0 if len(WORD.findall(response)) == 1 else 0.0


FEEDBACK = "Answer in one word."
"""What the one-word episode says after a turn that was not one word (:class:`OneWord`)."""


class OneWord:
    """The one-word task as an episode with feedback (configs/smollm2-episodes.yaml, issue 44): the prompt's question;
    a reply of exactly one word scores 1.0 and ends the episode; any other scores ``one_word(reply) - 1`` (-0.5 for
    two words, -1.0 for none) and is answered :data:`FEEDBACK`, up to the config's ``environment.max_turns`` (3).

    The episode's reward, the sum, ranks the outcomes: one word at once 1.0; after one failed turn of n words 1/n;
    after two, at most 0; never, at most -1.5. A failed turn's reward is graded like ``one_word``'s, so a shorter
    failure still beats a longer one: the initial policy passes the exact rubric at turn 1 on fewer than one answer
    in ten (``exactly_one_word``), and a group of failures with equal rewards would teach nothing."""

    def reset(self, *, seed: int, row: dict) -> str:
        return row["messages"][-1]["content"] if row.get("messages") else row["prompt"]

    def step(self, action: str) -> tuple[str | None, float, bool]:
        if exactly_one_word(None, action) == 1.0:
            return None, 1.0, True
        return FEEDBACK, one_word(None, action) - 1.0, False


QUESTIONS = (
    "Name a {}.",
    "What is your favourite {}?",
    "Which {} would you recommend to a friend?",
    "Give me an example of a {}.",
    "Tell me one {} that you like.",
)
INSTRUCTIONS = (
    "Answer with one word only.",
    "Reply in a single word.",
    "Use exactly one word.",
    "Respond with just one word.",
)
TRAIN_TOPICS = (
    "fruit", "vegetable", "animal", "bird", "fish", "colour", "country", "city", "sport", "flower",
    "tree", "musical instrument", "board game", "river", "mountain", "car brand", "pet", "spice", "cheese", "toy",
)  # fmt: skip
HELD_OUT_TOPICS = ("planet", "metal", "profession", "vehicle", "drink", "language", "dessert", "insect", "gemstone", "fabric")  # fmt: skip
FOLDER = Path(__file__).resolve().parent / "smollm2"


def prompts(topics: tuple[str, ...], *, seed: int) -> list[dict]:
    """Every question x topic x instruction, shuffled with ``seed``, as chat-prompt rows."""
    rows = [
        {"messages": [{"role": "user", "content": f"{question.format(topic)} {instruction}"}]}
        for question in QUESTIONS
        for topic in topics
        for instruction in INSTRUCTIONS
    ]
    random.Random(seed).shuffle(rows)
    return rows


ANSWERS = {
    "fruit": ("Apple", "Mango", "Banana", "Cherry", "Pear"),
    "vegetable": ("Carrot", "Broccoli", "Spinach", "Potato", "Onion"),
    "animal": ("Elephant", "Tiger", "Giraffe", "Dolphin", "Horse"),
    "bird": ("Robin", "Eagle", "Parrot", "Owl", "Sparrow"),
    "fish": ("Salmon", "Tuna", "Trout", "Cod", "Goldfish"),
    "colour": ("Blue", "Green", "Red", "Yellow", "Purple"),
    "country": ("Japan", "Brazil", "Canada", "Norway", "Kenya"),
    "city": ("Paris", "Tokyo", "Rome", "Cairo", "Sydney"),
    "sport": ("Football", "Tennis", "Swimming", "Cricket", "Basketball"),
    "flower": ("Rose", "Tulip", "Daisy", "Lily", "Sunflower"),
    "tree": ("Oak", "Maple", "Birch", "Willow", "Pine"),
    "musical instrument": ("Piano", "Guitar", "Violin", "Flute", "Drums"),
    "board game": ("Chess", "Monopoly", "Scrabble", "Checkers", "Backgammon"),
    "river": ("Nile", "Amazon", "Danube", "Thames", "Mississippi"),
    "mountain": ("Everest", "Kilimanjaro", "Fuji", "Denali", "Matterhorn"),
    "car brand": ("Toyota", "Volvo", "Ford", "Honda", "Ferrari"),
    "pet": ("Dog", "Cat", "Hamster", "Rabbit", "Parrot"),
    "spice": ("Cinnamon", "Pepper", "Cumin", "Paprika", "Ginger"),
    "cheese": ("Cheddar", "Brie", "Gouda", "Parmesan", "Mozzarella"),
    "toy": ("Kite", "Yo-yo", "Lego", "Doll", "Marbles"),
}
"""One-word answers to each training topic's questions: the assistant turns of the instruction set (no held-out
topic among them, :data:`HELD_OUT_TOPICS`)."""


def demonstrations(*, seed: int) -> list[dict]:
    """The instruction set: each training topic's answers (:data:`ANSWERS`), each to a question and an instruction
    drawn with ``seed``, as chat rows of a user turn and a one-word assistant turn, shuffled with ``seed``."""
    generator, rows = random.Random(seed), []
    for topic, answers in ANSWERS.items():
        for answer in answers:
            question = f"{generator.choice(QUESTIONS).format(topic)} {generator.choice(INSTRUCTIONS)}"
            rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    generator.shuffle(rows)
    return rows


def write(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    write(prompts(TRAIN_TOPICS, seed=0), FOLDER / "prompts.jsonl")  # 400 prompts
    write(prompts(HELD_OUT_TOPICS, seed=1), FOLDER / "eval_prompts.jsonl")  # 200 prompts
    write(demonstrations(seed=2), FOLDER / "sft.jsonl")  # 100 demonstrations
    print(f"wrote prompts.jsonl, eval_prompts.jsonl and sft.jsonl in {FOLDER}")  # noqa: T201
