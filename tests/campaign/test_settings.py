"""The settings table: derived from each stage's one declaration, and the replay rules follow from it."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys

import pytest

from campaign.config import PipelineConfig
from campaign.settings import STAGE_SETTINGS, covers, replayable_fields
from runtime.context import BaseInputs, InputFile
from runtime.declaration import input_names, setting_values, settings_from
from tasks.settings import (
    STAGES,
    CollectPreferencesSettings,
    EvaluateSettings,
    InitializeSettings,
    PPOUpdateSettings,
    RolloutSettings,
    SampleCandidatesSettings,
    SampleReferenceSettings,
)

FILE = InputFile(path="/p", sha256="0" * 64)
BASE = BaseInputs(policy=FILE, tokenizer=FILE, prompts=FILE, eval_prompts=FILE, preferences=FILE)


@pytest.mark.parametrize("settings", STAGES, ids=[settings.stage for settings in STAGES])
def test_each_stage_is_declared_once_with_its_settings(settings):
    """The stage a module declares runs with exactly the settings class the table is derived from."""
    stage = getattr(importlib.import_module(settings.module), settings.stage)
    assert stage.settings is settings and stage.name == settings.stage and stage.module == settings.module
    assert settings.stage in STAGE_SETTINGS


def test_settings_are_read_from_the_config_and_the_base_inputs():
    config = PipelineConfig(demo=True, labeler="gold", sizes={"rollout_prompts": 12}, precision="bf16")
    policy = object()  # an input is whatever the flow hands over
    rollout = settings_from(
        RolloutSettings, config, BASE, {"policy": policy, "reward_model": None, "critic_start": None}
    )
    assert rollout.policy is policy
    assert setting_values(rollout) == {
        "sampling": config.sampling,
        "precision": "bf16",
        "prompts": 12,
        "samples_per_prompt": 1,
        "rows_per_shard": 4096,
        "reward_function": None,
        "environment": None,
        "max_turns": 3,
        "max_tokens_per_turn": 32,
        "step_timeout_s": 30.0,
    }
    inputs = {"candidates": None, "reward_model": None, "labels": None, "earlier": ()}
    assert settings_from(CollectPreferencesSettings, config, BASE, inputs).preferences is FILE
    update = settings_from(
        PPOUpdateSettings, config, BASE, {"policy": None, "optimizer": None, "scored": None, "critic_start": None}
    )
    assert update.temperature == config.sampling.temperature
    # A derived property is a setting too: the update and initialize read whether the estimator uses a critic.
    grpo = PipelineConfig(demo=True, labeler="gold", advantages={"estimator": "grpo"}, sizes={"samples_per_prompt": 4})
    assert setting_values(settings_from(InitializeSettings, config, BASE, {"sft": None})) == {
        "critic": True,
        "lora": None,
        "critic_init": "policy",
    }
    assert (
        settings_from(
            PPOUpdateSettings, grpo, BASE, {"policy": 1, "optimizer": 2, "scored": 3, "critic_start": None}
        ).critic
        is False
    )


def test_issue42_staleness_keys_the_stages_that_choose_a_policy_to_sample_and_not_those_given_one():
    """``sampling.staleness`` decides which policy the generation stages sample (the rollout records the version); the
    reference's samples and the evaluation of a given policy do not change with it, so neither do their keys."""

    inputs = {
        SampleReferenceSettings: {},
        EvaluateSettings: {"policy": None, "reference": None, "reward_model": None},
        RolloutSettings: {"policy": None, "reward_model": None, "critic_start": None},
    }

    def keyed(settings, staleness: int) -> dict:
        config = PipelineConfig(demo=True, labeler="gold", sampling={"staleness": staleness})
        return setting_values(settings_from(settings, config, BASE, inputs[settings]))

    for given in (SampleReferenceSettings, EvaluateSettings):
        assert keyed(given, 0) == keyed(given, 1), given.stage
    assert keyed(RolloutSettings, 0) != keyed(RolloutSettings, 1)


