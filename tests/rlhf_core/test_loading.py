"""The model seam: which dtype each role gets, frozen against trained, heads, checkpointing, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_core.loading import ModelLoader
from rlhf_core.models import Critic, RewardModel, dropout_disabled
from tests.conftest import left_padded, tiny_causal_lm, tiny_config

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A causal-LM folder, and critic and reward-model folders with saved heads."""
    root = tmp_path_factory.mktemp("seam")
    tiny_causal_lm("gpt2", seed=0).save_pretrained(root / "policy")
    for kind, name in ((Critic, "critic"), (RewardModel, "reward_model")):
        torch.manual_seed(1)
        kind(config=tiny_config("gpt2")).save_pretrained(root / name)
    return {"policy": root / "policy", "critic": root / "critic", "reward_model": root / "reward_model"}


def _dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def test_under_bf16_the_actor_and_trained_models_are_fp32_and_frozen_models_bf16(folders):
    loader = ModelLoader(device=CPU, precision="bf16")
    actor = loader.load("actor", folders["policy"])
    reference = loader.load("reference", folders["policy"])
    critic = loader.load("critic", folders["critic"])
    trained_critic = loader.load("critic", folders["critic"], trainable=True)
    reward_model = loader.load("reward_model", folders["reward_model"])
    assert _dtype(actor) == torch.float32 and not any(p.requires_grad for p in actor.parameters())
    assert _dtype(reference) == torch.bfloat16 and not reference.training
    assert _dtype(critic) == torch.bfloat16 and _dtype(reward_model) == torch.bfloat16
    assert _dtype(trained_critic) == torch.float32 and all(p.requires_grad for p in trained_critic.parameters())
    assert [(m["role"], m["device"], m["dtype"], m["trainable"]) for m in loader.loaded] == [
        ("actor", "cpu", "float32", False),
        ("reference", "cpu", "bfloat16", False),
        ("critic", "cpu", "bfloat16", False),
        ("critic", "cpu", "float32", True),
        ("reward_model", "cpu", "bfloat16", False),
    ]


def test_under_fp32_every_model_is_fp32(folders):
    loader = ModelLoader(device=CPU, precision="fp32")
    for role in ("actor", "reference", "critic", "reward_model"):
        source = folders["policy"] if role in ("actor", "reference") else folders[role]
        assert _dtype(loader.load(role, source)) == torch.float32, role


def test_heads_and_scores_come_back_in_fp32_under_autocast(folders):
    loader = ModelLoader(device=CPU, precision="bf16")
    critic, reward_model = (
        loader.load("critic", folders["critic"]),
        loader.load("reward_model", folders["reward_model"]),
    )
    ids, mask = left_padded([[3, 4, 5], [6]])
    with loader.autocast(), torch.no_grad():
        assert critic(ids, mask).dtype == torch.float32 and reward_model(ids, mask).dtype == torch.float32


def test_a_frozen_head_model_needs_its_head_and_a_trained_one_may_start_fresh(folders):
    loader = ModelLoader(device=CPU, precision="fp32")
    with pytest.raises(FileNotFoundError, match="value_head.safetensors is missing"):
        loader.load("critic", folders["policy"])
    with pytest.raises(FileNotFoundError, match="reward_head.safetensors is missing"):
        loader.load("reward_model", folders["policy"])
    assert isinstance(loader.load("critic", folders["policy"], trainable=True), Critic)


def test_refusals_name_the_problem(folders):
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        ModelLoader(device=CPU, precision="fp16")
    loader = ModelLoader(device=CPU, precision="fp32")
    with pytest.raises(ValueError, match="reference policy is frozen"):
        loader.load("reference", folders["policy"], trainable=True)
    with pytest.raises(ValueError, match="`role` must be one of"):
        loader.load("judge", folders["policy"])  # type: ignore[arg-type]


def _layer_calls(model, ids, mask) -> int:
    """Calls of the first decoder block's MLP during one forward and backward pass: a recompute in
    the backward pass calls it again (module hooks are not rerun, so the method itself is counted)."""
    mlp = model.transformer.h[0].mlp
    calls, forward = [], mlp.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    mlp.forward = counted
    try:
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    finally:
        del mlp.forward
    return len(calls)


def test_gradient_checkpointing_recomputes_activations_and_changes_no_gradient(folders):
    ids, mask = left_padded([[3, 4, 5, 6], [7, 8]])
    plain = ModelLoader(device=CPU, precision="fp32").load("actor", folders["policy"], trainable=True)
    checkpointed = ModelLoader(device=CPU, precision="fp32", gradient_checkpointing=True).load(
        "actor", folders["policy"], trainable=True
    )
    with dropout_disabled(plain, checkpointed):  # train mode, as in the PPO update
        assert _layer_calls(plain, ids, mask) == 1
        assert _layer_calls(checkpointed, ids, mask) == 2  # forward, then again in the backward pass
    for (name, left), right in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(left.grad, right.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_each_precision_gets_an_accelerator_of_its_own_in_one_process():
    # Accelerate keeps one process-wide state; the seam resets it when the precision changes.
    assert ModelLoader(device=CPU, precision="bf16").accelerator().mixed_precision == "bf16"
    assert ModelLoader(device=CPU, precision="fp32").accelerator().mixed_precision == "no"
    assert ModelLoader(device=CPU, precision="bf16").accelerator().native_amp
