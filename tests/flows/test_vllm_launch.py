"""How the command starts the generation engine (``flows/vllm_engine.py``), without the engine: its options and
its environment follow the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.config import load_config
from flows.vllm_engine import _environment, server_arguments


def _config(world: dict[str, Path], *extra: str):
    return load_config(
        None,
        [
            f"model.policy={world['policy']}",
            f"data.prompts={world['prompts']}",
            f"data.eval_prompts={world['eval_prompts']}",
            "reward.source=function",
            "reward.function=tests.flows.rewards:length_score",
            "execution.device=cpu",
            *extra,
        ],
    )


@pytest.mark.parametrize(("compile_setting", "eager"), [("true", False), ("false", True)])
def test_the_engine_compiles_its_model_unless_told_not_to(llama_world, compile_setting, eager):
    config = _config(llama_world, f"execution.engine_compile={compile_setting}")
    arguments = server_arguments(config, str(llama_world["policy"]), 8100)
    assert ("--enforce-eager" in arguments) is eager


def test_the_engine_runs_on_the_stages_thread_count(llama_world, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    policy = str(llama_world["policy"])
    assert _environment(_config(llama_world, "execution.torch_threads=3"), policy)["OMP_NUM_THREADS"] == "3"
    # auto: one thread for a model under 20 M parameters (the tiny Llama), never the word "auto"
    assert _environment(_config(llama_world, "execution.torch_threads=auto"), policy)["OMP_NUM_THREADS"] == "1"
