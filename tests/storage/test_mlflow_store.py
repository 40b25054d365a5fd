"""MlflowStore against a real MLflow SQLite store in tmp_path: what goes in comes back, in our own types."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import LoggedModelStatus

import storage.files
import storage.mlflow_store
from storage.layout import RunLayout
from storage.mlflow_store import LocalDataset, MlflowStore, ModelVersionSummary, RunSummary


def client(store: MlflowStore) -> MlflowClient:
    """A separate client on the same store, to check what the adapter wrote."""
    return MlflowClient(tracking_uri=store.tracking_uri, registry_uri=store.tracking_uri)


def test_an_experiment_is_created_once_with_its_artifact_location(store: MlflowStore, layout: RunLayout) -> None:
    assert not store.has_experiment("camp") and store.experiment_tags("camp") == {}
    experiment_id = store.ensure_experiment("camp")
    assert store.ensure_experiment("camp") == experiment_id
    assert store.ensure_experiment("other") != experiment_id
    assert client(store).get_experiment(experiment_id).artifact_location == (layout.artifact_root() / "camp").as_uri()
    store.set_experiment_tags(experiment_id, {"rlhf.config_fingerprint": "abc"})
    assert store.experiment_tags("camp") == {
        "mlflow.experimentKind": "custom_model_development",  # MLflow 3's "Machine learning" type
        "rlhf.config_fingerprint": "abc",
    }
    client(store).delete_experiment(experiment_id)
    assert store.has_experiment("camp")
    with pytest.raises(ValueError, match="deleted"):
        store.ensure_experiment("camp")


def test_a_run_comes_back_as_a_summary(store: MlflowStore) -> None:
    experiment_id = store.ensure_experiment("camp")
    parent = store.create_run(experiment_id, name="iteration-0", tags={"rlhf.iteration": 0})
    run_id = store.create_run(experiment_id, name="sample", tags={"rlhf.stage": "sample"}, parent_run_id=parent)
    store.log_metrics(run_id, {"sample/rows": 6})
    store.end_run(run_id, "FAILED")
    run = store.run(run_id)
    assert isinstance(run, RunSummary) and run.run_id == run_id and run.status == "FAILED"
    assert run.tags["rlhf.stage"] == "sample" and run.tags["mlflow.parentRunId"] == parent
    assert run.metrics == {"sample/rows": 6.0}
    assert run.artifact_uri == client(store).get_run(run_id).info.artifact_uri and run.start_time > 0
    assert store.run(parent).tags["rlhf.iteration"] == "0"  # values stringified
    store.mark_running(run_id)
    assert store.run(run_id).status == "RUNNING"
    with pytest.raises(ValueError, match="`status` must be one of RUNNING"):
        store.end_run(run_id, "DONE")
    with pytest.raises(LookupError, match="no run"):
        store.run("0" * 32)


def test_runs_are_searched_by_exact_tags_and_status_page_by_page(store: MlflowStore, monkeypatch) -> None:
    monkeypatch.setattr(storage.mlflow_store, "_RUNS_PER_PAGE", 2)
    experiment_id = store.ensure_experiment("camp")
    made = []
    for index in range(5):
        made.append(store.create_run(experiment_id, name=f"r{index}", tags={"rlhf.kind": "stage"}))
        time.sleep(0.01)  # distinct start times
    other = store.create_run(experiment_id, name="other", tags={"rlhf.kind": "iteration"})
    for run_id in made[:3]:
        store.end_run(run_id)
    found = store.runs(experiment_id, tags={"rlhf.kind": "stage"})
    assert sorted(run.run_id for run in found) == sorted(made)  # three pages of two
    assert len(store.runs(experiment_id)) == 6
    finished = store.runs(experiment_id, tags={"rlhf.kind": "stage"}, status="FINISHED", newest_by="start_time")
    assert [run.run_id for run in finished] == made[2::-1]
    assert [run.run_id for run in store.runs(experiment_id, newest_by="start_time", max_results=1)] == [other]
    assert store.find_run(experiment_id, tags={"rlhf.kind": "stage"}) == made[-1]
    assert store.find_run(experiment_id, tags={"rlhf.kind": "stage"}, status="FINISHED") == made[2]
    assert store.find_run(experiment_id, tags={"rlhf.kind": "replay"}) is None


def test_a_search_value_cannot_escape_its_literal(store: MlflowStore) -> None:
    experiment_id = store.ensure_experiment("camp")
    with pytest.raises(ValueError, match="quotes"):
        store.find_run(experiment_id, tags={"rlhf.iteration_key": "x' or '1'='1"})
    with pytest.raises(ValueError, match="quotes"):
        store.runs(experiment_id, tags={"rlhf.stage": "a\\b"})


def test_params_are_flattened_and_metrics_batched(store: MlflowStore) -> None:
    experiment_id = store.ensure_experiment("camp")
    run_id = store.create_run(experiment_id, name="ppo_update", tags={"rlhf.kind": "stage"})
    store.log_params(run_id, {"ppo": {"clip_eps": 0.2, "schedule": [1, 2]}, "seed": 3, "eos": None})
    store.log_params(run_id, {f"many.p{i}": i for i in range(250)})  # three batches of at most 100
    store.log_params(run_id, {"seed": 4, "new": 1}, skip_logged=True)  # a changed value is kept as it was
    metrics = {f"ppo/m{i}": float(i) for i in range(1500)}  # two batches of at most 1000
    store.log_metrics(run_id, metrics, step=4)
    store.log_metrics(run_id, {"ppo/m7": 7.0}, step=5, skip_logged=True)  # the same value: not logged again
    store.end_run(run_id)
    data = client(store).get_run(run_id).data
    assert data.params["ppo.clip_eps"] == "0.2" and data.params["ppo.schedule"] == "[1, 2]"
    assert data.params["eos"] == "None" and data.params["many.p249"] == "249"
    assert data.params["seed"] == "3" and data.params["new"] == "1"
    assert len(data.params) == 4 + 250 + 1
    assert data.metrics == metrics
    assert [m.step for m in client(store).get_metric_history(run_id, "ppo/m7")] == [4]


def test_metric_steps_are_logged_once(store: MlflowStore) -> None:
    run_id = store.create_run(store.ensure_experiment("camp"), name="ppo_update", tags={})
    rows = [{"step": step, "loss": 1.0 / (step + 1), "kl": 0.1 * step} for step in range(3)]
    store.log_metric_steps(run_id, "ppo_update/train", rows)
    store.log_metric_steps(run_id, "ppo_update/train", rows)
    history = client(store).get_metric_history(run_id, "ppo_update/train/kl")
    assert [(m.step, m.value) for m in history] == [(0, 0.0), (1, 0.1), (2, 0.2)]


def test_artifacts_round_trip_and_delete(store: MlflowStore, tmp_path: Path) -> None:
    run_id = store.create_run(store.ensure_experiment("camp"), name="sample", tags={})
    store.log_text(run_id, '{"seed": 3}', "config.json")
    assert store.load_text(run_id, "config.json") == '{"seed": 3}'
    folder = tmp_path / "out"
    (folder / "actor").mkdir(parents=True)
    (folder / "actor" / "weights.bin").write_bytes(b"\x00\x01")
    (folder / "_manifest.json").write_text("{}")
    store.log_artifacts(run_id, folder, artifact_path="output")
    store.log_artifact(run_id, folder / "_manifest.json", artifact_path="again")
    downloaded = store.download_artifacts(run_id, "output", tmp_path / "down")
    assert (downloaded / "actor" / "weights.bin").read_bytes() == b"\x00\x01"
    store.delete_artifacts(run_id, "output")
    store.delete_artifacts(run_id, "output")  # nothing left: nothing happens
    assert [entry.path for entry in client(store).list_artifacts(run_id)] == ["again", "config.json"]


def test_datasets_keep_as_much_of_their_digest_as_mlflow_stores(store: MlflowStore, tmp_path: Path) -> None:
    run_id = store.create_run(store.ensure_experiment("camp"), name="sample", tags={})
    digest = "ab" * 32
    store.log_datasets(run_id, [LocalDataset("sample/prompts", digest, tmp_path / "prompts")], context="output")
    store.log_datasets(run_id, [], context="input")
    (logged,) = client(store).get_run(run_id).inputs.dataset_inputs
    assert (logged.dataset.name, logged.dataset.digest) == ("sample/prompts", digest[:32])
    assert [(tag.key, tag.value) for tag in logged.tags] == [("mlflow.data.context", "output")]


def test_a_version_is_registered_once_per_run_and_source(store: MlflowStore, tmp_path: Path) -> None:
    experiment_id = store.ensure_experiment("camp")
    first, second = (store.create_run(experiment_id, name=f"ppo-{i}", tags={}) for i in range(2))
    source = (tmp_path / "actor").as_uri()
    assert store.model_versions("camp-actor") == []
    assert store.register_version("camp-actor", source, run_id=first) == "1"
    assert store.register_version("camp-actor", source, run_id=first) == "1"  # once
    assert store.register_version("camp-actor", source + "2", run_id=second, alias="champion") == "2"
    assert sorted(store.model_versions("camp-actor"), key=lambda version: version.version) == [
        ModelVersionSummary("1", first, source, ()),
        ModelVersionSummary("2", second, source + "2", ("champion",)),
    ]
    store.delete_model_version("camp-actor", "1")
    assert [v.version for v in store.model_versions("camp-actor")] == ["2"]


def test_run_and_experiment_urls_open_the_runs_view(store: MlflowStore) -> None:
    experiment_id = store.ensure_experiment("camp")
    run_id = store.create_run(experiment_id, name="iteration-0", tags={})
    runs_view = "?workflowType=machine_learning"  # MLflow 3.17's UI shows runs in this view only
    assert store.run_url(run_id) == f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{run_id}{runs_view}"
    assert store.experiment_url(experiment_id) == f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs{runs_view}"
    elsewhere = MlflowStore(store.tracking_uri, ui_base="http://mlflow.example:5030/")
    assert elsewhere.run_url(run_id).startswith(f"http://mlflow.example:5030/#/experiments/{experiment_id}/runs/")


def test_a_tracking_server_keeps_its_own_artifact_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="artifacts-destination"):
        MlflowStore("http://127.0.0.1:1", artifact_root=tmp_path)


def test_a_logged_model_is_ready_an_output_of_its_run_and_linked_to_its_version(
    store: MlflowStore, monkeypatch
) -> None:
    """Issue 34: MLflow 3's logged model, named on its registered version's side and its own (what MLflow's
    register_model does), once. Issue 42: an external model (its weights where its run keeps them), which MLflow's
    own API resolves and registers."""
    experiment_id = store.ensure_experiment("camp")
    run_id = store.create_run(experiment_id, name="ppo_update", tags={})
    model_id = store.create_logged_model(
        experiment_id, name="actor-iteration-0", run_id=run_id, tags={"rlhf.model": "actor"}, params={}, model_type="x"
    )
    model = store.logged_model(model_id)
    assert (model.name, model.source_run_id, model.tags["rlhf.model"]) == ("actor-iteration-0", run_id, "actor")
    assert client(store).get_logged_model(model_id).status == LoggedModelStatus.READY
    assert [output.model_id for output in client(store).get_run(run_id).outputs.model_outputs] == [model_id]
    version = store.register_version("camp-actor", "file:///models/actor", run_id=run_id, model_id=model_id)
    assert store.register_version("camp-actor", "file:///models/actor", run_id=run_id, model_id=model_id) == version
    assert store.logged_model(model_id).versions == (("camp-actor", version),)  # linked once
    assert store.logged_model(model_id).tags["mlflow.model.isExternal"] == "true"
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.tracking_uri)  # MLflow's own fluent API, on this store
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", store.tracking_uri)
    copy = mlflow.register_model(f"models:/{model_id}", "camp-actor-copy")
    assert copy.source == f"models:/{model_id}"
    assert (Path(mlflow.artifacts.download_artifacts(f"models:/{model_id}")) / "MLmodel").is_file()


def test_metrics_go_with_their_model_and_dataset_once_and_rank_the_models(store: MlflowStore) -> None:
    experiment_id = store.ensure_experiment("camp")
    models = []
    for score in (0.25, 0.75, 0.75):
        run_id = store.create_run(experiment_id, name="evaluate", tags={})
        model_id = store.create_logged_model(
            experiment_id, name="actor", run_id=run_id, tags={"rlhf.model": "actor"}, params={}, model_type="x"
        )
        dataset = ("eval_prompts[:8]", "d" * 64)
        store.log_model_metrics(run_id, model_id, {"evaluate/gold_win_rate": score}, dataset=dataset)
        store.log_model_metrics(run_id, model_id, {"evaluate/gold_win_rate": score}, dataset=dataset)  # a retry
        models.append(model_id)
        time.sleep(0.01)  # distinct creation times: of equal scores the newer ranks first
    (metric,) = store.logged_model(models[0]).metrics
    assert (metric.key, metric.value, metric.dataset_name, metric.dataset_digest) == (
        "evaluate/gold_win_rate",
        0.25,
        "eval_prompts[:8]",
        "d" * 32,  # as much of the digest as MLflow stores
    )
    ranked = store.logged_models(
        experiment_id, tags={"rlhf.model": "actor"}, best_by="evaluate/gold_win_rate", dataset=dataset
    )
    assert [model.model_id for model in ranked] == [models[2], models[1], models[0]]
    assert (
        store.logged_models(experiment_id, run_id=client(store).get_logged_model(models[1]).source_run_id)[0].model_id
        == models[1]
    )


def _rows(database: Path) -> dict[str, list]:
    """Every table's rows, and the schema, of a SQLite database; creation times left out. A table's definition is
    compared line by line in any order: MLflow's migrations write a table's constraints in an order that differs from
    one migration to the next (two fresh stores differ so too)."""
    import sqlite3

    def lines(sql: str | None) -> list[str]:
        return sorted(line.strip().rstrip(",") for line in (sql or "").splitlines())

    with sqlite3.connect(database) as connection:
        tables = [name for (name,) in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        schema = connection.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
        rows = {"schema": sorted((kind, name, lines(sql)) for kind, name, sql in schema)}
        for table in tables:
            columns = [column[1] for column in connection.execute(f'PRAGMA table_info("{table}")')]
            kept = [column for column in columns if column not in ("creation_time", "last_update_time")]
            rows[table] = sorted(connection.execute(f'SELECT {", ".join(kept)} FROM "{table}"').fetchall())
    return rows


def test_a_new_store_is_a_copy_of_an_empty_migrated_one_and_equals_a_freshly_migrated_store(tmp_path: Path) -> None:
    """MLflow's schema migrations run once per MLflow version (into ``cache_dir()``); a new store copied from that empty
    one holds what a store MLflow made itself holds: the same schema and rows, the Default experiment where this
    process puts it, and the next experiment numbered 1."""
    fresh, seeded = tmp_path / "fresh.db", tmp_path / "seeded.db"
    for database, make in ((fresh, lambda uri: MlflowClient(uri, uri)), (seeded, MlflowStore)):
        make(f"sqlite:///{database}")
        MlflowClient(f"sqlite:///{database}").create_experiment("camp")
    assert (storage.files.cache_dir() / f"mlflow-{__import__('mlflow').__version__}-empty.db").is_file()
    assert _rows(seeded) == _rows(fresh)
    assert [(e.experiment_id, e.name) for e in MlflowClient(f"sqlite:///{seeded}").search_experiments()] == [
        ("1", "camp"),
        ("0", "Default"),
    ]
