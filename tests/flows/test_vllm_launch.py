"""How the command starts the generation engine (``runtime/engine.py``) and what its server computes without
vLLM (``engine_server/server.py``): its options and environment follow the config; a merged LoRA adapter is peft's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from campaign.config import load_config
from engine_server.server import merged_lora_weights, read_tensors
from runtime.engine import _environment, server_arguments


def _arguments(config, policy: str) -> list[str]:
    lora = config.model.lora
    return server_arguments(
        config.execution,
        precision=config.precision,
        lora_rank=None if lora is None else lora.r,
        policy=policy,
        port=8100,
    )


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
    arguments = _arguments(config, str(llama_world["policy"]))
    assert ("--enforce-eager" in arguments) is eager


def test_the_engine_runs_on_the_stages_thread_count(llama_world, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    policy = str(llama_world["policy"])
    assert _environment(_config(llama_world, "execution.torch_threads=3").execution, policy)["OMP_NUM_THREADS"] == "3"
    # auto: one thread for a model under 20 M parameters (the tiny Llama), never the word "auto"
    assert (
        _environment(_config(llama_world, "execution.torch_threads=auto").execution, policy)["OMP_NUM_THREADS"] == "1"
    )


@pytest.mark.parametrize(("mode", "served"), [("auto", "merge"), ("merge", "merge"), ("request", "request")])
def test_lora_policies_are_merged_on_a_cpu_unless_told_otherwise(llama_world, mode, served):
    config = _config(llama_world, "model.lora.r=8", f"execution.engine_lora={mode}")
    arguments = _arguments(config, str(llama_world["policy"]))
    assert arguments[arguments.index("--lora-mode") + 1] == served
    assert ("--max-lora-rank" in arguments) is (served == "request")  # vLLM's LoRA layers only where they serve


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_a_merged_adapter_equals_peft_merge_and_unload(architecture, tmp_path):
    """The engine's merge (``W + alpha / r * B @ A``, transposed for GPT-2's Conv1D) gives peft's merged weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    config = (
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
        if architecture == "llama"
        else GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    base.save_pretrained(tmp_path / "base")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=16, target_modules="all-linear"))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: give the update something to add
            torch.nn.init.normal_(parameter, std=0.1)
    model.save_pretrained(tmp_path / "adapter")
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    merged = merged_lora_weights(
        read_tensors(str(tmp_path / "base")),
        load_file(tmp_path / "adapter" / "adapter_model.safetensors"),
        adapter_config,
    )
    expected = model.merge_and_unload().state_dict()
    changed = 0
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
        changed += not torch.equal(tensor, read_tensors(str(tmp_path / "base"))[name])
    assert changed == 2 * (7 if architecture == "llama" else 4)  # every adapted layer of both blocks moved


def test_an_adapter_a_merge_does_not_cover_is_refused():
    with pytest.raises(ValueError, match="use_dora"):
        merged_lora_weights({}, {}, {"r": 8, "lora_alpha": 16, "use_dora": True})
