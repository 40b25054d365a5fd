"""How the command starts the generation engine (``runtime/engine.py``) and what its server computes without
vLLM (``engine_server/server.py``): its options and environment follow the config; a merged LoRA adapter is peft's
on an fp32 base, and the trainer's exact fp32 sum on a bf16 one (issue 36); what a merge cannot consume is refused;
a swap that fails midway leaves the engine naming no weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from campaign.config import load_config
from engine_server.server import Engine, merged_lora_weights, read_tensors
from runtime.engine import EngineStartError, _environment, server_arguments


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
    execution = _config(llama_world, "execution.torch_threads=3").execution
    assert _environment(execution, policy, None)["OMP_NUM_THREADS"] == "3"
    assert _environment(execution, policy, 2)["OMP_NUM_THREADS"] == "2"  # the command's count where it has one
    # auto: one thread for a model under 20 M parameters (the tiny Llama), never the word "auto"
    automatic = _config(llama_world, "execution.torch_threads=auto").execution
    assert _environment(automatic, policy, None)["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize(
    ("mode", "precision", "served"),
    [
        ("auto", "fp32", "merge"),
        ("merge", "fp32", "merge"),
        ("request", "fp32", "request"),
        ("auto", "bf16", "request"),
    ],
)
def test_lora_policies_are_merged_on_a_cpu_in_fp32_unless_told_otherwise(llama_world, mode, precision, served):
    config = _config(llama_world, "model.lora.r=8", f"execution.engine_lora={mode}", f"precision={precision}")
    arguments = _arguments(config, str(llama_world["policy"]))
    assert arguments[arguments.index("--lora-mode") + 1] == served
    assert ("--max-lora-rank" in arguments) is (served == "request")  # vLLM's LoRA layers only where they serve


def test_issue36_a_merge_into_a_bf16_engine_is_refused_in_one_line(llama_world):
    config = _config(llama_world, "model.lora.r=8", "execution.engine_lora=merge", "precision=bf16")
    with pytest.raises(EngineStartError, match=r"`execution.engine_lora` merge .* bf16 engine") as refused:
        _arguments(config, str(llama_world["policy"]))
    assert refused.value.exit_code == 2 and "\n" not in str(refused.value)


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
        dtype=torch.float32,
    )
    expected = model.merge_and_unload().state_dict()
    changed = 0
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
        changed += not torch.equal(tensor, read_tensors(str(tmp_path / "base"))[name])
    assert changed == 2 * (7 if architecture == "llama" else 4)  # every adapted layer of both blocks moved


def test_an_adapter_a_merge_does_not_cover_is_refused():
    with pytest.raises(ValueError, match="use_dora"):
        merged_lora_weights({}, {}, {"r": 8, "lora_alpha": 16, "use_dora": True}, dtype=None)


def _bf16_base_and_adapter(tmp_path: Path, *, b_scale: float, attention_bias: bool = False, **lora):
    """A tiny Llama saved in bf16 (as most hub checkpoints are), and a peft LoRA over it as the trainer holds it in
    fp32 (the loader upcasts the frozen base under `precision` fp32), its B drawn around ``b_scale``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        tie_word_embeddings=False, attention_bias=attention_bias,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "base")
    trainer = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    options = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "up_proj"], **lora}
    model = get_peft_model(trainer, LoraConfig(**options))
    generator = torch.Generator().manual_seed(1)
    for name, parameter in model.named_parameters():
        if "lora_" in name:  # a trained adapter: B (and any bias) around b_scale, A left as peft drew it
            with torch.no_grad():
                if "lora_A" in name and "embedding" not in name:
                    continue
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * b_scale)
    model.save_pretrained(tmp_path / "adapter", save_embedding_layers=False)  # as rlhf_core.loading saves one
    return model


