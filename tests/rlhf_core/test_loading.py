"""The model seam: which dtype each role gets, frozen against trained, heads, checkpointing, refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rlhf_core.config import LoraConfig
from rlhf_core.loading import FolderMeta, ModelLoader, merged, save_model_folder
from rlhf_core.models import Critic, RewardModel, dropout_disabled, evaluating
from runtime.models import FrozenModels, accelerator_for
from tests.conftest import PAD, left_padded, tiny_causal_lm, tiny_config

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
    assert accelerator_for(CPU, "bf16").mixed_precision == "bf16"
    assert accelerator_for(CPU, "fp32").mixed_precision == "no"
    assert accelerator_for(CPU, "bf16").native_amp


# ----------------------------------------------------------------------------- LoRA, base references, exports

LORA = LoraConfig(r=4, alpha=8, dropout=0.0)


def _logits(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()


def test_lora_trains_only_adapters_over_a_bf16_base_and_the_reference_is_the_same_base(folders):
    loader = ModelLoader(device=CPU, precision="bf16", bases={"policy": folders["policy"]}, lora=LORA)
    actor = loader.load("actor", folders["policy"], trainable=True)
    trained = {name for name, p in actor.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)
    assert {p.dtype for p in actor.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in actor.parameters() if not p.requires_grad} == {torch.bfloat16}
    reference = loader.reference(actor)
    # No second copy: the reference's parameters are the actor's own tensors.
    assert {id(p) for p in reference.parameters()} == {id(p) for p in actor.parameters()}
    assert loader.loaded[-1] == {
        "role": "reference", "device": "cpu", "dtype": "bfloat16", "trainable": False, "shares_weights_with": "actor"
    }  # fmt: skip
    ids, mask = left_padded([[3, 4, 5], [6]])
    with torch.no_grad():  # move the adapters away from their zero start, so they change the function
        for name, parameter in actor.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    base = ModelLoader(device=CPU, precision="bf16").load("reference", folders["policy"])
    with loader.autocast():
        assert torch.equal(_logits(reference, ids, mask), _logits(base, ids, mask))
        assert not torch.equal(_logits(actor, ids, mask), _logits(base, ids, mask))

    actor.eval()  # a frozen actor (sampling, evaluation): evaluating its reference leaves it in eval mode
    with evaluating(actor, loader.reference(actor)):
        pass
    assert not actor.training


def test_an_adapter_folder_holds_no_base_weights_and_loads_back_identically(folders, tmp_path):
    bases = {"policy": folders["policy"]}
    loader = ModelLoader(device=CPU, precision="fp32", bases=bases, lora=LORA)
    torch.manual_seed(0)
    critic = loader.load("critic", folders["policy"], trainable=True)
    with torch.no_grad():
        for name, parameter in critic.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    save_model_folder(critic, tmp_path / "critic")
    names = {path.name for path in (tmp_path / "critic").iterdir()}
    assert {"adapter_model.safetensors", "value_head.safetensors", "rlhf_model.json"} <= names
    assert "model.safetensors" not in names
    assert FolderMeta.read(tmp_path / "critic") == FolderMeta(kind="critic", base="policy", adapter=True)
    again = ModelLoader(device=CPU, precision="fp32", bases=bases).load("critic", tmp_path / "critic")
    ids, mask = left_padded([[3, 4, 5], [6]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids, mask), critic(ids, mask), rtol=0.0, atol=0.0)
    with pytest.raises(ValueError, match="refers to the base 'policy'"):
        ModelLoader(device=CPU, precision="fp32").load("critic", tmp_path / "critic")
    with pytest.raises(ValueError, match="holds a critic, not the actor"):
        ModelLoader(device=CPU, precision="fp32", bases=bases).load("actor", tmp_path / "critic")


def test_issue35_an_adapters_config_is_written_the_same_by_every_process(folders, tmp_path):
    """PEFT keeps ``all-linear``'s resolved modules as a set: written as it is, their order was the process's string
    hash order, and a LoRA campaign's outputs differed from one command to the next (the kill -9 resume)."""
    loader = ModelLoader(device=CPU, precision="fp32", bases={"policy": folders["policy"]}, lora=LORA)
    actor = loader.load("actor", folders["policy"], trainable=True)
    save_model_folder(actor, tmp_path / "actor")
    written = json.loads((tmp_path / "actor" / "adapter_config.json").read_text())["target_modules"]
    assert len(written) > 1 and written == sorted(written)
    assert isinstance(actor.peft_config["default"].target_modules, set)  # as PEFT keeps it


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_issue35_a_critic_starts_from_a_trained_reward_models_folder_with_its_backbone_and_score_head(
    folders, tmp_path, lora
):
    bases = {"policy": folders["policy"]}
    torch.manual_seed(0)
    reward_model = ModelLoader(device=CPU, precision="fp32", bases=bases, lora=lora).load(
        "reward_model", folders["policy"], trainable=True
    )
    with torch.no_grad():  # a trained reward model: its adapters (or backbone) and head away from their start
        for name, parameter in reward_model.named_parameters():
            if "lora_B" in name or lora is None:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    save_model_folder(reward_model, tmp_path / "reward_model")
    critic = ModelLoader(device=CPU, precision="fp32", bases=bases, lora=lora).load(
        "critic", tmp_path / "reward_model", trainable=True
    )
    torch.testing.assert_close(critic.head.weight, reward_model.head.weight, rtol=0.0, atol=0.0)
    ids, mask = left_padded([[3, 4, 5], [6, 7]])
    with torch.no_grad():
        hidden = critic.last_hidden_state(ids, mask)  # (B, T, H)
        expected = reward_model.last_hidden_state(ids, mask)
    torch.testing.assert_close(hidden, expected, rtol=0.0, atol=0.0)  # the same backbone (adapter included)
    assert any(p.requires_grad for p in critic.head.parameters())
    save_model_folder(critic, tmp_path / "critic")
    assert FolderMeta.read(tmp_path / "critic").kind == "critic"  # saved again, it is a critic
    with pytest.raises(ValueError, match="holds a reward_model, not the actor"):
        ModelLoader(device=CPU, precision="fp32", bases=bases).load("actor", tmp_path / "reward_model")


