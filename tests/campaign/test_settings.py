"""The settings table: it names exactly what each stage function takes, and the replay rules follow from it."""

from __future__ import annotations

import importlib
import inspect

import pytest

from campaign.config import PipelineConfig
from campaign.settings import STAGE_SETTINGS, covers, replayable_fields, stage_settings
from flows.human_labels import request_human_labels
from runtime.context import BaseInputs, InputFile

FILE = InputFile(path="/p", sha256="0" * 64)


def _settings_of(function) -> set[str]:
    return {p.name for p in inspect.signature(function).parameters.values() if p.kind is p.KEYWORD_ONLY}


@pytest.mark.parametrize("stage", sorted(STAGE_SETTINGS))
def test_the_table_names_exactly_the_keyword_arguments_of_each_stage(stage):
    if stage == "human_labels":
        assert set(STAGE_SETTINGS[stage]) == _settings_of(request_human_labels) - {"human"}
    else:
        assert set(STAGE_SETTINGS[stage]) == _settings_of(getattr(importlib.import_module(f"tasks.{stage}"), stage))


def test_stage_settings_read_the_config_and_the_base_inputs():
    config = PipelineConfig(demo=True, labeler="gold", sizes={"rollout_prompts": 12}, precision="bf16")
    base = BaseInputs(policy=FILE, tokenizer=FILE, prompts=FILE, eval_prompts=FILE, preferences=FILE)
    rollout = stage_settings(config, base, "rollout")
    assert rollout == {
        "sampling": config.sampling,
        "precision": "bf16",
        "prompts": 12,
        "samples_per_prompt": 1,
        "rows_per_shard": 4096,
        "reward_function": None,
    }
    assert stage_settings(config, base, "collect_preferences")["preferences"] is FILE
    assert stage_settings(config, base, "ppo_update")["temperature"] == config.sampling.temperature
    # A derived property is a setting too: the update and initialize read whether the estimator uses a critic.
    grpo = PipelineConfig(demo=True, labeler="gold", advantages={"estimator": "grpo"}, sizes={"samples_per_prompt": 4})
    assert stage_settings(config, base, "initialize") == {"critic": True, "lora": None, "critic_init": "policy"}
    assert stage_settings(grpo, base, "ppo_update")["critic"] is False


def test_a_replay_may_change_what_only_the_replayed_stages_read():
    # `sampling` is read by the rollout, so `sampling.temperature` (also the update's) stays fixed.
    # `sizes.samples_per_prompt` is the rollout's, so a replay cannot change the groups. The estimator
    # is replayable although initialize reads `advantages.uses_critic`: initialize made the campaign's
    # start, not part of the iteration a replay reuses.
    assert replayable_fields() == ("advantages", "ppo", "sizes.eval_prompts")
    assert covers(replayable_fields(), "advantages.estimator")
    assert not covers(replayable_fields(), "sizes.samples_per_prompt")
    assert covers(replayable_fields(), "ppo.clip_eps") and not covers(replayable_fields(), "sampling.temperature")
    assert not covers(("ppo",), "ppo_extra")
