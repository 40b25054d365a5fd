"""Saved tokenizers, loaded as the class they were saved as: the one way every stage and check reads a tokenizer folder.

Choices:

1. A generic fast tokenizer (``tokenizer_class`` ``TokenizersBackend`` / ``PreTrainedTokenizerFast``: one built in
   code from a ``tokenizers.Tokenizer``, or converted from a GGUF file, :mod:`rlhf_core.gguf`) is loaded with
   ``PreTrainedTokenizerFast`` directly: transformers 5 would build the model family's own class when a
   ``config.json`` sits beside it (a Qwen2 BPE over a word-level vocabulary tokenizes everything to nothing).
2. That class imports no torch (``AutoTokenizer`` does: its model configs import it), so the input checks
   tokenise every prompt before torch is imported (:mod:`flows.inputs`) and a refusal does not wait for it.
   Any other class goes through ``AutoTokenizer``, as saved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(directory: Path, **kwargs: Any) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(directory, **kwargs)``, but a generic fast tokenizer as itself (module
    docstring)."""
    directory = Path(directory)
    config_file = directory / "tokenizer_config.json"
    saved_class = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.is_file() else None
    if saved_class in _GENERIC_TOKENIZERS:
        return PreTrainedTokenizerFast.from_pretrained(directory, **kwargs)
    from transformers import AutoTokenizer  # imports torch

    return AutoTokenizer.from_pretrained(directory, **kwargs)
