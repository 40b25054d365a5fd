"""``rlhf serve``'s deployments, built without a server: their names, form, schedule and bounds, and the replay
automation. ``rlhf serve`` as a process, with runs triggered as the Prefect UI triggers them: tests/flows/test_served.py
(slow)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from prefect.utilities.schema_tools import ValidationError as SchemaValidationError
from prefect.utilities.schema_tools import validate

from campaign.config import ConfigError, PipelineConfig, load_config
from flows.serve import build_deployments, schema_bounds, with_bounds

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
FLOWS = ("rlhf-iteration", "rlhf-campaign", "rlhf-replay")
NEVER = "0 0 1 1 *"  # a real schedule that does not fire during a test (midnight UTC on 1 January)


def served_campaign(world: dict[str, Path], tmp_path_factory) -> tuple[PipelineConfig, list[str]]:
    """``configs/tiny.yaml`` for one iteration on the checkpoint ``world`` in a new run root, as served here and in
    tests/flows/test_served.py: its config and its overrides."""
    overrides = [
        f"run_root={tmp_path_factory.mktemp('served-runs')}",
        f"model.policy={world['policy']}",
        f"data.prompts={world['prompts']}",
        f"data.eval_prompts={world['eval_prompts']}",
        "iterations=1",
    ]
    return load_config(CONFIGS / "tiny.yaml", overrides), overrides


@pytest.fixture(scope="module")
def tiny(checkpoint_world, tmp_path_factory) -> tuple[PipelineConfig, list[str]]:
    return served_campaign(checkpoint_world, tmp_path_factory)


# --- the deployments, without a server ---------------------------------------------------------


def test_three_deployments_named_after_the_campaign_with_the_served_config_as_default(tiny):
    config, _ = tiny
    deployments = build_deployments(config, interval=3600)
    assert [f"{d.flow_name}/{d.name}" for d in deployments] == [f"{flow}/tiny" for flow in FLOWS]
    for deployment in deployments:
        assert deployment.parameters == {"config": config.model_dump(mode="json")}
        assert deployment.concurrency_limit == 1
        assert deployment.entrypoint.startswith("flows.rlhf_pipeline.")
    iteration, campaign, replay = deployments
    # A scheduled run uses the default parameters, which carry no `iteration`: it continues the campaign.
    assert [s.schedule.interval for s in iteration.schedules] == [timedelta(hours=1)]
    assert not campaign.schedules and not replay.schedules
    assert build_deployments(config, cron="0 3 * * *")[0].schedules[0].schedule.cron == "0 3 * * *"


@pytest.mark.parametrize(
    "schedule, message",
    [({"cron": "0 3 * *", "interval": 60}, "not both"), ({"interval": 0}, "positive"), ({"cron": "soon"}, "cron")],
)
def test_a_bad_schedule_is_refused(tiny, schedule, message):
    with pytest.raises(ConfigError, match=message):
        build_deployments(tiny[0], **schedule)


def test_the_form_is_the_pipeline_config_with_every_stage_config(tiny):
    schema = build_deployments(tiny[0])[0]._parameter_openapi_schema.model_dump()
    assert list(schema["properties"]) == ["config", "iteration"], "the in-process `state` is not a form field"
    assert schema["properties"]["config"]["$ref"] == "#/definitions/PipelineConfig"
    definitions = schema["definitions"]
    for section in ("sampling", "reward_model", "advantages", "ppo", "sizes", "model", "data"):
        assert definitions["PipelineConfig"]["properties"][section]["$ref"].startswith("#/definitions/")
    assert definitions["PPOConfig"]["properties"]["clip_eps"]["description"].startswith("Policy ratio clip")
    assert definitions["AdvantageConfig"]["properties"]["kl_estimator"]["enum"] == ["k1", "k2", "k3"]


def _just_outside(keyword: str, bound: float, kind: str) -> float:
    step = 1 if kind == "integer" else 0.5
    return {"exclusiveMinimum": bound, "minimum": bound - step, "maximum": bound + step, "exclusiveMaximum": bound}[
        keyword
    ]


def test_schema_bounds_state_the_stage_config_checks(tiny):
    """Each bound, derived from the dataclass fields, refuses exactly what the dataclass refuses at its edge,
    and the defaults pass."""
    config = tiny[0]
    schema = build_deployments(config)[0]._parameter_openapi_schema.model_dump()
    validate({"config": config.model_dump(mode="json")}, schema, raise_on_error=True)
    # The built-in defaults (which alone name no model, so PipelineConfig() itself is refused) are in bounds.
    validate({"config": PipelineConfig.model_construct().model_dump(mode="json")}, schema, raise_on_error=True)
    sections = ("sampling", "reward_model", "advantages", "ppo", "dpo", "sft")
    section_of = {type(getattr(config, name)): name for name in sections}
    bounds_of = schema_bounds()
    assert {cls.__name__ for cls in bounds_of} == {
        "SamplingConfig",
        "RewardModelConfig",
        "AdvantageConfig",
        "PPOConfig",
        "DPOConfig",
        "SFTSection",
    }
    assert bounds_of[type(config.ppo)]["clip_eps"] == {"exclusiveMinimum": 0}
    for config_class, fields in bounds_of.items():
        properties = schema["definitions"][config_class.__name__]["properties"]
        for field, bounds in fields.items():
            kind = next(o["type"] for o in properties[field].get("anyOf", [properties[field]]) if "type" in o)
            for keyword, bound in bounds.items():
                value = _just_outside(keyword, bound, kind)
                with pytest.raises(ValueError):
                    config_class(**{field: value})
                tree = config.model_dump(mode="json")
                tree[section_of[config_class]][field] = value
                with pytest.raises(SchemaValidationError):
                    validate({"config": tree}, schema, raise_on_error=True)


def test_bounds_refuse_a_renamed_field():
    with pytest.raises(KeyError):
        with_bounds({"properties": {}, "definitions": {"PPOConfig": {"properties": {}}}})


def test_rlhf_config_json_is_a_config_parameter(capsys):
    """`prefect deployment run ... -p config="$(rlhf config ... --json)"` sends a whole, valid config."""
    import json

    from flows.cli import main

    assert main(["config", "--config", str(CONFIGS / "tiny.yaml"), "--set", "advantages.kl_coef=0.1", "--json"]) == 0
    sent = json.loads(capsys.readouterr().out)
    assert PipelineConfig.model_validate(sent) == load_config(CONFIGS / "tiny.yaml", ["advantages.kl_coef=0.1"])


def test_issue34_replay_on_register_triggers_the_replay_deployment_on_each_registered_policy(tiny):
    """`rlhf serve --replay-on-register advantages.kl_coef=0.1`: the event of a registered policy starts the replay of
    its iteration (the event's iteration run) with the served config, changed only where a replay may change it."""
    from flows.replay import forbidden_changes

    config, _ = tiny
    iteration, campaign, replay = build_deployments(config, replay_on_register=["advantages.kl_coef=0.1"])
    assert not iteration.triggers and not campaign.triggers
    (trigger,) = replay.triggers
    assert trigger.expect == {"rlhf.policy.registered"}
    assert trigger.match.root == {"prefect.resource.id": "rlhf.campaign.tiny"}
    assert trigger.parameters["source_run_id"] == "{{ event.payload.iteration_run_id }}"
    replayed = PipelineConfig.model_validate(trigger.parameters["config"])
    assert replayed.advantages.kl_coef == 0.1 and forbidden_changes(replayed, config) == []
    assert not build_deployments(config)[2].triggers


def test_issue34_a_replay_setting_no_replay_can_change_is_refused_before_serving(tiny):
    config, _ = tiny
    with pytest.raises(ConfigError, match="a replay cannot change `sizes.rollout_prompts`"):
        build_deployments(config, replay_on_register=["sizes.rollout_prompts=3"])
