"""Checks of a campaign's inputs before anything runs, so a bad file fails the command, not its fifth stage.

:func:`check_inputs` reads every input the stages will read, the way they will read it, and refuses
with an :class:`InputError` naming the setting, the file and, where it applies, the row and field:

1. The policy folder holds a readable ``config.json`` and readable weights (safetensors headers are
   parsed, which catches a truncated file), and the tokenizer loads and fits the model's vocabulary.
2. Every prompts, eval-prompts and preferences row parses (:mod:`storage.importers`, rows of bounded
   size), and each file holds enough rows: a prompt at least (every round's fresh prompts with
   ``sizes.decisive_pairs``), ``sizes.eval_prompts`` held-out prompts, and
   :data:`tasks.labelers.MIN_PREFERENCE_PAIRS` imported pairs.
3. Every prompt the stages will use fits the model's context with a full response: its tokens as the
   stages encode it (:func:`tasks.text.prompt_ids`: through the tokenizer's chat template for chat
   turns) plus ``sampling.max_new_tokens``, at most the model's ``max_position_embeddings``; every
   imported pair fits the reward model as it is scored (:func:`tasks.text.conversation_id_lists`, in the
   reward model's own tokens). Longer ones are refused, not truncated: a prompt cut short silently
   would train on something other than the file says. A row the chat template refuses (its
   ``raise_exception``, as templates that want alternating turns do) is refused naming the row.
4. The device exists on this machine and supports the precision (fp16 needs a GPU).
5. A reward function (``reward.function``) takes the columns of both prompt files and is called once
   (:func:`tasks.reward_function.check_reward_function`).

They come in three steps, cheapest first, so that a refusal waits only for what it needs:

* :func:`check_files` needs no model, tokenizer or device (every input exists, the model's ``config.json`` and
  context, every row parses, enough rows);
* :func:`check_tokens` needs the tokenizers and the models' ``config.json`` but no weights: the vocabulary, and
  every prompt and pair in tokens (3). The tokenisation rule is the stages' own (:mod:`tasks.text`), which with a
  generic fast tokenizer (SmolLM2's, every tokenizer built from a ``tokenizers.Tokenizer``) imports no torch, and
  neither does anything else here but for a model whose ``config.json`` does not state its context
  (``max_position_embeddings``; GPT-2's ``n_positions`` is read through ``AutoConfig``);
* :func:`check_models` needs torch: the device, the weights' headers, a reward head, the reward function.

``rlhf run`` makes the first two before it imports torch, MLflow or Prefect or starts a server, so those
refusals come in a second or two; :func:`check_inputs` makes the last two (the flows' own check).
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from campaign.config import PipelineConfig
from campaign.model_sources import gguf_config, gguf_tokenizer, is_gguf
from rlhf_core.config import MIN_PREFERENCE_PAIRS, eval_split_error
from rlhf_core.errors import UserError
from storage.importers import (
    ImportFormatError,
    import_sft_examples,
    preference_rows,
    prompt_rows,
    sft_example_rows,
)

if TYPE_CHECKING:  # check_files imports neither torch, transformers nor MLflow
    from runtime.context import BaseInputs

_BATCH = 256
_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model*.pt", "*.ckpt")
T = TypeVar("T")


class InputError(UserError, ValueError):
    """An input file or model the campaign cannot use; the message names the setting, file, row and field."""


def _batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _model_limits(setting: str, folder: Path) -> tuple[int | None, int | None]:
    """``(context length, vocabulary size)`` of a model folder, either None where its config does not say: as
    ``config.json`` states them (``max_position_embeddings``, ``vocab_size``), else as ``AutoConfig`` reads them
    (which imports torch; GPT-2 calls its context ``n_positions``). For a GGUF file not converted yet, as its
    conversion will write them (:func:`campaign.model_sources.gguf_config`).

    Raises:
        FileNotFoundError, InputError: see :func:`_config_of`.
        ModelSourceError: a GGUF file that cannot be converted.
    """
    if is_gguf(folder):
        config = gguf_config(setting, folder)
        return getattr(config, "max_position_embeddings", None), getattr(config, "vocab_size", None)
    settings = _config_of(setting, folder)
    context, vocabulary = (settings.get(key) for key in ("max_position_embeddings", "vocab_size"))
    if isinstance(context, int) and isinstance(vocabulary, int):
        return context, vocabulary
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except Exception as error:  # noqa: BLE001 - transformers raises OSError, ValueError or KeyError here
        raise InputError(f"`{setting}` {folder}: config.json cannot be read: {_first_line(error)}") from error
    return getattr(config, "max_position_embeddings", None), getattr(config, "vocab_size", None)


def _check_weights(setting: str, folder: Path) -> None:
    """Refuse a model folder without weights, or with a safetensors file whose header does not parse."""
    from safetensors import safe_open

    weights = sorted(path for pattern in _WEIGHT_FILES for path in folder.glob(pattern))
    if not weights:
        raise InputError(f"`{setting}` {folder} holds no weights (model.safetensors or pytorch_model.bin)")
    for path in weights:
        if path.suffix == ".safetensors":
            try:
                with safe_open(path, "pt"):
                    pass
            except Exception as error:  # noqa: BLE001 - safetensors raises its own SafetensorError
                raise InputError(f"`{setting}` {path} is not a readable safetensors file: {error}") from error


def _tokenizer(setting: str, folder: str):
    """The tokenizer of ``folder`` as the stages load it, its length warnings off (lengths are checked here).

    Raises:
        InputError: none loads.
    """
    from tasks.text import load_tokenizer

    if is_gguf(folder):  # not converted yet: as its conversion will save it
        tokenizer = gguf_tokenizer(setting, Path(folder))
        tokenizer.model_max_length = sys.maxsize
        return tokenizer
    try:
        tokenizer = load_tokenizer(folder)
    except Exception as error:  # noqa: BLE001 - a missing or malformed tokenizer raises anything from OSError to TypeError
        raise InputError(f"`{setting}` {folder}: no tokenizer loads: {_first_line(error)}") from error
    tokenizer.model_max_length = sys.maxsize
    return tokenizer


def _fits(setting: str, path: Path, row: int, field: str, needed: int, *, context: int | None, what: str) -> None:
    """Refuse a row needing ``needed`` positions (``what`` says how they add up) beyond the model's context."""
    if context is not None and needed > context:
        raise InputError(
            f"`{setting}` {path}, row {row}, field {field!r}: {what}, more than the model's context length "
            f"{context} (its `max_position_embeddings`); shorten or drop it"
        )


