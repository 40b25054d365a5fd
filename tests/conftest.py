"""Shared fixtures: tiny random-init transformers built in code (never from a hub), one torch thread."""

from __future__ import annotations

import os
import tempfile

# Prefect and MLflow must never touch the user's own stores from a test, and there is no network:
# set this before anything imports prefect.
_PREFECT_HOME = tempfile.mkdtemp(prefix="rlhf-tests-prefect-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = os.path.join(_PREFECT_HOME, "results")
os.environ["MLFLOW_TRACKING_URI"] = "sqlite:///" + os.path.join(_PREFECT_HOME, "mlflow-guard.db")
# The pipeline's own cache (an empty migrated MLflow store, storage.mlflow_store.cache_dir) in the same temporary
# folder: made once per test process and shared with the commands the tests start, never the user's.
os.environ["RLHF_CACHE_DIR"] = os.path.join(_PREFECT_HOME, "rlhf-cache")
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
os.environ["DO_NOT_TRACK"] = "true"
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

# Small models on 2 shared cores run several times faster on one thread (see bench/).
torch.set_num_threads(1)

TINY_VOCAB = 32
PAD, BOS, EOS = 0, 1, 2


def tiny_config(arch: str, *, vocab_size: int = TINY_VOCAB, hidden: int = 32, layers: int = 2) -> PretrainedConfig:
    """A tiny decoder config of the named family, with dropout off so results are deterministic."""
    common = dict(vocab_size=vocab_size, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    if arch == "gpt2":
        return GPT2Config(
            n_positions=128,
            n_embd=hidden,
            n_layer=layers,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
    llama_like = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        **common,
    )
    if arch == "llama":
        return LlamaConfig(**llama_like)
    if arch == "qwen2":
        return Qwen2Config(**llama_like)
    raise ValueError(arch)


ARCHITECTURES = ["gpt2", "llama", "qwen2"]


@pytest.fixture(params=ARCHITECTURES)
def arch(request) -> str:
    return request.param


def tiny_causal_lm(arch: str, *, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **kwargs))


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists with PAD. Shapes: returns (B, P) ids and (B, P) mask."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[PAD] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BPE_CORPUS = ["the cat is happy .", "a dog is sad .", "tell me a joke", "why did the chicken cross the road"] * 20


def byte_level_bpe(
    *, vocab_size: int = 300, template: str | None = CHATML, corpus: list[str] | None = None
) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here (no hub), with ChatML special tokens and, optionally, a chat template."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(corpus or BPE_CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>")
    tokenizer.padding_side = "left"
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="session")
def two_processes(tmp_path_factory):
    """The folder of the test run's one ``accelerate launch`` of 2 processes (:mod:`tests.two_processes`)."""
    from tests.two_processes import launched_once

    return launched_once(tmp_path_factory)


LONGEST_FIRST = (
    "tests/flows/test_bad_inputs.py",
    "tests/flows/test_human_labels.py",
    "tests/flows/test_overlap.py",
    "tests/flows/test_prefect_server.py",
    "tests/flows/test_history.py",
    "tests/flows/test_rlhf_pipeline.py",
    "tests/flows/test_inspect.py",
    "tests/flows/test_estimators.py",
    "tests/flows/test_hardware.py",
    "tests/rlhf_core/test_distributed.py",
    "tests/flows/test_models_users_bring.py",
    "tests/flows/test_tracking_server.py",
    "tests/flows/test_resume.py",
    "tests/flows/test_gc.py",
)
"""The test files that take longest (seconds per module in bench/TEST_DURATIONS.md), run first: the README's test
command hands whole files to its workers in the order collected, and a long file handed out last ran alone while the
other workers idled (issue 41). Every other file keeps its place after them."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: place for place, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(LONGEST_FIRST)))