def test_issue36_a_bf16_base_merged_for_an_fp32_engine_is_the_trainers_exact_sum(tmp_path):
    """r 8, alpha 16, B ~ 1e-4 on a bf16 base: the update is below half a bf16 ulp of most weights (|W| ~ 0.02, ulp
    ~ 1.2e-4), so a merge in bf16 loses most of it; summed in fp32 for an fp32 engine, the merged weights are the
    peft model's own W.float() + 2 B @ A (to fp32 rounding), and a model built from them gives the peft model's
    unmerged fp32 logits."""
    import torch
    from transformers import AutoModelForCausalLM

    model = _bf16_base_and_adapter(tmp_path, b_scale=1e-4)
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    base, adapter = read_tensors(str(tmp_path / "base")), read_tensors(str(tmp_path / "adapter"))
    merged = merged_lora_weights(base, adapter, adapter_config, dtype=torch.float32)
    lost = 0
    for layer in range(2):
        for module in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj"):
            name = f"model.layers.{layer}.{module}.weight"
            peft_layer = model.get_submodule(f"base_model.model.{name.removesuffix('.weight')}")
            expected = (
                peft_layer.base_layer.weight + 2.0 * peft_layer.lora_B.default.weight @ peft_layer.lora_A.default.weight
            )
            assert merged[name].dtype == torch.float32
            torch.testing.assert_close(merged[name], expected.detach(), rtol=0, atol=1e-7, msg=name)
            update = expected.detach() - base[name].float()
            rounded = (base[name] + update.to(torch.bfloat16)).float() - base[name].float()  # the old merge, in bf16
            lost += int(((rounded - update).abs() > 0.5 * update.abs()).sum())
    assert lost > 0.5 * 6 * 64 * 64  # the bf16 merge drops more than half of the entries' updates: what it fixes
    unmerged = model.eval()
    engine = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    engine.load_state_dict({name: tensor.float() for name, tensor in merged.items()})
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(engine(tokens).logits, unmerged(tokens).logits, rtol=0, atol=1e-5)
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()(tokens).logits
    assert (plain - unmerged(tokens).logits).abs().max() > 1e-5  # the update shows in the logits at all


def test_issue36_the_merge_writes_the_engines_dtype():
    import torch

    base = {"layer.weight": torch.ones(2, 2, dtype=torch.bfloat16)}
    adapter = {
        "base_model.model.layer.lora_A.weight": torch.ones(1, 2),
        "base_model.model.layer.lora_B.weight": torch.full((2, 1), 1e-4),
    }
    merged = merged_lora_weights(base, adapter, {"r": 1, "lora_alpha": 1}, dtype=torch.float32)
    # 1 + 1e-4 exactly in fp32 (a bf16 weight has ulp 2^-7 at 1: it would stay 1)
    assert merged["layer.weight"].dtype == torch.float32
    assert torch.equal(merged["layer.weight"], torch.full((2, 2), 1.0) + torch.full((2, 2), 1e-4))


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"target_modules": ["embed_tokens", "q_proj"]}, "lora_embedding_"),
        ({"target_modules": ["q_proj"], "lora_bias": True}, "lora_B.bias"),
        ({"target_modules": ["q_proj"], "bias": "lora_only", "attention_bias": True}, "q_proj.base_layer.bias"),
    ],
)
def test_issue36_an_adapter_tensor_the_merge_would_not_consume_is_refused_by_name(tmp_path, options, named):
    """LoRA on the embeddings (peft's ``lora_embedding_A``/``B``) and LoRA bias tensors used to be dropped without a
    word; the merge names the first one it cannot consume."""
    import torch

    _bf16_base_and_adapter(tmp_path, b_scale=1e-2, **options)
    adapter = read_tensors(str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    with pytest.raises(ValueError, match="which a merge does not consume") as refused:
        merged_lora_weights(read_tensors(str(tmp_path / "base")), adapter, config, dtype=torch.float32)
    assert named in str(refused.value) and "\n" not in str(refused.value)


class _FailingEngine:
    """A stand-in for the vLLM engine's ``collective_rpc``: the reload of ``broken`` fails midway."""

    def __init__(self, broken: str) -> None:
        self.broken, self.reloaded = broken, []

    def collective_rpc(self, method, kwargs=None):
        if method == "reload_weights":
            self.reloaded.append(kwargs["weights_path"])
            if kwargs["weights_path"] == self.broken:
                raise RuntimeError("injected: the reload failed after its first layers")
        return [False]


def test_issue36_a_swap_that_fails_midway_leaves_the_engine_naming_no_weights(tmp_path):
    """R6: the old folder's identity stayed after a failed swap, so a request for the old folder skipped the swap and
    sampled a half-swapped model; now the identity is cleared before a swap begins, and the old folder is reloaded."""
    old, new = tmp_path / "old", tmp_path / "new"
    for folder in (old, new):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(folder.name.encode())
    engine = object.__new__(Engine)  # the server's swap logic without vLLM
    engine.llm, engine.swaps, engine.weights = _FailingEngine(str(new.resolve())), 0, None
    engine.serve(str(old))
    with pytest.raises(RuntimeError, match="injected"):
        engine.serve(str(new))
    assert engine.weights is None
    engine.serve(str(old))
    assert engine.llm.reloaded == [str(old.resolve()), str(new.resolve()), str(old.resolve())]
    assert engine.swaps == 3  # every swap begun is a new state, the failed one included (the probe's trigger)