def test_issue42_precision_keys_the_labels_only_of_a_labeler_that_loads_a_model():
    inputs = {"candidates": None, "reward_model": None, "labels": None, "earlier": ()}

    def keyed(labeler: str, precision: str) -> dict:
        config = PipelineConfig(demo=True, labeler=labeler, precision=precision, model={"reward_model": "/rm"})
        return setting_values(settings_from(CollectPreferencesSettings, config, BASE, inputs))

    assert keyed("gold", "fp32") == keyed("gold", "bf16")  # a rubric: nothing loaded, nothing computed in bf16
    assert keyed("reward_model", "fp32") != keyed("reward_model", "bf16")


def test_issue42_batch_size_keys_the_reference_samples_only_where_it_changes_them():
    """On the engine the reference's samples are one request per shard and nothing of them is computed on the
    trainer's side, so ``sampling.batch_size`` leaves their key; on the ``hf`` sampler, which samples batch by batch,
    and in every stage that runs the trainer's model over its rows in batches (the candidates' log-probs), it stays."""

    inputs = {SampleReferenceSettings: {}, SampleCandidatesSettings: {"policy": None, "earlier": ()}}

    def keyed(settings, engine: str, batch_size: int) -> dict:
        config = PipelineConfig(demo=True, labeler="gold", sampling={"engine": engine, "batch_size": batch_size})
        return setting_values(settings_from(settings, config, BASE, inputs[settings]))

    assert keyed(SampleReferenceSettings, "vllm", 4) == keyed(SampleReferenceSettings, "vllm", 64)
    assert keyed(SampleReferenceSettings, "hf", 4) != keyed(SampleReferenceSettings, "hf", 64)
    assert keyed(SampleCandidatesSettings, "vllm", 4) != keyed(SampleCandidatesSettings, "vllm", 64)


def test_a_stage_is_given_exactly_its_inputs():
    config = PipelineConfig(demo=True, labeler="gold")
    with pytest.raises(TypeError, match="rollout needs the inputs reward_model"):
        settings_from(RolloutSettings, config, BASE, {"policy": 1})
    with pytest.raises(TypeError, match="not scored"):
        settings_from(RolloutSettings, config, BASE, {"policy": 1, "reward_model": None, "scored": 2})


def test_the_table_is_read_without_torch_or_prefect():
    """The CLI builds its help from the replay rules: reading the declarations must load no model library."""
    script = "import sys, campaign.settings; print(sorted({'torch', 'prefect', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_replay_may_change_what_only_the_replayed_stages_read():
    # `sampling` is read by the rollout, so `sampling.temperature` (also the update's) stays fixed.
    # `sizes.samples_per_prompt` is the rollout's, so a replay cannot change the groups. The estimator
    # is replayable although initialize reads `advantages.uses_critic`: initialize made the campaign's
    # start, not part of the iteration a replay reuses. `dpo` is the DPO update's alone: the reference's log-probs of
    # the pairs, which a replay reuses, read none of it (issue 45).
    assert replayable_fields() == ("advantages", "dpo", "ppo", "sizes.eval_prompts")
    assert covers(replayable_fields(), "advantages.estimator")
    assert not covers(replayable_fields(), "sizes.samples_per_prompt")
    assert covers(replayable_fields(), "ppo.clip_eps") and not covers(replayable_fields(), "sampling.temperature")
    assert not covers(("ppo",), "ppo_extra")


def test_issue42_the_held_out_prompts_key_the_references_samples_and_the_evaluation_alone():
    """Another held-out prompts file re-keys the two stages that read it, through their ``base.eval_prompts``
    setting, and no other: the base fingerprint in every key leaves it out."""
    other = dataclasses.replace(BASE, eval_prompts=InputFile(path="/p", sha256="1" * 64))
    assert other.fingerprint == BASE.fingerprint
    assert dataclasses.replace(BASE, prompts=other.eval_prompts).fingerprint != BASE.fingerprint
    config = PipelineConfig(demo=True, labeler="gold")
    rekeyed = set()
    for settings in STAGES:
        inputs = {name: None for name in input_names(settings)}
        if setting_values(settings_from(settings, config, BASE, inputs)) != setting_values(
            settings_from(settings, config, other, inputs)
        ):
            rekeyed.add(settings.stage)
    assert rekeyed == {"sample_reference", "evaluate"}
