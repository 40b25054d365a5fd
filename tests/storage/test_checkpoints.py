"""Checkpoints: safetensors folders with heads, tokenizers, and training that resumes exactly."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rlhf_core.loading import ModelLoader
from rlhf_core.models import Critic, RewardModel
from storage.checkpoints import (
    OptimizerLayoutError,
    check_optimizer_layout,
    load_optimizer_shard,
    load_training_state,
    optimizer_layout,
    save_model,
    save_optimizer_shard,
    save_training_state,
)
from storage.tokenizers import load_tokenizer
from tests.conftest import EOS, PAD, tiny_causal_lm, tiny_config

IDS = torch.tensor([[0, 3, 4, 5], [6, 7, 8, 9]])
MASK = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])


def _loader() -> ModelLoader:
    return ModelLoader(device=torch.device("cpu"), precision="fp32")


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": PAD, "<bos>": 1, "<eos>": EOS, "<unk>": 3, **{f"w{i}": i for i in range(4, 32)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _weights_are_safetensors(directory: Path) -> None:
    names = {path.name for path in directory.iterdir()}
    assert any(name.endswith(".safetensors") for name in names)
    assert not [name for name in names if name.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt"))], names


def test_causal_lm_and_tokenizer_round_trip(tmp_path: Path, arch: str) -> None:
    model, tokenizer = tiny_causal_lm(arch, seed=3), _tokenizer()
    save_model(tmp_path / "actor", model, tokenizer)
    _weights_are_safetensors(tmp_path / "actor")
    loaded = _loader().load("actor", tmp_path / "actor")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, model(input_ids=IDS).logits)
    tokens = load_tokenizer(tmp_path / "actor")
    assert tokens("w4 w5 w31")["input_ids"] == tokenizer("w4 w5 w31")["input_ids"] == [4, 5, 31]
    assert tokens.pad_token_id == PAD and tokens.eos_token_id == EOS


@pytest.mark.parametrize(("kind", "role"), [(Critic, "critic"), (RewardModel, "reward_model")])
def test_heads_are_saved_beside_the_backbone(tmp_path: Path, kind, role) -> None:
    torch.manual_seed(0)
    model = kind(config=tiny_config("llama"))
    with torch.no_grad():
        model.head.weight.normal_()  # not the initialisation a fresh load would give
    save_model(tmp_path / "model", model)
    _weights_are_safetensors(tmp_path / "model")
    assert (tmp_path / "model" / f"{kind.head_name}.safetensors").is_file()
    loaded = _loader().load(role, tmp_path / "model")
    assert isinstance(loaded, kind)
    with torch.no_grad():
        assert torch.equal(loaded(IDS, MASK), model(IDS, MASK))


def test_loading_a_head_from_a_folder_without_one_is_refused(tmp_path: Path) -> None:
    tiny_causal_lm("gpt2").save_pretrained(tmp_path / "plain")  # a plain Hugging Face folder
    with pytest.raises(FileNotFoundError, match="value_head.safetensors"):
        _loader().load("critic", tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="reward_head.safetensors"):
        _loader().load("reward_model", tmp_path / "plain")
    save_model(tmp_path / "actor", tiny_causal_lm("gpt2"))  # a folder the pipeline saved says what it holds
    with pytest.raises(ValueError, match="holds a causal_lm, not the critic asked for"):
        _loader().load("critic", tmp_path / "actor")


def _train(model, optimizer, scheduler, steps: int) -> list[float]:
    """A few noisy steps whose data come from every RNG, so resuming must restore all of them."""
    losses = []
    for _ in range(steps):
        ids = torch.randint(4, 32, (2, 5))
        noise = random.random() + float(np.random.rand())
        loss = model(input_ids=ids, labels=ids).loss * (1.0 + noise)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def _fresh(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return optimizer, scheduler


def test_training_resumes_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = tiny_causal_lm("gpt2", seed=0)
    optimizer, scheduler = _fresh(model)
    _train(model, optimizer, scheduler, 2)
    save_model(tmp_path / "actor", model)
    save_training_state(tmp_path / "state", optimizer=optimizer, scheduler=scheduler, step=2, extra={"kl_coef": 0.07})
    expected = _train(model, optimizer, scheduler, 3)

    for generator in (torch.manual_seed, random.seed, np.random.seed):
        generator(123)  # scramble every RNG: the checkpoint must bring them back
    resumed = _loader().load("actor", tmp_path / "actor", trainable=True)
    optimizer2, scheduler2 = _fresh(resumed)
    state = load_training_state(tmp_path / "state", optimizer=optimizer2, scheduler=scheduler2)
    assert state == {"step": 2, "extra": {"kl_coef": 0.07}}
    assert _train(resumed, optimizer2, scheduler2, 3) == expected
    for (name, left), right in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(left, right), name


def test_training_state_loads_with_weights_only(tmp_path: Path) -> None:
    model = tiny_causal_lm("gpt2")
    optimizer, scheduler = _fresh(model)
    _train(model, optimizer, scheduler, 1)
    save_training_state(tmp_path, optimizer=optimizer, scheduler=scheduler, step=1)
    for path in tmp_path.glob("*.pt"):
        torch.load(path, weights_only=True)  # raises on anything that would need unpickling code


def test_missing_optimizer_state_is_an_error(tmp_path: Path) -> None:
    save_training_state(tmp_path, step=5)
    assert load_training_state(tmp_path) == {"step": 5, "extra": {}}
    optimizer, _ = _fresh(tiny_causal_lm("gpt2"))
    with pytest.raises(FileNotFoundError, match="optimizer.pt"):
        load_training_state(tmp_path, optimizer=optimizer)


def test_optimizer_shards_load_on_as_many_processes_and_other_layouts_are_refused_issue_25(tmp_path):
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.arange(4.0)}}, "param_groups": [{"lr": 0.1}]}
    for rank in range(2):
        save_optimizer_shard(tmp_path / "sharded", state, rank=rank, processes=2)
    save_training_state(tmp_path / "sharded", step=3)
    assert optimizer_layout(tmp_path / "sharded") == 2
    torch.testing.assert_close(load_optimizer_shard(tmp_path / "sharded", rank=1, processes=2), state)
    check_optimizer_layout(tmp_path / "sharded", processes=2)
    for processes in (None, 4):
        with pytest.raises(OptimizerLayoutError, match=r"sharded over 2 processes.*`execution.training_processes`"):
            check_optimizer_layout(tmp_path / "sharded", processes=processes)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    save_training_state(tmp_path / "whole", optimizer=optimizer, step=0)
    assert optimizer_layout(tmp_path / "whole") is None
    check_optimizer_layout(tmp_path / "whole", processes=None)
    with pytest.raises(OptimizerLayoutError, match=r"saved whole .* 2 sharded processes cannot load them"):
        check_optimizer_layout(tmp_path / "whole", processes=2)
    check_optimizer_layout(tmp_path / "nothing", processes=2)  # no states saved: nothing to refuse