def _check_prompts(
    setting: str,
    path: Path,
    tokenizer,
    *,
    used: int | None,
    config: PipelineConfig,
    context: int | None,
    max_new_tokens: int,
) -> None:
    """Parse every row; count them; check that the first ``used`` (all: None) fit with a full response."""
    from jinja2 import TemplateError

    from tasks.text import Prompt, prompt_ids

    rows = 0
    try:
        for batch in _batched(prompt_rows(path), _BATCH):
            rows += len(batch)
            checked = batch if used is None else batch[: max(used - (rows - len(batch)), 0)]
            for row, record, text, messages in checked:
                field = "prompt" if record.get("prompt") is not None else "messages"
                try:
                    length = len(prompt_ids(tokenizer, Prompt(text, tuple(messages))))
                except TemplateError as error:
                    raise _template_refusal(setting, path, row, field, error) from error
                needed = length + max_new_tokens
                what = f"{length} prompt tokens + `sampling.max_new_tokens`={max_new_tokens} is {needed}"
                _fits(setting, path, row, field, needed, context=context, what=what)
    except ImportFormatError as error:
        raise InputError(f"`{setting}` {error}") from error
    _enough_prompts(setting, path, rows, config=config)


def _template_refusal(setting: str, path: Path, row: int, field: str, error: Exception) -> InputError:
    return InputError(
        f"`{setting}` {path}, row {row}, field {field!r}: the tokenizer's chat template refuses it: {_first_line(error)}"
    )


def _check_sft_examples(path: Path, tokenizer, *, context: int | None, packed_length: int | None) -> None:
    """Every SFT example tokenises as the SFT stage tokenises it (:func:`tasks.sft_text.tokenize_examples`: a
    conversation through the chat template, its assistant turns masked), has a token to learn and fits the context,
    and a packed row (``sft.packed_length``) whole."""
    from tasks.sft_text import ChatTemplateError, nothing_to_learn, tokenize_examples

    try:
        examples = tokenize_examples(tokenizer, import_sft_examples(path))
    except (ImportFormatError, ChatTemplateError) as error:
        raise InputError(f"`sft.data` {path}: {_first_line(error)}") from error
    if (empty := nothing_to_learn(examples)) is not None:
        raise InputError(f"`sft.data` {path}, row {empty + 1}: no token for the model to learn")
    for row, example in enumerate(examples, start=1):
        tokens = len(example.input_ids)
        _fits(
            "sft.data", path, row, "example", tokens, context=context, what=f"{tokens} tokens as the SFT stage reads it"
        )
        if packed_length is not None and tokens > packed_length:
            raise InputError(
                f"`sft.data` {path}, row {row}: {tokens} tokens, more than `sft.packed_length` {packed_length} (an "
                "example is packed whole, never split); raise it, or leave it unset for the longest example"
            )


