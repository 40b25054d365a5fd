"""Flow-test fixtures: one Prefect test server per session, and a Hugging Face checkpoint folder
saved by the test itself (a tiny random GPT-2 with the demo's word-level tokenizer)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from demo.corpus import generate_prompts
from demo.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer
from tests.flows.campaigns import one_iteration_campaign, two_iteration_campaign  # noqa: F401 (fixtures)
from tests.once import built_once


def flow_runs_in_state(state: str, **filters: Any):
    """A Prefect ``FlowRunFilter`` for the flow runs in state type ``state`` (``"RUNNING"``, ``"PAUSED"``, ...),
    narrowed by further ``FlowRunFilter`` fields (``tags=``, ``start_time=``)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType

    return FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[state])), **filters)


@pytest.fixture(scope="session")
def prefect_server():
    """A temporary Prefect server (its own SQLite database) for the whole session; its flow runs send no
    heartbeats, as the ``rlhf`` commands' flows on a temporary server do (flows.prefect_server.flow_settings)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with (
        prefect_test_harness(server_startup_timeout=180),
        temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}),
    ):
        yield


def _world_files(root: Path) -> dict[str, Path]:
    return {"policy": root / "policy", "prompts": root / "prompts.jsonl", "eval_prompts": root / "eval_prompts.jsonl"}


def _write_world(root: Path, model_config: Callable[[int], Any]) -> dict[str, Path]:
    """A checkpoint folder (a random model from ``model_config(vocab_size)`` and the demo's word-level tokenizer),
    training prompts and held-out prompts, as a user would have them."""
    train, held_out = generate_prompts(48, 16, seed=3)
    words = sorted(
        {word for prompt in train + held_out for word in prompt.split()} | {".", "happy", "sad", "warm", "cold"}
    )
    tokenizer = build_tokenizer(words)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(len(tokenizer)))
    model.save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")
    for name, prompts in (("prompts.jsonl", train), ("eval_prompts.jsonl", held_out)):
        (root / name).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return _world_files(root)


@pytest.fixture(scope="session")
def checkpoint_world(tmp_path_factory) -> dict[str, Path]:
    """A tiny random GPT-2 checkpoint folder, training prompts and held-out prompts, as a user would have them; one
    for the whole test run (every worker's), as the shared campaigns built on it name its paths (tests.flows.campaigns).
    """

    def gpt2(vocab_size: int) -> GPT2Config:
        return GPT2Config(
            vocab_size=vocab_size,
            n_positions=64,
            n_embd=32,
            n_layer=2,
            n_head=2,
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
        )

    return _world_files(built_once(tmp_path_factory, "hf-world", lambda folder: _write_world(folder, gpt2)))


EPISODE_PROMPTS = [
    {"prompt": "Guess my number.", "high": 4},
    {"prompt": "Find it.", "high": 4},
    {"prompt": "Guess again.", "high": 4, "raise_at": 2},  # Faulty: its second step raises
    {"prompt": "Start.", "high": 4, "reset": "number"},  # Faulty: its reset breaks the contract
]
"""The prompts of episode campaigns (tests/environments.py's scripted environments read their columns)."""


@pytest.fixture(scope="session")
def episode_world(tmp_path_factory) -> dict[str, Path]:
    """A tiny Qwen2 chat policy (byte-level BPE, ChatML) and prompts with the environment's columns."""
    return write_episode_world(tmp_path_factory.mktemp("episode-world"))


def write_episode_world(root: Path, *, hidden: int = 32) -> dict[str, Path]:
    """:func:`episode_world` in ``root``, its policy ``hidden`` wide (2 heads: 128 for vLLM's CPU build, which refuses
    head size 16)."""
    from tests.conftest import byte_level_bpe, tiny_config

    corpus = [p["prompt"] for p in EPISODE_PROMPTS] + ["I am thinking of a number from 1 to 4. Higher. Lower. 1 2 3 4"]
    tokenizer = byte_level_bpe(vocab_size=400, corpus=corpus * 20)
    config = tiny_config("qwen2", vocab_size=len(tokenizer), hidden=hidden)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id, None
    config.max_position_embeddings = 512
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")
    (root / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in EPISODE_PROMPTS))
    return {"policy": root / "policy", "prompts": root / "prompts.jsonl"}


def episode_overrides(world: dict[str, Path], run_root: Path, *more: str) -> list[str]:
    """The settings of a tiny episode campaign on ``world`` (:func:`episode_world`), then ``more``: 4 prompts of 2
    episodes of up to 3 turns of 6 tokens, scored by the environment; `environment.class` is the caller's."""
    return [
        f"run_root={run_root}",
        "demo=false",
        "labeler=null",
        f"model.policy={world['policy']}",
        f"data.prompts={world['prompts']}",
        f"data.eval_prompts={world['prompts']}",
        "reward.source=environment",
        "environment.max_turns=3",
        "environment.max_tokens_per_turn=6",
        "environment.step_timeout_s=20",
        "sizes.rollout_prompts=4",
        "sizes.samples_per_prompt=2",
        "sizes.eval_prompts=4",
        "sampling.batch_size=8",
        *more,
    ]


@pytest.fixture(scope="session")
def chat_world(tmp_path_factory) -> dict[str, Path]:
    """A Qwen2 chat policy with a byte-level BPE and a ChatML template, chat prompts, and a pretrained
    `AutoModelForSequenceClassification` reward model (Llama) whose own tokenizer (another BPE, no
    template) differs from the policy's."""
    from transformers import AutoModelForSequenceClassification

    from tests.conftest import byte_level_bpe, tiny_config

    root = tmp_path_factory.mktemp("chat-world")
    train, held_out = generate_prompts(48, 16, seed=5)
    corpus = train + held_out
    policy_tokenizer = byte_level_bpe(vocab_size=400, corpus=corpus)
    torch.manual_seed(0)
    config = tiny_config("qwen2", vocab_size=len(policy_tokenizer))
    config.pad_token_id = policy_tokenizer.pad_token_id
    config.eos_token_id = policy_tokenizer.eos_token_id
    config.bos_token_id = None
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "policy")
    policy_tokenizer.save_pretrained(root / "policy")
    reward_tokenizer = byte_level_bpe(vocab_size=350, template=None, corpus=corpus)
    reward_config = tiny_config("llama", vocab_size=len(reward_tokenizer))
    reward_config.num_labels = 1
    reward_config.pad_token_id = reward_tokenizer.pad_token_id
    AutoModelForSequenceClassification.from_config(reward_config).save_pretrained(root / "reward_model")
    reward_tokenizer.save_pretrained(root / "reward_model")
    same_config = tiny_config("qwen2", vocab_size=len(policy_tokenizer))
    same_config.num_labels = 1
    same_config.pad_token_id = policy_tokenizer.pad_token_id
    AutoModelForSequenceClassification.from_config(same_config).save_pretrained(root / "reward_model_policy_tokens")
    policy_tokenizer.save_pretrained(root / "reward_model_policy_tokens")
    for name, prompts in (("prompts.jsonl", train), ("eval_prompts.jsonl", held_out)):
        rows = [{"messages": [{"role": "user", "content": prompt}]} for prompt in prompts]
        (root / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {
        "policy": root / "policy",
        "reward_model": root / "reward_model",
        "reward_model_policy_tokens": root / "reward_model_policy_tokens",
        "prompts": root / "prompts.jsonl",
        "eval_prompts": root / "eval_prompts.jsonl",
    }


@pytest.fixture(scope="session")
def llama_world(tmp_path_factory) -> dict[str, Path]:
    """:func:`checkpoint_world` with a tiny random Llama (head size 64, which vLLM's CPU build serves; the GPT-2s
    here have head size 16, which it refuses), and the demo's word-level tokenizer."""
    from transformers import LlamaConfig

    return _write_world(
        tmp_path_factory.mktemp("llama-world"),
        lambda vocab_size: LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
        ),
    )


def prefect_events(*names: str, resource_prefix: str = "", expect: int = 1, timeout: float = 60) -> list:
    """The events named ``names`` (prefixes) about resources whose id starts with ``resource_prefix`` that the Prefect
    server holds, once it holds at least ``expect`` of them (events reach its database in batches), oldest first."""
    import time
    from datetime import UTC, datetime, timedelta

    from prefect import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    deadline = time.monotonic() + timeout
    while True:
        event_filter = EventFilter(
            occurred=EventOccurredFilter(since=datetime.now(UTC) - timedelta(days=1), until=datetime.now(UTC)),
            event=EventNameFilter(prefix=list(names)),
            resource=EventResourceFilter(id_prefix=[resource_prefix]) if resource_prefix else None,
        )
        with get_client(sync_client=True) as client:
            page = client.read_events(filter=event_filter, limit=50)
            events = list(page.events)
            while page.next_page is not None:
                page = client.read_events_page(page.next_page)
                events += page.events
        if len(events) >= expect or time.monotonic() > deadline:
            return sorted(events, key=lambda event: event.occurred)
        time.sleep(0.5)


def _tied_llama(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )  # fmt: skip


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """The engine fault tests' worlds (tests/flows/test_engine_faults*.py): the same tied Llama (the demo's word-level tokenizer, its prompts), saved in bf16 (as most hub checkpoints)
    and in fp32."""
    found = {}
    for dtype in ("bf16", "fp32"):
        world = _write_world(tmp_path_factory.mktemp(f"tied-{dtype}"), _tied_llama)
        if dtype == "bf16":
            model = AutoModelForCausalLM.from_pretrained(world["policy"], dtype=torch.float32)
            model.to(torch.bfloat16).save_pretrained(world["policy"])
        found[dtype] = world
    return found
