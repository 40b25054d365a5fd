"""Tracker against a real MLflow SQLite store in tmp_path: stage records, downloads, models, iterations, races.

The generic record operations it inherits are tested in ``test_mlflow_store.py``.
"""

from __future__ import annotations

import filecmp
import multiprocessing
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from mlflow import MlflowClient

from storage.layout import RunLayout
from storage.manifest import CorruptOutputError, Manifest, StageOutput, compute_input_key, read_manifest
from storage.schemas import PROMPTS
from storage.shards import read_table
from storage.tracking import MissingOutputError, StageRecord, Tracker
from tests.storage import _tracking_worker

CODE = "c0de" * 16


def client(tracker: Tracker) -> MlflowClient:
    """A separate client on the same store, to check what the tracker wrote."""
    return MlflowClient(tracking_uri=tracker.tracking_uri, registry_uri=tracker.tracking_uri)


ITERATION_TAGS = {"rlhf.campaign": "camp", "rlhf.kind": "iteration", "rlhf.iteration": "0"}


def _stage_output(layout: RunLayout, stage: str = "sample", *, rows: int = 6) -> tuple[Path, Manifest]:
    config = {"rows": rows, "nested": {"temperature": 0.7}}
    key = compute_input_key(stage, config, {}, code=CODE)
    final_dir = layout.stage_dir(stage, key)
    with StageOutput(final_dir, stage=stage, input_key=key, config=config, upstream={}, code=CODE) as out:
        out.write_table(
            "prompts",
            pa.table({"prompt_id": range(rows), "prompt": ["p"] * rows, "messages": [[]] * rows}, schema=PROMPTS),
            schema=PROMPTS,
            rows_per_shard=4,
        )
        (out.path / "actor").mkdir()
        (out.path / "actor" / "config.json").write_text('{"model_type": "gpt2"}')
        (out.path / "actor" / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    return final_dir, out.manifest


def _record(
    tracker: Tracker, layout: RunLayout, stage: str = "sample", *, finish: bool = True
) -> tuple[str, str, Manifest]:
    experiment_id = tracker.experiment_id("camp")
    parent = tracker.start_run(experiment_id, name="iteration-0", tags=ITERATION_TAGS)
    final_dir, manifest = _stage_output(layout, stage)
    run_id = tracker.start_run(
        experiment_id, name=stage, tags={"rlhf.stage": stage, "rlhf.kind": "stage"}, parent_run_id=parent
    )
    tracker.log_stage_output(run_id, final_dir, manifest)
    if finish:
        tracker.end_run(run_id)
    return experiment_id, run_id, manifest


def test_experiment_per_campaign_with_explicit_artifact_location(tracker: Tracker, layout: RunLayout) -> None:
    experiment_id = tracker.experiment_id("camp")
    assert tracker.experiment_id("camp") == experiment_id
    assert tracker.experiment_id("other") != experiment_id
    location = client(tracker).get_experiment(experiment_id).artifact_location
    assert location == (layout.artifact_root() / "camp").as_uri()
    with pytest.raises(ValueError, match="campaign"):
        tracker.experiment_id("../escape")


def test_stage_record_is_found_by_its_input_key(tracker: Tracker, layout: RunLayout) -> None:
    experiment_id, run_id, manifest = _record(tracker, layout)
    record = tracker.find_stage_record(experiment_id, "sample", manifest.input_key)
    assert record == StageRecord(
        run_id=run_id,
        input_key=manifest.input_key,
        manifest_digest=manifest.digest,
        artifact_uri=client(tracker).get_run(run_id).info.artifact_uri,
    )
    assert tracker.find_stage_record(experiment_id, "sample", "0" * 64) is None
    assert tracker.find_stage_record(experiment_id, "rollout", manifest.input_key) is None
    tags = client(tracker).get_run(run_id).data.tags
    assert tags["rlhf.input_key"] == manifest.input_key and tags["rlhf.manifest_digest"] == manifest.digest
    assert tags["mlflow.parentRunId"]


def test_unfinished_stage_run_is_not_a_record(tracker: Tracker, layout: RunLayout) -> None:
    experiment_id, run_id, manifest = _record(tracker, layout, finish=False)
    assert tracker.find_stage_record(experiment_id, "sample", manifest.input_key) is None
    tracker.end_run(run_id, status="FAILED")
    assert tracker.find_stage_record(experiment_id, "sample", manifest.input_key) is None


def test_stage_output_downloads_into_an_empty_folder_identically(uploading_tracker: Tracker, layout: RunLayout) -> None:
    tracker = uploading_tracker
    _, run_id, manifest = _record(tracker, layout)
    original = layout.stage_dir("sample", manifest.input_key)
    restored = tracker.download_stage_output(run_id, layout.cache_dir() / "restored")
    assert restored == layout.cache_dir() / "restored"
    assert read_manifest(restored) == manifest  # verified again: sizes and sha256 of every file
    for entry in manifest.files:
        assert filecmp.cmp(original / entry.path, restored / entry.path, shallow=False), entry.path
    assert read_table(restored, "prompts").equals(read_table(original, "prompts"))
    assert sorted(path.name for path in layout.cache_dir().iterdir()) == ["restored"]  # no staging left

    (layout.cache_dir() / "empty").mkdir()
    assert read_manifest(tracker.download_stage_output(run_id, layout.cache_dir() / "empty")) == manifest
    with pytest.raises(FileExistsError, match="new or empty"):
        tracker.download_stage_output(run_id, restored)


def test_corrupt_artifacts_are_refused_on_download(uploading_tracker: Tracker, layout: RunLayout) -> None:
    tracker = uploading_tracker
    _, run_id, manifest = _record(tracker, layout)
    artifact = next(layout.artifact_root().rglob("output/prompts-00001.parquet"))
    artifact.write_bytes(artifact.read_bytes()[:-3])
    with pytest.raises(CorruptOutputError, match="prompts-00001.parquet"):
        tracker.download_stage_output(run_id, layout.cache_dir() / "restored")
    assert not layout.cache_dir().exists() or not list(layout.cache_dir().iterdir())


def test_a_local_store_records_outputs_by_reference_and_copies_nothing(tracker: Tracker, layout: RunLayout) -> None:
    _, run_id, manifest = _record(tracker, layout)
    output = layout.stage_dir("sample", manifest.input_key)
    artifacts = [
        path.relative_to(layout.artifact_root()) for path in layout.artifact_root().rglob("*") if path.is_file()
    ]
    assert [path.parts[-2:] for path in artifacts] == [("output", "_manifest.json")]  # the manifest, no data
    assert client(tracker).get_run(run_id).data.tags["rlhf.output_path"] == str(output)
    elsewhere = tracker.download_stage_output(run_id, layout.cache_dir() / "copy")  # a verified copy on demand
    assert read_manifest(elsewhere) == manifest
    assert tracker.download_stage_output(run_id, output.parent / "fresh").is_dir()
    shutil.rmtree(output)
    with pytest.raises(MissingOutputError, match="no longer exists"):
        tracker.download_stage_output(run_id, layout.cache_dir() / "again")


def test_tables_are_logged_as_datasets(tracker: Tracker, layout: RunLayout) -> None:
    _, run_id, manifest = _record(tracker, layout)
    inputs = client(tracker).get_run(run_id).inputs.dataset_inputs
    assert [(i.dataset.name, [(t.key, t.value) for t in i.tags]) for i in inputs] == [
        ("sample/prompts", [("mlflow.data.context", "output")])
    ]
    digest = inputs[0].dataset.digest
    assert len(digest) == 32 and int(digest, 16) >= 0
    _, other_run, _ = _record(tracker, layout, stage="sample_again")
    assert client(tracker).get_run(other_run).inputs.dataset_inputs[0].dataset.digest == digest  # same bytes


def test_register_model_adds_versions_and_moves_aliases(tracker: Tracker, layout: RunLayout) -> None:
    _, run_id, manifest = _record(tracker, layout)
    first_dir = layout.stage_dir("sample", manifest.input_key)
    assert tracker.register_model(run_id, name="camp-actor", stage_dir=first_dir, subfolder="actor") == "1"
    _, second_run, second = _record(tracker, layout, stage="sample_again")
    second_dir = layout.stage_dir("sample_again", second.input_key)
    version = tracker.register_model(
        second_run, name="camp-actor", stage_dir=second_dir, subfolder="actor", alias="champion"
    )
    assert version == "2"
    registry = client(tracker)
    latest = registry.get_model_version_by_alias("camp-actor", "latest")  # MLflow's own: the newest version
    assert latest.run_id == second_run and latest.source == (second_dir / "actor").as_uri()  # by reference
    assert str(registry.get_model_version_by_alias("camp-actor", "champion").version) == "2"


def test_an_uploading_store_registers_the_uploaded_folder(uploading_tracker: Tracker, layout: RunLayout) -> None:
    _, run_id, manifest = _record(uploading_tracker, layout)
    stage_dir = layout.stage_dir("sample", manifest.input_key)
    uploading_tracker.register_model(run_id, name="camp-actor", stage_dir=stage_dir, subfolder="actor")
    registry = client(uploading_tracker)
    assert registry.get_model_version_by_alias("camp-actor", "latest").source.endswith(
        f"{run_id}/artifacts/output/actor"
    )
    restored = Path(registry.download_artifacts(run_id, "output/actor", dst_path=str(layout.cache_dir())))
    assert (restored / "model.safetensors").read_bytes() == bytes(range(256)) * 8


def test_latest_iteration_counts_finished_iterations_numerically(tracker: Tracker) -> None:
    experiment_id = tracker.experiment_id("camp")
    assert tracker.latest_iteration(experiment_id) is None
    for iteration, status in [(0, "FINISHED"), (9, "FINISHED"), (10, "FINISHED"), (11, "FAILED"), (12, None)]:
        run_id = tracker.start_run(
            experiment_id, name=f"iteration-{iteration}", tags={**ITERATION_TAGS, "rlhf.iteration": str(iteration)}
        )
        if status is not None:
            tracker.end_run(run_id, status=status)
    stage_run = tracker.start_run(experiment_id, name="x", tags={"rlhf.kind": "stage", "rlhf.iteration": "99"})
    tracker.end_run(stage_run)
    assert tracker.latest_iteration(experiment_id) == 10


def test_finished_iterations_are_the_newest_finished_run_of_each_number_that_nothing_superseded(tracker: Tracker):
    experiment_id = tracker.experiment_id("camp")
    runs = {}
    for name, iteration in [("old-0", 0), ("old-1", 1), ("new-0", 0), ("unfinished-1", 1)]:
        runs[name] = tracker.start_run(
            experiment_id, name=name, tags={**ITERATION_TAGS, "rlhf.iteration": str(iteration)}
        )
        if name != "unfinished-1":
            tracker.end_run(runs[name])
    assert {n: r.run_id for n, r in tracker.finished_iterations(experiment_id).items()} == {
        0: runs["new-0"],
        1: runs["old-1"],
    }
    tracker.set_tags(runs["old-1"], {"rlhf.superseded_by": runs["new-0"]})
    assert {n: r.run_id for n, r in tracker.finished_iterations(experiment_id).items()} == {0: runs["new-0"]}
    assert tracker.latest_iteration(experiment_id) == 0


def test_two_processes_share_one_fresh_store(tmp_path: Path) -> None:
    """Both create the store and the campaign at the same moment; nothing either logs is lost."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    stages = ["rollout", "sample"]
    workers = [
        context.Process(target=_tracking_worker.write_stage, args=(str(tmp_path), stage, barrier)) for stage in stages
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=180)
    assert [worker.exitcode for worker in workers] == [0, 0]

    layout = RunLayout(tmp_path)
    tracker = Tracker(layout.tracking_uri(), artifact_root=layout.artifact_root())
    experiments = client(tracker).search_experiments()
    assert sorted(experiment.name for experiment in experiments) == ["Default", "race"]
    experiment_id = tracker.experiment_id("race")
    for stage in stages:
        key = compute_input_key(stage, {"stage": stage}, {}, code=CODE)
        record = tracker.find_stage_record(experiment_id, stage, key)
        assert record is not None, stage
        run = client(tracker).get_run(record.run_id)
        assert len(run.data.params) == _tracking_worker.PARAMS
        history = client(tracker).get_metric_history(record.run_id, f"{stage}/a")
        assert sorted(m.step for m in history) == list(range(_tracking_worker.METRIC_STEPS))
        restored = tracker.download_stage_output(record.run_id, tmp_path / "restored" / stage)
        assert read_table(restored, "prompts").column("prompt").to_pylist() == [stage, stage]
    assert tracker.latest_iteration(experiment_id) is None  # iteration runs here carry no number
