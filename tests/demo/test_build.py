"""Tests for demo/build.py: the world folder loads as ordinary Hugging Face files, and the cache behaves."""

from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from demo.build import build_default_world
from demo.world import WORLD_FILE, DemoWorld, WorldConfig, load_prompts
from rlhf_core.config import SamplingConfig
from rlhf_core.generation import generate

# A world small enough to build in about a second; the default one takes ~20 s.
TINY = WorldConfig(num_sentences=300, num_train_prompts=16, num_eval_prompts=8, pretrain_steps=5, batch_size=8)


def _folder_bytes(world: DemoWorld) -> dict[str, bytes]:
    root = world.model_dir.parent
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> DemoWorld:
    return build_default_world(tmp_path_factory.mktemp("demo") / "world", seed=0, progress=False, config=TINY)


def test_model_folder_loads_and_samples_through_the_pipeline_code(world):
    tokenizer = AutoTokenizer.from_pretrained(world.model_dir)
    model = AutoModelForCausalLM.from_pretrained(world.model_dir)
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (0, 1, 2)
    assert model.config.vocab_size == len(tokenizer)
    prompts = load_prompts(world.eval_prompts_path)
    batch = tokenizer(prompts, padding=True, return_tensors="pt")
    generation = generate(
        model,
        batch["input_ids"],
        batch["attention_mask"],
        config=SamplingConfig(max_new_tokens=4),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(0),
    )
    assert generation.sequences.shape[0] == len(prompts)
    assert all(isinstance(text, str) for text in tokenizer.batch_decode(generation.sequences, skip_special_tokens=True))


def test_python_m_demo_shows_samples_and_their_mean_gold_score(world, capsys):
    from demo.__main__ import show

    show(world, seed=0)
    printed = capsys.readouterr().out
    assert "prompt | response" in printed and "mean gold score of" in printed


def test_prompt_files_are_jsonl_and_disjoint(world):
    train, held_out = load_prompts(world.prompts_path), load_prompts(world.eval_prompts_path)
    assert (len(train), len(held_out)) == (16, 8)
    assert set(train).isdisjoint(held_out)
    first_line = world.prompts_path.read_text(encoding="utf-8").splitlines()[0]
    assert json.loads(first_line) == {"prompt": train[0]}


def test_second_call_reuses_the_cache(world):
    before = _folder_bytes(world)
    started = time.perf_counter()
    again = build_default_world(world.model_dir.parent, seed=0, progress=False, config=TINY)
    assert time.perf_counter() - started < 0.5
    assert again == world
    assert _folder_bytes(again) == before
    record = json.loads((world.model_dir.parent / WORLD_FILE).read_text(encoding="utf-8"))
    assert record["seed"] == 0 and record["config_hash"] == TINY.hash()


def test_build_is_deterministic_and_rebuilds_a_half_built_or_outdated_cache(world, tmp_path):
    root = tmp_path / "world"
    copy = build_default_world(root, seed=0, progress=False, config=TINY)
    assert _folder_bytes(copy)["model/model.safetensors"] == _folder_bytes(world)["model/model.safetensors"]
    # A folder without world.json (a crash mid-write by older code, a hand edit) is rebuilt.
    (root / WORLD_FILE).unlink()
    build_default_world(root, seed=0, progress=False, config=TINY)
    assert (root / WORLD_FILE).is_file()
    # Another seed replaces the world with a different one.
    build_default_world(root, seed=1, progress=False, config=TINY)
    assert json.loads((root / WORLD_FILE).read_text(encoding="utf-8"))["seed"] == 1
    assert load_prompts(root / "eval_prompts.jsonl") != load_prompts(world.eval_prompts_path)
    assert [path.name for path in tmp_path.iterdir()] == ["world"]  # no staging or outdated folders left


def test_abandoned_staging_folders_are_removed(tmp_path):
    abandoned = tmp_path / ".world.building-999999999-deadbeef"
    (abandoned / "model").mkdir(parents=True)
    build_default_world(tmp_path / "world", seed=0, progress=False, config=TINY)
    assert not abandoned.exists()


def test_refuses_to_overwrite_a_folder_that_is_not_a_world(tmp_path):
    (tmp_path / "notes.txt").write_text("mine", encoding="utf-8")
    with pytest.raises(FileExistsError, match="not part of a demo world"):
        build_default_world(tmp_path, seed=0, progress=False, config=TINY)
    assert (tmp_path / "notes.txt").read_text(encoding="utf-8") == "mine"
