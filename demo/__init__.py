"""The embedded default world: everything the pipeline needs to run offline on a laptop CPU.

* :mod:`demo.corpus`: a small English-like grammar with sentiment words, and its prompts.
* :mod:`demo.gold`: the hidden gold rubric that plays the human rater.
* :mod:`demo.tokenizer`: a word-level tokenizer saved as an ordinary Hugging Face tokenizer.
* :mod:`demo.pretrain`: next-token pretraining of a tiny GPT-2 on the corpus.
* :mod:`demo.world`: the world's folder (model, prompt files), and whether a complete one is there.
* :mod:`demo.build`: builds (once, then caches) the world.

``python -m demo`` builds the world and shows samples with their gold scores.
"""

from __future__ import annotations