def _enough_prompts(setting: str, path: Path, rows: int, *, config: PipelineConfig) -> None:
    """Refuse a prompts file with fewer rows than ``config`` uses: ``sizes.eval_prompts`` held-out prompts; a training
    prompt at least (the rotation wraps around), or with ``sizes.decisive_pairs`` every round's fresh prompts."""
    sizes = config.sizes
    if setting == "data.eval_prompts":
        at_least, wanted = sizes.eval_prompts, f"; `sizes.eval_prompts` asks for {sizes.eval_prompts}"
    elif sizes.decisive_pairs is not None:
        at_least = sizes.max_rounds * sizes.preference_prompts
        wanted = (
            f"; `sizes.max_rounds` {sizes.max_rounds} rounds of `sizes.preference_prompts` {sizes.preference_prompts} "
            f"fresh prompts (`sizes.decisive_pairs`) need {at_least}: lower one of them"
        )
    else:
        at_least, wanted = 1, ""
    if rows < at_least:
        raise InputError(f"`{setting}` {path} holds {rows or 'no'} prompts{wanted}")


class _PairsNeeded(NamedTuple):
    """What reads the imported pairs, and how many it needs: a reward model trained on them (with its held-out
    split), one used as it is, or a DPO update (which trains the policy on them, as the policy reads them)."""

    reader: str
    at_least: int
    eval_fraction: float | None

    @classmethod
    def of(cls, config: PipelineConfig) -> _PairsNeeded:
        if config.update == "dpo":
            return cls("the DPO update", 1, None)
        if config.reward_model.train:
            return cls("the reward model", MIN_PREFERENCE_PAIRS, config.reward_model.eval_fraction)
        return cls("the reward model", 1, None)


def _check_preferences(setting: str, path: Path, tokenizer, *, context: int | None, needed: _PairsNeeded) -> None:
    """Parse every pair; count them; check that each fits the model that reads it (the reward model, or the policy
    of a DPO update) as it is scored."""
    from jinja2 import TemplateError

    from tasks.text import Prompt, conversation_id_lists

    pairs = 0
    try:
        for batch in _batched(preference_rows(path), _BATCH):
            pairs += len(batch)
            prompts = [Prompt(prompt, tuple(messages)) for _, prompt, messages, *_ in batch]
            responses = [chosen for *_, chosen, _, _ in batch] + [rejected for *_, rejected, _ in batch]
            try:
                lengths = [len(ids) for ids in conversation_id_lists(tokenizer, prompts + prompts, responses)]
            except TemplateError:  # which pair: each alone
                for index, (row, *_) in enumerate(batch):
                    for field, response in (("chosen", responses[index]), ("rejected", responses[len(batch) + index])):
                        try:
                            conversation_id_lists(tokenizer, [prompts[index]], [response])
                        except TemplateError as error:
                            raise _template_refusal(setting, path, row, field, error) from error
                raise
            for index, (row, *_) in enumerate(batch):
                for field, tokens in (("chosen", lengths[index]), ("rejected", lengths[len(batch) + index])):
                    what = f"{tokens} tokens with its prompt, as {needed.reader} reads it"
                    _fits(setting, path, row, field, tokens, context=context, what=what)
    except ImportFormatError as error:
        raise InputError(f"`{setting}` {error}") from error
    _enough_pairs(setting, path, pairs, needed)


def _enough_pairs(setting: str, path: Path, pairs: int, needed: _PairsNeeded) -> None:
    if pairs < needed.at_least:
        raise InputError(
            f"`{setting}` {path} holds {pairs or 'no'} preference pairs; {needed.reader} needs at least "
            f"{needed.at_least}"
        )
    if needed.eval_fraction is not None and (error := eval_split_error(pairs, needed.eval_fraction)) is not None:
        raise InputError(f"`{setting}` {path}: {error}")


def _found_later(model: str) -> bool:
    """Whether a model setting names a hub model (``org/name``, no such path), as :mod:`campaign.identity` reads it,
    or a file in a package (``pkg:``, :mod:`campaign.model_sources`): either is found later."""
    if model.startswith("pkg:"):
        return True
    return not Path(model).exists() and not model.startswith(("/", ".", "~")) and model.count("/") == 1


