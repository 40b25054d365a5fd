"""Checkpoints: safetensors folders with heads and tokenizers; training state as torch distributed checkpoints whose
bytes depend on their content alone and that unpickle nothing but DCP's own records (issue 32)."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rlhf_core.loading import ModelLoader
from rlhf_core.models import Critic, RewardModel
from storage.checkpoints import CHECKPOINT_METADATA, load_state, read_legacy_optimizer_state, save_model, save_state
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


def test_a_checkpoint_is_the_same_bytes_wherever_it_is_written(tmp_path: Path) -> None:
    """No folder name or random id in its metadata: its digest can be part of the next update's input key."""
    state = {"actor": {"weight": torch.arange(6.0).reshape(2, 3), "step": torch.tensor(3.0)}}
    for folder in ("a", "b/c"):
        save_state(tmp_path / folder, state)
    assert sorted(path.name for path in (tmp_path / "a").iterdir()) == [CHECKPOINT_METADATA, "__0_0.distcp"]
    for file in (tmp_path / "a").iterdir():
        assert file.read_bytes() == (tmp_path / "b" / "c" / file.name).read_bytes(), file.name
    loaded = {"actor": {"weight": torch.zeros(2, 3), "step": torch.tensor(0.0)}}
    load_state(tmp_path / "b" / "c", loaded)
    torch.testing.assert_close(loaded, state, rtol=0, atol=0)


def test_a_checkpoint_holds_tensors_only(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"actor.lr is float"):
        save_state(tmp_path, {"actor": {"weight": torch.zeros(2), "lr": 0.1}})


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch payload-ran",))


def test_a_checkpoint_whose_metadata_names_anything_else_is_refused_unread(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    save_state(tmp_path / "state", {"weight": torch.zeros(2)})
    (tmp_path / "state" / CHECKPOINT_METADATA).write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(pickle.UnpicklingError, match=r"names posix.system, which no checkpoint of this pipeline holds"):
        load_state(tmp_path / "state", {"weight": torch.zeros(2)})
    assert not (tmp_path / "payload-ran").exists()


BEFORE = Path(__file__).parents[1] / "runtime" / "policy_before_issue32"
"""Optimizer states the previous release wrote: ``whole/`` by 1 process, ``sharded/`` by 2 FSDP2 processes."""


def test_the_previous_releases_optimizer_states_read_whole(tmp_path: Path) -> None:
    """``optimizer.pt`` as saved; the 2 shards joined are the state 1 process saved after the same steps, to float
    rounding; a missing shard is named."""
    whole = read_legacy_optimizer_state(BEFORE / "whole" / "actor_optimizer")
    saved = torch.load(BEFORE / "whole" / "actor_optimizer" / "optimizer.pt", weights_only=True)
    torch.testing.assert_close(whole, saved, rtol=0, atol=0)
    joined = read_legacy_optimizer_state(BEFORE / "sharded" / "actor_optimizer")
    torch.testing.assert_close(joined, whole, rtol=1e-4, atol=1e-6)
    assert read_legacy_optimizer_state(tmp_path) is None
    shutil.copytree(BEFORE / "sharded" / "actor_optimizer", tmp_path / "shards")
    (tmp_path / "shards" / "optimizer-00001-of-00002.pt").unlink()
    with pytest.raises(FileNotFoundError, match="holds 1 of the 2 optimizer shards"):
        read_legacy_optimizer_state(tmp_path / "shards")
