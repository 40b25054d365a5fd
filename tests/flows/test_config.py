"""PipelineConfig: validated once at the flow boundary; YAML diffs plus overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.config import ConfigError, PipelineConfig, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["demo.yaml", "demo-verifiable.yaml", "tiny.yaml"])
def test_shipped_configs_load(name):
    assert isinstance(load_config(CONFIGS / name), PipelineConfig)


def test_overrides_apply_on_top_of_the_file():
    config = load_config(CONFIGS / "tiny.yaml", ["ppo.epochs=3", "sampling.temperature=0.7", "iterations=5"])
    assert (config.ppo.epochs, config.sampling.temperature, config.iterations) == (3, 0.7, 5)
    assert config.sizes.rollout_prompts == 16  # from the file


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["ppo.epoch=2"], "ppo.epoch"),  # a mistyped nested key
        (["sampling.temperature=hot"], "sampling.temperature"),  # a bad type
        (["sampling.top_p=2"], "top_p"),  # a stage config's own __post_init__ check
        (["ppo.dual_clip=0.5"], "dual_clip"),
        (["labeler=import"], "data.preferences"),  # a cross-field check
        (["campaign=has space"], "campaign"),
        (["nonsense"], "section.field=value"),
        (["ppo.kl_loss_coef=0.1"], "advantages.kl_in"),
        (["reward.source=function"], "reward.function"),
        (["reward.source=model"], "reward.source"),
        # 16 rollouts per iteration in tiny.yaml: a horizon of 8 would move the coefficient by up to 40% at once
        (["advantages.kl_target=1", "advantages.kl_horizon=8"], "advantages.kl_horizon"),
        (["advantages.kl_target=1", "advantages.kl_coef=0"], "kl_coef"),  # 0 times any factor stays 0
    ],
)
def test_bad_config_is_refused_with_a_message_naming_the_problem(overrides, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(None, overrides)


def test_missing_or_malformed_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("ppo: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_run_root_is_made_absolute():
    assert load_config(None, ["run_root=relative/dir"]).run_root.is_absolute()


def test_config_renders_as_a_json_schema_form():
    schema = PipelineConfig.model_json_schema()
    assert {"sampling", "ppo", "advantages", "reward_model", "labeler"} <= set(schema["properties"])
    assert schema["properties"]["labeler"]["enum"] == ["gold", "import", "reward_model", "human"]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_a_group_estimator_without_groups_is_refused_naming_both_settings(estimator):
    with pytest.raises(ConfigError, match=r"`advantages\.estimator` .*`sizes\.samples_per_prompt` >= 2, got 1"):
        load_config(CONFIGS / "tiny.yaml", [f"advantages.estimator={estimator}"])
    config = load_config(CONFIGS / "tiny.yaml", [f"advantages.estimator={estimator}", "sizes.samples_per_prompt=2"])
    assert config.sizes.samples_per_prompt == 2
    # REINFORCE++ and GAE need no groups.
    load_config(CONFIGS / "tiny.yaml", ["advantages.estimator=reinforce_pp"])