def _config_of(setting: str, folder: Path) -> dict:
    """A model folder's ``config.json``, read as JSON (no transformers).

    Raises:
        FileNotFoundError: no such folder, or no ``config.json`` in it.
        InputError: ``config.json`` is not a JSON object.
    """
    if not folder.exists():
        raise FileNotFoundError(f"`{setting}` folder {folder} does not exist")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"`{setting}` folder {folder} has no config.json: not a Hugging Face checkpoint")
    try:
        settings = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"`{setting}` {folder}: config.json cannot be read: {_first_line(error)}") from error
    if not isinstance(settings, dict):
        raise InputError(f"`{setting}` {folder}: config.json cannot be read: not a JSON object")
    return settings


def check_files(config: PipelineConfig) -> None:
    """What can be refused before any model, tokenizer, MLflow or Prefect is loaded (see the module docstring):
    every input exists, the policy's ``config.json`` reads and its context leaves room for
    ``sampling.max_new_tokens``, every prompts, eval-prompts and preferences row parses and each file holds enough
    rows. Inputs the demo world provides and hub names are left to :func:`check_inputs`.

    Raises:
        FileNotFoundError: an input does not exist.
        InputError: the first other problem found.
    """
    models = {"model.policy": config.model.policy, "model.tokenizer": config.model.tokenizer}
    models["model.reward_model"] = config.model.reward_model
    files = {"data.prompts": config.data.prompts, "data.eval_prompts": config.data.eval_prompts}
    if config.labeler == "import":
        files["data.preferences"] = config.data.preferences
    files["sft.data"] = config.sft.data
    for setting, model in models.items():
        if model is not None and not _found_later(model) and not Path(model).exists():
            raise FileNotFoundError(f"`{setting}` folder {model} does not exist")
    for setting, path in files.items():
        if path is not None and not path.exists():
            raise FileNotFoundError(f"`{setting}` {path} does not exist")
    policy, max_new_tokens = config.model.policy, config.sampling.max_new_tokens
    if policy is not None and not _found_later(policy) and not policy.lower().endswith(".gguf"):
        context = _config_of("model.policy", Path(policy)).get("max_position_embeddings")
        if isinstance(context, int) and max_new_tokens >= context:
            raise InputError(
                f"`sampling.max_new_tokens`={max_new_tokens} leaves no room for a prompt in the model's context "
                f"length {context}"
            )
    try:
        for setting, path in files.items():
            if path is None:
                continue
            if setting == "sft.data":
                sum(1 for _ in sft_example_rows(path))  # every row parses (an assistant turn in each conversation)
            elif setting == "data.preferences":
                _enough_pairs(setting, path, sum(1 for _ in preference_rows(path)), _PairsNeeded.of(config))
            else:
                _enough_prompts(setting, path, sum(1 for _ in prompt_rows(path)), config=config)
    except ImportFormatError as error:
        raise InputError(f"`{setting}` {error}") from error