def test_issue43_a_critic_started_from_a_reward_model_predicts_its_normalised_score(folders, tmp_path):
    """With the reward model's score statistics folded into its head, the critic's value at a sequence's last token
    is the normalised score the returns are made of; a frozen critic is kept apart for each statistics."""
    loader = ModelLoader(device=CPU, precision="fp32", frozen_models=FrozenModels(max_bytes=2**30))
    source = tmp_path / "reward_model"
    save_model_folder(loader.load("reward_model", folders["reward_model"]), source)  # as the pipeline saves one
    reward_model = loader.load("reward_model", source)
    ids, mask = left_padded([[3, 4, 5], [6, 7]])  # left padded: the last position is each row's last token
    with torch.no_grad():
        scores = reward_model(ids, mask)  # (B,)
        for trainable in (False, True):
            critic = loader.load("critic", source, trainable=trainable, score_statistics=(0.25, 0.5))
            torch.testing.assert_close(critic(ids, mask)[:, -1], (scores - 0.25) / 0.5)
    frozen = loader.load("critic", source, score_statistics=(0.25, 0.5))
    assert loader.load("critic", source, score_statistics=(0.25, 0.5)) is frozen  # kept
    assert loader.load("critic", source, score_statistics=(0.0, 1.0)) is not frozen  # not with other statistics
    with pytest.raises(ValueError, match="folded into a critic started from a reward model"):
        loader.load("critic", folders["critic"], score_statistics=(0.0, 1.0))


def test_a_base_reference_folder_is_the_base(folders, tmp_path):
    bases = {"policy": folders["policy"]}
    loader = ModelLoader(device=CPU, precision="fp32", bases=bases)
    save_model_folder(loader.load("actor", folders["policy"], trainable=True), tmp_path / "actor", weights=False)
    assert sorted(path.name for path in (tmp_path / "actor").iterdir()) == ["rlhf_model.json"]
    ids, mask = left_padded([[3, 4, 5]])
    loaded = loader.load("actor", tmp_path / "actor")
    assert torch.equal(_logits(loaded, ids, mask), _logits(loader.load("reference", folders["policy"]), ids, mask))
    stray = ModelLoader(device=CPU, precision="fp32").load("actor", folders["policy"])  # no named base
    with pytest.raises(ValueError, match="not loaded from a named base"):
        save_model_folder(stray, tmp_path / "stray", weights=False)


def _moved_lora_actor(folders) -> torch.nn.Module:
    """A LoRA actor over the test's policy whose adapters change its function (``lora_B`` drawn, not zero)."""
    loader = ModelLoader(device=CPU, precision="fp32", bases={"policy": folders["policy"]}, lora=LORA)
    actor = loader.load("actor", folders["policy"], trainable=True)
    with torch.no_grad():
        for name, parameter in actor.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    return actor


def test_merging_adapters_keeps_the_function(folders):
    actor = _moved_lora_actor(folders)
    ids, mask = left_padded([[3, 4, 5], [6]])
    expected = _logits(actor, ids, mask)
    plain = merged(actor)
    assert type(plain).__name__ == "GPT2LMHeadModel"
    torch.testing.assert_close(_logits(plain, ids, mask), expected, rtol=1e-5, atol=1e-5)


def test_issue45_a_merged_lora_actor_is_a_whole_base_that_starts_a_critic_and_a_reference(folders, tmp_path):
    """An SFT output: a LoRA actor merged and saved whole, then the base of a campaign (its initial policy and
    reference), whose critic starts from its backbone like any causal LM folder's."""
    actor = _moved_lora_actor(folders)
    ids, mask = left_padded([[3, 4, 5], [6]])
    expected = _logits(actor, ids, mask)
    meta = save_model_folder(merged(actor), tmp_path / "sft")
    assert meta == FolderMeta(kind="causal_lm", base=None, adapter=False) and meta.whole_causal_lm
    campaign = ModelLoader(device=CPU, precision="fp32", bases={"policy": tmp_path / "sft"}, lora=LORA)
    torch.testing.assert_close(_logits(campaign.reference(), ids, mask), expected, rtol=1e-5, atol=1e-5)
    torch.manual_seed(0)
    critic = campaign.load("critic", tmp_path / "sft", trainable=True)
    assert isinstance(critic, Critic) and critic(ids, attention_mask=mask).shape == ids.shape


