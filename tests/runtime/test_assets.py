"""runtime.assets: the asset key of each stage output and base input, and the events that tell Prefect about them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
from prefect.assets import Asset

from runtime.assets import (
    MATERIALIZED,
    REFERENCED,
    base_asset,
    manifest_asset,
    output_asset,
    output_events,
    publish_output,
)
from runtime.declaration import StageResult
from storage.manifest import Manifest, StageOutput, compute_input_key

CODE = "c0de"
SHA = {"policy": "a1" * 32, "prompts": "b2" * 32, "eval_prompts": "c3" * 32}


def write_output(root: Path, stage: str, iteration: int, *, upstream: dict[str, str], rows: int = 3) -> Manifest:
    """A stage output as run_stage writes it: its iteration in the key's context, the base inputs in its runtime."""
    config = {"stage": {}, "context": {"seed": 0, "iteration": iteration, "base": "f" * 64}}
    key = compute_input_key(stage, config, upstream, code=CODE)
    with StageOutput(
        root / stage / key[:16], stage=stage, input_key=key, config=config, upstream=upstream, code=CODE
    ) as out:
        out.write_table(
            "rows", pa.table({"x": list(range(rows))}), schema=pa.schema([("x", pa.int64())]), rows_per_shard=2
        )
        out.metrics.update(seconds=1.5, gold_win_rate=0.625)
        out.runtime.update(inputs=SHA)
    return out.manifest


def test_keys_are_stable_names_of_the_campaigns_stages_and_base_inputs_and_valid_prefect_assets():
    """Issue 42: Prefect's assets are things made again, each materialisation a version: no digest in a key."""
    key = output_asset("demo", "ppo_update")
    assert key == "rlhf://demo/ppo_update"
    assert base_asset("demo", "prompts") == "rlhf://demo/base/prompts"
    assert Asset(key=key).key == key  # Prefect's own validation of an asset key


def test_a_written_output_is_materialised_with_its_upstream_and_base_inputs_and_its_version_in_the_payload(tmp_path):
    parent = write_output(tmp_path, "initialize", 0, upstream={})
    child = write_output(tmp_path, "rollout", 1, upstream={"policy": parent.digest})
    parents = [manifest_asset("demo", parent)]
    events = output_events("demo", child, parents, reused=False, run_id="r1", path="/x")
    *references, materialised = events
    assert materialised.event == MATERIALIZED
    assert materialised.resource["prefect.resource.id"] == "rlhf://demo/rollout"
    related = [item["prefect.resource.id"] for item in materialised.related]
    assert related == ["rlhf://demo/initialize", "rlhf://demo/base/prompts"]
    assert {item["prefect.resource.role"] for item in materialised.related} == {"asset"}
    assert [event.event for event in references] == [REFERENCED, REFERENCED]
    assert [event.resource["prefect.resource.id"] for event in references] == related
    payload = materialised.payload
    assert payload["campaign"] == "demo" and payload["iteration"] == 1 and payload["stage"] == "rollout"
    assert payload["digest"] == child.digest and payload["input_key"] == child.input_key  # which version
    assert payload["kind"] == "iteration" and payload["base_inputs"] == {"prompts": SHA["prompts"]}
    assert payload["upstream"] == {"policy": parent.digest} and payload["mlflow_run_id"] == "r1"
    assert payload["rows"] == 3 and payload["bytes"] == sum(entry.bytes for entry in child.files) > 0
    assert payload["metrics"] == {"seconds": 1.5, "gold_win_rate": 0.625}


def test_an_update_made_from_the_last_one_and_from_several_outputs_of_a_stage_names_each_upstream_asset_once(tmp_path):
    """The update continues the previous update's policy (the same asset, a new version: no edge to itself); a reward
    model trained on two iterations' preferences names that stage's asset once."""
    first = write_output(tmp_path, "collect_preferences", 0, upstream={})
    second = write_output(tmp_path, "collect_preferences", 1, upstream={"previous": first.digest})
    model = write_output(tmp_path, "train_reward_model", 1, upstream={"a": first.digest, "b": second.digest})
    parents = [manifest_asset("demo", first), manifest_asset("demo", second)]
    *_, materialised = output_events("demo", model, parents, reused=False, run_id="r", path="/x", kind="replay")
    assert [item["prefect.resource.id"] for item in materialised.related] == ["rlhf://demo/collect_preferences"]
    assert materialised.payload["kind"] == "replay"
    *_, again = output_events("demo", second, [manifest_asset("demo", first)], reused=False, run_id="r", path="/x")
    assert again.related == ()


def test_a_reused_output_is_referenced_not_materialised_again(tmp_path):
    output = write_output(tmp_path, "evaluate", 2, upstream={})
    (event,) = output_events("demo", output, [], reused=True, run_id="r1", path="/x")
    assert event.event == REFERENCED
    assert event.resource["prefect.resource.id"] == manifest_asset("demo", output)


def test_nothing_is_sent_outside_a_prefect_run(tmp_path, monkeypatch):
    """A stage called from a script has no server to tell; Prefect would start a temporary one for the event."""
    import prefect.events

    sent = []
    monkeypatch.setattr(prefect.events, "emit_event", lambda *args, **kwargs: sent.append(args))  # what send calls
    output = write_output(tmp_path, "initialize", 0, upstream={})
    folder = tmp_path / "initialize" / output.input_key[:16]
    result = StageResult.of(folder, output, reused=False, run_id=None)
    publish_output(SimpleNamespace(campaign="demo"), result, {})
    assert sent == []


def test_the_outputs_a_stage_was_given_are_found_in_a_mapping_or_a_settings_dataclass(tmp_path):
    from dataclasses import dataclass

    from runtime.assets import _stage_results

    first, second = (
        StageResult.of(tmp_path / name, write_output(tmp_path, name, 0, upstream={}), reused=False, run_id=None)
        for name in ("initialize", "rollout")
    )

    @dataclass(frozen=True)
    class Settings:
        policy: StageResult
        preferences: tuple[StageResult, ...]
        optimizer: object
        kl_coef: float

    assert _stage_results({"policy": first, "preferences": (second,), "optimizer": None}) == [first, second]
    assert _stage_results(Settings(first, (second,), object(), 0.1)) == [first, second]