def _check_shardable(setting: str, folder: Path, config: PipelineConfig) -> None:
    """Refuse a model that FSDP cannot shard layer by layer (no transformer layer class to wrap): its backbone,
    which every trained model has, is built on the meta device (no memory, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModel

    from rlhf_core.distributed import layer_classes_of

    sharding = config.execution.sharding
    assert sharding is not None
    with torch.device("meta"):
        backbone = AutoModel.from_config(AutoConfig.from_pretrained(folder))
    try:
        layer_classes_of(backbone, sharding.layer_classes)
    except ValueError as error:
        raise InputError(
            f"`execution.accelerate_config` {config.execution.accelerate_config} with `{setting}` {folder}: {error}"
        ) from None


def check_tokens(config: PipelineConfig, base: BaseInputs) -> None:
    """What needs the tokenizers and the models' ``config.json`` but no weights (module docstring): the tokenizer
    fits the policy's vocabulary, ``sampling.max_new_tokens`` leaves room in its context, and every prompt and
    imported pair fits, in tokens as the stages encode them. Imports no torch for a model whose ``config.json``
    states its context and a generic fast tokenizer (:mod:`storage.tokenizers`).

    Raises:
        InputError: the first problem found.
    """
    context, vocabulary = _model_limits("model.policy", Path(base.policy.path))
    tokenizer_setting = "model.tokenizer" if config.model.tokenizer else "model.policy"
    tokenizer = _tokenizer(tokenizer_setting, base.tokenizer.path)
    if vocabulary is not None and len(tokenizer) > vocabulary:
        raise InputError(
            f"`{tokenizer_setting}` {base.tokenizer.path}: the tokenizer has {len(tokenizer)} tokens, more than the "
            f"model's vocabulary of {vocabulary}"
        )
    max_new_tokens = config.sampling.max_new_tokens
    if context is not None and max_new_tokens >= context:
        raise InputError(
            f"`sampling.max_new_tokens`={max_new_tokens} leaves no room for a prompt in the model's context "
            f"length {context}"
        )
    _check_prompts(
        "data.prompts", Path(base.prompts.path), tokenizer,
        used=None, config=config, context=context, max_new_tokens=max_new_tokens,
    )  # fmt: skip
    _check_prompts(
        "data.eval_prompts", Path(base.eval_prompts.path), tokenizer,
        used=config.sizes.eval_prompts, config=config, context=context, max_new_tokens=max_new_tokens,
    )  # fmt: skip
    if base.sft_data is not None:
        _check_sft_examples(
            Path(base.sft_data.path), tokenizer, context=context, packed_length=config.sft.packed_length
        )
    if base.preferences is not None:
        reward_context, reward_tokenizer = context, tokenizer
        if base.reward_model is not None:
            reward_tokenizer = _tokenizer("model.reward_model", base.reward_tokenizer)
            if is_gguf(base.reward_model.path) or (Path(base.reward_model.path) / "config.json").is_file():
                reward_context, _ = _model_limits("model.reward_model", Path(base.reward_model.path))
        _check_preferences(
            "data.preferences", Path(base.preferences.path), reward_tokenizer, context=reward_context,
            needed=_PairsNeeded.of(config),
        )  # fmt: skip


def check_models(config: PipelineConfig, base: BaseInputs) -> None:
    """What needs torch (module docstring): the device and precision, the weights' headers, a reward model's head,
    the reward function called once, a model FSDP can shard. Assumes :func:`check_tokens` passed.

    Raises:
        InputError: the first problem found.
        RewardFunctionError: the reward function cannot be called with the prompts' columns, or raises.
    """
    from rlhf_core.loading import has_reward_head
    from rlhf_core.precision import resolve_device
    from tasks.reward_function import check_reward_function
    from tasks.text import load_tokenizer, prompt_text, read_prompts

    try:
        device = resolve_device(config.execution.device)
    except ValueError as error:
        raise InputError(str(error)) from error
    if config.precision == "fp16" and device.type != "cuda":
        raise InputError(
            f"`precision` fp16 needs a CUDA device; `execution.device` {config.execution.device} runs on the CPU: "
            "use bf16 or fp32"
        )
    _check_weights("model.policy", Path(base.policy.path))
    if base.preferences is not None and base.reward_model is not None:  # what scores the imported pairs
        if (Path(base.reward_model.path) / "config.json").is_file():
            _check_weights("model.reward_model", Path(base.reward_model.path))
    if config.labeler == "reward_model" and config.learns_from_labels and base.reward_model is not None:
        if not has_reward_head(base.reward_model.path):
            raise InputError(
                f"`model.reward_model` {config.model.reward_model} has no reward head, so it cannot label the first "
                "iteration's pairs (labeler reward_model): give a sequence-classification checkpoint with one label "
                "or a reward model this project exported, or label with import or human"
            )
    for function in filter(None, (base.reward_function, base.rubric)):
        tokenizer = load_tokenizer(base.tokenizer.path)
        samples = [
            (setting, prompt, prompt_text(tokenizer, prompt))
            for setting, path in (("data.prompts", base.prompts.path), ("data.eval_prompts", base.eval_prompts.path))
            for prompt in read_prompts(path)[:1]
        ]
        check_reward_function(function, samples)
    if config.execution.sharding is not None:
        _check_shardable("model.policy", Path(base.policy.path), config)
        if base.reward_model is not None and config.reward_model.train:
            _check_shardable("model.reward_model", Path(base.reward_model.path), config)


def check_inputs(config: PipelineConfig, base: BaseInputs) -> None:
    """Refuse inputs the stages could not use (see the module docstring); reads them, changes nothing.

    Raises:
        InputError: the first problem found.
        RewardFunctionError: the reward function cannot be called with the prompts' columns, or raises.
    """
    check_tokens(config, base)
    check_models(config, base)
