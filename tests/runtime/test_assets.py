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


def test_keys_name_the_campaign_iteration_stage_and_digest_and_are_valid_prefect_assets():
    key = output_asset("demo", "ppo_update", 3, "0123456789abcdef" * 4)
    assert key == "rlhf://demo/iteration-3/ppo_update/0123456789abcdef"
    assert base_asset("demo", "prompts", "b2" * 32) == "rlhf://demo/base/prompts/b2b2b2b2b2b2b2b2"
    assert Asset(key=key).key == key  # Prefect's own validation of an asset key


def test_a_written_output_is_materialised_with_its_upstream_and_base_inputs_and_its_figures(tmp_path):
    parent = write_output(tmp_path, "initialize", 0, upstream={})
    child = write_output(tmp_path, "rollout", 1, upstream={"policy": parent.digest})
    parents = [manifest_asset("demo", parent)]
    events = output_events("demo", child, parents, reused=False, run_id="r1", path="/x")
    *references, materialised = events
    assert materialised.event == MATERIALIZED
    assert materialised.resource["prefect.resource.id"] == f"rlhf://demo/iteration-1/rollout/{child.digest[:16]}"
    related = [item["prefect.resource.id"] for item in materialised.related]
    assert related == [
        f"rlhf://demo/iteration-0/initialize/{parent.digest[:16]}",
        base_asset("demo", "prompts", SHA["prompts"]),
    ]
    assert {item["prefect.resource.role"] for item in materialised.related} == {"asset"}
    assert [event.event for event in references] == [REFERENCED, REFERENCED]
    assert [event.resource["prefect.resource.id"] for event in references] == related
    payload = materialised.payload
    assert payload["campaign"] == "demo" and payload["iteration"] == 1 and payload["stage"] == "rollout"
    assert payload["digest"] == child.digest and payload["input_key"] == child.input_key
    assert payload["upstream"] == {"policy": parent.digest} and payload["mlflow_run_id"] == "r1"
    assert payload["rows"] == 3 and payload["bytes"] == sum(entry.bytes for entry in child.files) > 0
    assert payload["metrics"] == {"seconds": 1.5, "gold_win_rate": 0.625}


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
