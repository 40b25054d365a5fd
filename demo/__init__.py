"""The embedded default world: everything the pipeline needs to run offline on a laptop CPU.

* :mod:`demo.corpus`: a small English-like grammar with sentiment words, and its prompts.
* :mod:`demo.gold`: the hidden gold rubric that plays the human rater.
* :mod:`demo.tokenizer`: a word-level tokenizer saved as an ordinary Hugging Face tokenizer.
* :mod:`demo.pretrain`: next-token pretraining of a tiny GPT-2 on the corpus.
* :mod:`demo.build`: builds (once, then caches) the model folder and the prompt files.

``python -m demo`` builds the world and shows samples with their gold scores.
"""

from __future__ import annotations

from demo.build import DemoWorld, WorldConfig, build_default_world, load_prompts
from demo.gold import gold_prefers, gold_score

__all__ = ["DemoWorld", "WorldConfig", "build_default_world", "gold_prefers", "gold_score", "load_prompts"]
