"""Models and data users bring: a chat policy with its template, chat prompts, and a pretrained
sequence-classification reward model with a tokenizer of its own, fine-tuned or used as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from campaign.config import load_config
from flows.rlhf_pipeline import rlhf_campaign
from storage.shards import read_table
from tasks.text import Prompt, load_tokenizer, prompt_ids, same_tokenizer

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _config(world, run_root, *extra, reward_model: str = "reward_model"):
    return load_config(
        TINY,
        [
            f"run_root={run_root}",
            f"model.policy={world['policy']}",
            f"model.reward_model={world[reward_model]}",
            f"data.prompts={world['prompts']}",
            f"data.eval_prompts={world['eval_prompts']}",
            "iterations=1",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def fine_tuned(prefect_server, chat_world, tmp_path_factory):
    config = _config(chat_world, tmp_path_factory.mktemp("chat-finetuned"))
    return config, rlhf_campaign(config, return_state=True)


def test_chat_prompts_render_through_the_policy_template_the_same_way_in_every_stage(fine_tuned, chat_world):
    config, state = fine_tuned
    assert state.is_completed(), state
    policy_tokenizer = load_tokenizer(str(chat_world["policy"]))
    assert not same_tokenizer(policy_tokenizer, load_tokenizer(str(chat_world["reward_model"])))
    campaign = config.run_root / config.campaign
    (candidates_dir,) = (campaign / "sample_candidates").iterdir()
    (rollout_dir,) = (campaign / "rollout").iterdir()
    candidates = read_table(candidates_dir, "candidates").to_pylist()
    start = policy_tokenizer.convert_tokens_to_ids("<|im_start|>")
    for row in candidates:
        prompt = Prompt(row["prompt"], tuple(row["messages"]))
        assert row["messages"] and row["prompt_ids"] == prompt_ids(policy_tokenizer, prompt)
        assert row["prompt_ids"][0] == start  # ChatML, not the plain format
    rollout_prompts = {row["prompt_id"]: row["prompt_ids"] for row in read_table(rollout_dir, "experience").to_pylist()}
    by_id = {row["prompt_id"]: row["prompt_ids"] for row in candidates}
    shared = by_id.keys() & rollout_prompts.keys()
    assert all(by_id[key] == rollout_prompts[key] for key in shared)  # one rendering for sampling and rollout
    (preferences_dir,) = (campaign / "collect_preferences").iterdir()
    assert all(row["messages"] for row in read_table(preferences_dir, "preferences").to_pylist())


def test_the_pretrained_reward_model_with_its_own_tokenizer_is_fine_tuned(fine_tuned):
    config, _ = fine_tuned
    campaign = config.run_root / config.campaign
    (rm_dir,) = (campaign / "train_reward_model").iterdir()
    assert (rm_dir / "reward_model" / "model.safetensors").is_file()  # fine-tuned: its own weights
    manifest = json.loads((rm_dir / "_manifest.json").read_text())
    assert manifest["metrics"]["pairs"] > 0 and 0 <= manifest["metrics"]["eval_accuracy"] <= 1


def test_a_pretrained_reward_model_used_as_it_is_collects_no_pairs_copies_nothing_and_starts_the_critic(
    prefect_server, chat_world, tmp_path
):
    """Two iterations on one reward model: its running score moments carry from the first to the second."""
    config = _config(
        chat_world,
        tmp_path,
        "reward_model.train=false",
        "model.critic_init=reward_model",
        "iterations=2",
        "advantages.score_statistics=running",
        reward_model="reward_model_policy_tokens",
    )
    assert rlhf_campaign(config, return_state=True).is_completed()
    campaign = config.run_root / config.campaign
    (initialize_dir,) = (campaign / "initialize").iterdir()
    meta = json.loads((initialize_dir / "critic" / "rlhf_model.json").read_text())
    assert meta == {"adapter": False, "base": "reward_model", "kind": "critic"}  # its backbone, not copied
    assert not (campaign / "sample_candidates").exists() and not (campaign / "collect_preferences").exists()
    for rm_dir in (campaign / "train_reward_model").iterdir():
        assert not list((rm_dir / "reward_model").glob("model*.safetensors"))
        assert json.loads((rm_dir / "reward_model" / "rlhf_model.json").read_text())["base"] == "reward_model"
    scored = [json.loads(path.read_text())["metrics"] for path in campaign.glob("compute_advantages/*/_manifest.json")]
    assert all(metrics["reward_mean"] == metrics["reward_mean"] for metrics in scored)  # finite
    rows = config.sizes.rollout_prompts * config.sizes.samples_per_prompt
    assert sorted(metrics["score_count"] for metrics in scored) == [rows, 2 * rows]  # carried (issue 43)


def test_a_critic_cannot_start_from_a_reward_model_with_another_tokenizer(prefect_server, chat_world, tmp_path):
    from flows.iterations import resolve_base

    config = _config(chat_world, tmp_path, "model.critic_init=reward_model")
    with pytest.raises(
        ValueError, match="critic_init` reward_model needs a reward model that uses the policy's tokenizer"
    ):
        resolve_base.fn(config)


def test_issue23_a_pretrained_reward_model_labels_the_first_iterations_pairs(prefect_server, chat_world, tmp_path):
    config = _config(chat_world, tmp_path, "labeler=reward_model")
    assert rlhf_campaign(config, return_state=True).is_completed()
    campaign = config.run_root / config.campaign
    (preferences_dir,) = (campaign / "collect_preferences").iterdir()
    preferences = read_table(preferences_dir, "preferences").to_pylist()
    assert preferences and {row["labeler"] for row in preferences} == {"reward_model"}


def test_issue23_imported_pairs_sample_no_candidates(prefect_server, chat_world, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"the sun {i}"}], "chosen": [{"role": "assistant", "content": "is warm"}],
         "rejected": [{"role": "assistant", "content": "is cold"}]}
        for i in range(20)
    ]  # fmt: skip
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = _config(chat_world, tmp_path, "labeler=import", f"data.preferences={pairs}")
    assert rlhf_campaign(config, return_state=True).is_completed()
    campaign = config.run_root / config.campaign
    assert not (campaign / "sample_candidates").exists()
    (preferences_dir,) = (campaign / "collect_preferences").iterdir()
    assert len(read_table(preferences_dir, "preferences")) == 20
