"""GGUF files (llama.cpp, Ollama) as a model source: converted once into a Hugging Face folder.

``transformers`` reads a GGUF file through the ``gguf`` package and de-quantises its tensors to fp32
(``from_pretrained(folder, gguf_file=name)``); the tokenizer (and its chat template) comes from the
file's metadata the same way. Such a model cannot be saved as it is (``save_pretrained`` refuses a
model "quantized with gguf"), so :func:`convert_gguf` copies its weights into a model built from the
same config without the ``quantization_config`` and saves that, with the tokenizer, as a plain
folder: from there the model seam (:mod:`rlhf_core.loading`) reads it like any other. This module and
the seam are the only places that call ``from_pretrained``; no stage reads a GGUF file. The input checks
read a file's config and tokenizer before converting it (:func:`gguf_config`, :func:`gguf_tokenizer`: no
weights read), so a prompt the model cannot take is refused before the weights are de-quantised.

Choices:
1. The folder holds fp32 weights (the de-quantised values, exactly): training needs full-precision
   weights anyway, and ``precision`` decides what a stage holds them in.
2. The copy is built on the ``meta`` device and takes the de-quantised tensors as they are
   (``assign=True``): one copy of the weights in memory, not two.
3. Anything that goes wrong (not a GGUF file, a truncated one, an architecture ``transformers``
   cannot de-quantise) raises :class:`GgufError` with the reason in one line.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase


class GgufError(ValueError):
    """A GGUF file that cannot be converted; the message says why, in one line."""


def convert_gguf(file: str | Path, folder: str | Path) -> None:
    """Write the model and tokenizer of the GGUF ``file`` into ``folder`` as a Hugging Face checkpoint.

    Args:
        file: a ``.gguf`` file holding a causal LM (its tokenizer and chat template in its metadata).
        folder: where the checkpoint goes (created; the caller makes the write atomic).

    Raises:
        GgufError: the file cannot be read, or ``transformers`` cannot de-quantise its architecture.
    """
    file, folder = Path(file), Path(folder)
    try:
        with _progress_bar_as_configured():
            quantized = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    except Exception as error:  # noqa: BLE001 - a bad magic, a truncated tensor, an unknown architecture: one refusal
        raise GgufError(_first_line(error)) from error
    tokenizer = gguf_tokenizer(file)
    config = copy.deepcopy(quantized.config)
    del config.quantization_config  # what makes save_pretrained refuse
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = quantized.generation_config
    folder.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def gguf_config(file: str | Path) -> PretrainedConfig:
    """The model config in the GGUF ``file``'s metadata, as :func:`convert_gguf` saves it (no tensor is read).

    Raises:
        GgufError: the file cannot be read, or ``transformers`` does not know its architecture.
    """
    file = Path(file)
    try:
        return AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    except Exception as error:  # noqa: BLE001 - as in convert_gguf
        raise GgufError(_first_line(error)) from error


def gguf_tokenizer(file: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer (and chat template) in the GGUF ``file``'s metadata, as :func:`convert_gguf` saves it.

    Raises:
        GgufError: the file cannot be read, or ``transformers`` cannot build its tokenizer.
    """
    file = Path(file)
    try:
        return AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except Exception as error:  # noqa: BLE001 - as in convert_gguf
        raise GgufError(_first_line(error)) from error


@contextlib.contextmanager
def _progress_bar_as_configured() -> Iterator[None]:
    """transformers' GGUF reader draws a plain ``tqdm`` bar, deaf to its own ``disable_progress_bar()``; make it hear."""
    from transformers import modeling_gguf_pytorch_utils as reader
    from transformers.utils import logging as transformers_logging

    bar = reader.tqdm
    reader.tqdm = functools.partial(bar, disable=not transformers_logging.is_progress_bar_enabled())
    try:
        yield
    finally:
        reader.tqdm = bar


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