def test_a_sequence_classification_checkpoint_is_a_reward_model_with_the_same_scores(tmp_path):
    config = tiny_config("llama")
    config.num_labels = 1
    torch.manual_seed(3)
    classifier = AutoModelForSequenceClassification.from_config(config).eval()
    classifier.save_pretrained(tmp_path / "rm")
    reward_model = ModelLoader(device=CPU, precision="fp32").load("reward_model", tmp_path / "rm")
    ids, mask = torch.tensor([[5, 6, 7, 8], [9, 10, PAD, PAD]]), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad():
        torch.testing.assert_close(reward_model(ids, mask), classifier(input_ids=ids, attention_mask=mask).logits[:, 0])
    config.num_labels = 3
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "three")
    with pytest.raises(ValueError, match="has 3 labels; a reward model has exactly one"):
        ModelLoader(device=CPU, precision="fp32").load("reward_model", tmp_path / "three")


def _nbytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def test_a_frozen_model_is_found_again_until_its_folder_is_written_again(folders, tmp_path):
    kept = FrozenModels(max_bytes=2**30)
    loader = ModelLoader(device=CPU, precision="bf16", frozen_models=kept)
    source, weights = (
        tmp_path / "reward_model",
        ModelLoader(device=CPU, precision="fp32").load("reward_model", folders["reward_model"]),
    )
    save_model_folder(weights, source)

    first = loader.load("reward_model", source)
    assert loader.load("reward_model", source) is first
    assert ModelLoader(device=CPU, precision="bf16", frozen_models=kept).load("reward_model", source) is first
    assert ModelLoader(device=CPU, precision="fp32", frozen_models=kept).load("reward_model", source) is not first
    assert [m.get("kept_in_memory", False) for m in loader.loaded] == [False, True]
    held = kept.held_bytes
    fp32 = ModelLoader(device=CPU, precision="fp32", frozen_models=kept)
    trained = fp32.load("critic", folders["critic"], trainable=True)
    assert fp32.load("critic", folders["critic"], trainable=True) is not trained  # a trained model is never kept
    assert kept.held_bytes == held

    first.train()  # a stage that left a kept model in train mode: the next one gets it frozen again
    assert loader.load("reward_model", source) is first and not first.training

    save_model_folder(weights, source)  # the same weights written again: new files
    again = loader.load("reward_model", source)
    assert again is not first and not again.training and not any(p.requires_grad for p in again.parameters())
    ids, mask = left_padded([[5, 6, 7]])
    assert torch.equal(first(ids, mask), again(ids, mask))


def test_frozen_models_leave_least_recently_used_first_beyond_their_bound(folders, tmp_path):
    shutil.copytree(folders["policy"], tmp_path / "copy")
    one = _nbytes(ModelLoader(device=CPU, precision="fp32").load("actor", folders["policy"]))
    kept = FrozenModels(max_bytes=2 * one)
    loader = ModelLoader(device=CPU, precision="fp32", frozen_models=kept)
    actor, reference = loader.load("actor", folders["policy"]), loader.load("reference", folders["policy"])
    assert kept.held_bytes == 2 * one
    assert loader.load("actor", folders["policy"]) is actor  # now the most recently used
    loader.load("actor", tmp_path / "copy")  # a third model: the reference, least recently used, leaves
    assert loader.load("actor", folders["policy"]) is actor
    assert loader.load("reference", folders["policy"]) is not reference
    assert kept.held_bytes <= 2 * one

    kept.resize(0)
    assert kept.held_bytes == 0
    assert loader.load("actor", folders["policy"]) is not actor  # a bound of 0 keeps nothing
    assert kept.held_bytes == 0


def test_a_folder_that_cannot_be_described_is_loaded_and_not_kept(folders, tmp_path):
    source = tmp_path / "reward_model"
    shutil.copytree(folders["reward_model"], source)
    (source / "dangling").symlink_to(tmp_path / "nowhere")
    kept = FrozenModels(max_bytes=2**30)
    loader = ModelLoader(device=CPU, precision="fp32", frozen_models=kept)
    assert loader.load("reward_model", source) is not loader.load("reward_model", source)
    assert kept.held_bytes == 0


def test_issue23_count_parameters_reads_the_safetensors_headers(tmp_path):
    from rlhf_core.loading import count_parameters

    model = tiny_causal_lm("llama")
    model.save_pretrained(tmp_path)
    unique = {parameter.data_ptr(): parameter.numel() for parameter in model.parameters()}
    assert count_parameters(tmp_path) == sum(unique.values())
