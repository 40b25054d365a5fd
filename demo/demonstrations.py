"""The demo's instruction set for supervised fine-tuning (``sft.data``, docs/recipes.md): sentences of the toy
language that the hidden rubric scores highest, each split into a prompt (its first 2-4 words, as the demo's prompts
are) and its completion, in TRL's prompt/completion format.

``python -m demo.demonstrations`` writes them to ``demo/sft.jsonl`` (shipped; a test checks it is what this writes).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from demo.corpus import MAX_PROMPT_WORDS, MIN_PROMPT_WORDS, MIN_RESPONSE_WORDS, generate_sentence
from demo.gold import gold_score

SHIPPED = Path(__file__).with_name("sft.jsonl")
"""The shipped instruction set."""


def demonstrations(count: int = 48, *, seed: int = 0, pool: int = 2000) -> list[dict[str, str]]:
    """The ``count`` best of ``pool`` generated sentences by the gold rubric, as ``{"prompt", "completion"}`` rows
    (the completion with its leading space, as the model continues the prompt), best first; the same for one seed."""
    rng = random.Random(f"demonstrations:{seed}")
    scored = []
    for _ in range(pool):
        words = generate_sentence(rng).split()
        cut = rng.randint(MIN_PROMPT_WORDS, min(MAX_PROMPT_WORDS, len(words) - MIN_RESPONSE_WORDS))
        prompt, completion = " ".join(words[:cut]), " ".join(words[cut:])
        scored.append((gold_score(prompt, completion), prompt, completion))
    scored.sort(key=lambda row: -row[0])  # stable: ties keep their generation order
    return [{"prompt": prompt, "completion": " " + completion} for _, prompt, completion in scored[:count]]


def write_demonstrations(path: Path = SHIPPED) -> Path:
    """Write :func:`demonstrations` as JSONL to ``path``."""
    path.write_text("".join(json.dumps(row) + "\n" for row in demonstrations()))
    return path


if __name__ == "__main__":
    write_demonstrations()
