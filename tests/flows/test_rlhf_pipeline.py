"""End to end: the campaign flow on a Hugging Face checkpoint folder saved by the test, under a
real (temporary) Prefect server, with a real SQLite MLflow store and real Parquet shards."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

from campaign.config import load_config
from flows.rlhf_pipeline import rlhf_campaign
from runtime.checkpointer import OPTIMIZERS

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
STAGES = [
    "sample_candidates",
    "collect_preferences",
    "train_reward_model",
    "rollout",
    "compute_advantages",
    "ppo_update",
    "evaluate",
]


@pytest.fixture(scope="module")
def campaign(prefect_server, checkpoint_world, tmp_path_factory):
    run_root = tmp_path_factory.mktemp("runs")
    config = load_config(
        CONFIGS / "tiny.yaml",
        [
            f"run_root={run_root}",
            # a name no other test's campaign has: the Prefect server is the test session's, and the asset and event
            # tests below read what it holds of this campaign
            "campaign=pipeline-e2e",
            f"model.policy={checkpoint_world['policy']}",
            f"data.prompts={checkpoint_world['prompts']}",
            f"data.eval_prompts={checkpoint_world['eval_prompts']}",
        ],
    )
    first = rlhf_campaign(config, return_state=True)
    return config, first


def test_the_campaigns_process_froze_its_long_lived_objects_at_its_second_iteration(campaign):
    """flows.heap: the campaign (two iterations) ran in this process, so its heap was collected and frozen."""
    assert gc.get_freeze_count() > 0


def _mlflow_runs(config):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{config.run_root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(config.campaign)
    return client, experiment, client.search_runs([experiment.experiment_id], max_results=1000)


def test_campaign_writes_every_stage_and_records_it_in_mlflow(campaign):
    config, state = campaign
    assert state.is_completed(), state
    final = state.result()
    assert final.policy.stage == "ppo_update" and len(final.preferences) == config.iterations

    client, experiment, runs = _mlflow_runs(config)
    iterations = [run for run in runs if run.data.tags.get("rlhf.kind") == "iteration"]
    assert sorted(int(run.data.tags["rlhf.iteration"]) for run in iterations) == list(range(config.iterations))
    for parent in iterations:
        assert parent.info.status == "FINISHED"
        children = [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        stages = {run.data.tags["rlhf.stage"] for run in children}
        assert set(STAGES) <= stages
        assert "evaluate/kl_to_reference" in parent.data.metrics
        assert "ppo_update/approx_kl" in parent.data.metrics
    stage_runs = [run for run in runs if run.data.tags.get("rlhf.kind") == "stage"]
    for run in stage_runs:
        assert run.info.status == "FINISHED"
        assert run.data.tags["rlhf.input_key"]
        assert any(a.path == "output" for a in client.list_artifacts(run.info.run_id))
    rollout_run = next(run for run in stage_runs if run.data.tags["rlhf.stage"] == "rollout")
    assert rollout_run.inputs.dataset_inputs, "rollout output is logged as an MLflow dataset"
    for suffix in ("actor", "critic", "reward-model"):
        version = client.get_model_version_by_alias(f"{config.campaign}-{suffix}", "latest")
        assert int(version.version) == config.iterations
        assert version.source.startswith("file://") and Path(version.source[len("file://") :]).is_dir()


def test_each_output_exists_once_and_only_the_newest_policy_keeps_optimizer_states(campaign):
    config, state = campaign
    final = state.result()
    # MLflow holds each stage's manifest, never a second copy of its files.
    artifacts = [path for path in (config.run_root / "mlartifacts").rglob("*") if path.is_file()]
    # Besides: the views the UI shows (the evaluation samples and the top responses as tables, the
    # over-optimisation figure), and each logged model's MLmodel file (an external model's description, no weights).
    views = {"samples.json", "top_responses.json", "overoptimisation.png", "MLmodel"}
    assert artifacts and {path.name for path in artifacts} == {"_manifest.json", "config.json", *views}
    with_states = [
        folder.name
        for folder in (config.run_root / config.campaign / "ppo_update").iterdir()
        if (folder / OPTIMIZERS).is_dir()
    ]
    assert with_states == [final.policy.directory.name]
    # The newest update continued the previous optimizer states; the first started fresh.
    assert final.policy.metrics["optimizer_restored"] == 1.0


def test_running_again_does_no_work_and_says_so(campaign):
    config, _ = campaign
    _, _, runs_before = _mlflow_runs(config)
    state = rlhf_campaign(config, return_state=True)
    final = state.result()
    assert final.policy.reused and final.reward_model.reused
    _, _, runs_after = _mlflow_runs(config)
    assert len(runs_after) == len(runs_before), "a second run must not create MLflow runs"

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        iteration_runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[state.state_details.flow_run_id])
            )
        )
    assert iteration_runs == [], "finished iterations are history: no iteration flow runs, no stage task runs"


def test_issue34_every_output_is_a_prefect_asset_materialised_once_from_its_upstream(campaign):
    """Each stage output is an asset named by campaign, iteration, stage and digest, materialised by the run that
    wrote it (not again by the run that reused it: the one above), with its upstream assets and base inputs as
    related resources and its figures as payload; the lineage artifact draws them, up to each evaluation."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    from runtime.assets import MATERIALIZED, base_dependencies, manifest_asset
    from storage.manifest import read_manifest
    from tests.flows.conftest import prefect_events

    config, _ = campaign
    manifests = [
        read_manifest(path.parent, verify=False)
        for path in (config.run_root / config.campaign).glob("*/*/_manifest.json")
    ]
    prefix = f"rlhf://{config.campaign}/"
    events = prefect_events(MATERIALIZED, resource_prefix=prefix, expect=len(manifests))
    assert sorted(event.payload["digest"] for event in events) == sorted(m.digest for m in manifests)  # once each
    by_digest = {manifest.digest: manifest for manifest in manifests}
    for event in events:
        manifest = by_digest[event.payload["digest"]]
        assert event.resource.id == manifest_asset(config.campaign, manifest) == f"{prefix}{manifest.stage}"
        assert event.payload["campaign"] == config.campaign and event.payload["stage"] == manifest.stage
        assert event.payload["bytes"] > 0 and event.payload["metrics"] == manifest.metrics
        assert event.payload["kind"] == "iteration"
        parents = [by_digest[digest] for digest in manifest.upstream.values() if digest in by_digest]  # not optimizers
        upstream = {manifest_asset(config.campaign, parent) for parent in parents} - {event.resource.id}
        related = {resource.id for resource in event.related if resource.role == "asset"}
        assert related == upstream | set(base_dependencies(config.campaign, manifest))
        assert {"flow-run", "task-run"} <= {resource.role for resource in event.related}  # who materialised it
    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"{config.campaign}-lineage"])),
            sort=ArtifactSort.CREATED_DESC,  # the last iteration's version
            limit=1,
        )
    evaluations = [manifest for manifest in manifests if manifest.stage == "evaluate"]
    assert "```mermaid" in artifact.data and len(evaluations) == config.iterations
    for manifest in evaluations:
        assert f": {manifest_asset(config.campaign, manifest)} {manifest.digest[:16]}\n" in artifact.data  # drawn


def test_issue34_each_checkpoint_is_a_logged_model_with_its_metrics_on_the_data_they_were_computed_on(
    campaign, monkeypatch
):
    """MLflow's models view: a logged model per actor, critic and reward model, linked to its run, folder, lineage and
    registered version; evaluation and reward-model figures logged with the model and the data's digest; `best`
    on the registered actor with the highest gold win rate; and the Prefect events that said so."""
    import hashlib

    from tests.flows.conftest import prefect_events

    config, _ = campaign
    client, experiment, runs = _mlflow_runs(config)
    stage_runs = {run.info.run_id: run for run in runs if run.data.tags.get("rlhf.kind") == "stage"}
    runs_of = {
        stage: sorted(run_id for run_id, run in stage_runs.items() if run.data.tags["rlhf.stage"] == stage)
        for stage in STAGES
    }
    models = client.search_logged_models([experiment.experiment_id])
    named = {
        role: [model for model in models if model.tags["rlhf.model"] == role]
        for role in ("actor", "critic", "reward_model")
    }
    assert sorted(model.source_run_id for model in named["actor"]) == runs_of["ppo_update"]
    assert sorted(model.source_run_id for model in named["critic"]) == runs_of["ppo_update"]
    assert sorted(model.source_run_id for model in named["reward_model"]) == runs_of["train_reward_model"]
    for model in models:
        run = stage_runs[model.source_run_id]
        assert model.tags["rlhf.manifest_digest"] == run.data.tags["rlhf.manifest_digest"]
        assert model.tags["rlhf.iteration"] == run.data.tags["rlhf.iteration"]
        role = model.tags["rlhf.model"]
        assert model.name == f"{role}-iteration-{run.data.tags['rlhf.iteration']}"  # told apart in the Models tab
        assert Path(model.tags["rlhf.source"].removeprefix("file://")).name == role
        assert Path(model.tags["rlhf.source"].removeprefix("file://")).is_dir()
        (version,) = json.loads(model.tags["mlflow.modelVersions"])  # registered once, linked both ways
        suffix = role.replace("_", "-")
        assert version["name"] == f"{config.campaign}-{suffix}"
        assert client.get_model_version(version["name"], version["version"]).run_id == model.source_run_id
    actors = {model.tags["rlhf.iteration"]: model for model in named["actor"]}
    assert "rlhf.parent_model" not in actors["0"].tags  # iteration 0 starts from the base (initialize's output)
    assert actors["1"].tags["rlhf.parent_model"] == actors["0"].model_id
    assert actors["1"].tags["rlhf.upstream.policy"] == actors["0"].tags["rlhf.manifest_digest"]

    eval_digest = hashlib.sha256(Path(config.data.eval_prompts).read_bytes()).hexdigest()[:32]
    for model in named["actor"]:
        evaluation = next(
            run
            for run in stage_runs.values()
            if run.data.tags["rlhf.stage"] == "evaluate"
            and run.data.tags["rlhf.iteration"] == model.tags["rlhf.iteration"]
        )
        figures = {metric.key: metric for metric in model.metrics}
        win_rate = figures["evaluate/gold_win_rate"]
        assert win_rate.value == evaluation.data.metrics["evaluate/gold_win_rate"]
        assert (win_rate.dataset_name, win_rate.dataset_digest) == (
            f"eval_prompts[:{config.sizes.eval_prompts}]",
            eval_digest,
        )
        assert win_rate.run_id == evaluation.info.run_id and "evaluate/seconds" not in figures
    for model in named["reward_model"]:
        accuracy = next(metric for metric in model.metrics if metric.key == "train_reward_model/eval_accuracy")
        assert accuracy.dataset_name == "held_out_pairs"
        assert accuracy.value == stage_runs[model.source_run_id].data.metrics["train_reward_model/eval_accuracy"]

    best = max(
        named["actor"],
        key=lambda model: (
            next(m.value for m in model.metrics if m.key.endswith("gold_win_rate")),
            model.tags["rlhf.iteration"],
        ),
    )
    best_version = client.get_model_version_by_alias(f"{config.campaign}-actor", "best")
    assert best_version.run_id == best.source_run_id

    # Issue 42: MLflow's own API opens the registered policy, and registers the logged model it was made from.
    import mlflow
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{config.run_root / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", f"sqlite:///{config.run_root / 'mlflow.db'}")
    opened = AutoModelForCausalLM.from_pretrained(
        mlflow.artifacts.download_artifacts(f"models:/{config.campaign}-actor@best")
    )
    written = load_file(Path(best.tags["rlhf.source"].removeprefix("file://")) / "model.safetensors")
    for name, value in opened.state_dict().items():
        if name in written:
            torch.testing.assert_close(value, written[name], rtol=0, atol=0, msg=name)
    assert best.tags["mlflow.model.isExternal"] == "true"
    assert mlflow.register_model(f"models:/{best.model_id}", f"{config.campaign}-best-copy").source == (
        f"models:/{best.model_id}"
    )

    registered = prefect_events("rlhf.policy.registered", resource_prefix=f"rlhf.campaign.{config.campaign}", expect=2)
    assert sorted(event.payload["model_id"] for event in registered) == sorted(m.model_id for m in named["actor"])
    for event in registered:
        assert event.payload["campaign"] == config.campaign and event.payload["model"] == f"{config.campaign}-actor"
        assert (
            event.payload["iteration_run_id"]
            == stage_runs[event.payload["stage_run_id"]].data.tags["mlflow.parentRunId"]
        )
    evaluated = prefect_events("rlhf.iteration.evaluated", resource_prefix=f"rlhf.campaign.{config.campaign}", expect=2)
    assert sorted(event.payload["iteration"] for event in evaluated) == [0, 1]
    for event in evaluated:
        assert event.payload["model_id"] in {model.model_id for model in named["actor"]}
        assert (
            event.payload["dataset"]["digest"]
            == hashlib.sha256(Path(config.data.eval_prompts).read_bytes()).hexdigest()
        )
        assert "evaluate/gold_win_rate" in event.payload["metrics"] and event.payload["kind"] == "iteration"
    assert evaluated[-1].payload["best_version"] == str(best_version.version)


def test_issue15_mlflow_shows_training_curves_samples_and_the_overoptimisation_figure(campaign):
    config, _ = campaign
    client, experiment, runs = _mlflow_runs(config)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # opens on runs, not traces
    stage_runs = {(run.data.tags["rlhf.iteration"], run.data.tags.get("rlhf.stage")): run for run in runs}
    ppo = stage_runs[("0", "ppo_update")]
    history = client.get_metric_history(ppo.info.run_id, "ppo_update/train/approx_kl")
    steps = int(ppo.data.metrics["ppo_update/optimizer_steps"])
    assert [metric.step for metric in history] == list(range(1, steps + 1))  # a point per optimizer step
    assert {"ppo_update/train/clip_fraction", "ppo_update/train/policy_loss"} <= set(ppo.data.metrics)
    rm = stage_runs[("0", "train_reward_model")]
    assert len(client.get_metric_history(rm.info.run_id, "train_reward_model/train/accuracy")) >= 1
    assert rm.data.metrics["train_reward_model/eval_pairs"] >= 1  # what the accuracy rests on
    evaluate = stage_runs[("1", "evaluate")]
    table = json.loads(Path(client.download_artifacts(evaluate.info.run_id, "samples.json")).read_text())
    assert {"prompt", "policy_response", "policy_reward", "policy_gold", "policy_kl"} <= set(table["columns"])
    assert len(table["data"]) == config.sizes.eval_prompts
    iteration = next(
        run for run in runs if run.data.tags.get("rlhf.kind") == "iteration" and run.data.tags["rlhf.iteration"] == "1"
    )
    assert iteration.info.run_name == "iteration-1"
    figure = Path(client.download_artifacts(iteration.info.run_id, "overoptimisation.png"))
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_issue15_the_prefect_artifact_shows_every_metric_the_figure_and_the_mlflow_link(campaign):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    config, _ = campaign
    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"{config.campaign}-iteration-1"])), limit=1
        )
        flow_runs = client.read_flow_runs()
    markdown = artifact.data
    assert "| evaluate/kl_to_reference |" in markdown  # one metric per row: nothing cut off
    assert "![over-optimisation" in markdown and "(data:image/png;base64," in markdown  # shows with no server
    assert "http://127.0.0.1:5000/#/experiments/" in markdown  # a local store: where docs/operating.md starts the UI
    assert {f"{config.campaign}-iteration-0", f"{config.campaign}-campaign"} <= {run.name for run in flow_runs}


def test_a_finished_campaign_records_what_produced_each_iteration(campaign):
    """Every iteration run says which code (fingerprint and version) and which input contents produced it, and so
    does every manifest; nothing differs from what is here now."""
    from campaign.history import code_in_use, difference_note, input_contents, versions_in_use
    from campaign.store import store_tracker
    from flows.iterations import resolve_base
    from runtime.versions import library_versions
    from storage.manifest import package_version, read_manifest

    config, _ = campaign
    base = resolve_base.fn(config)
    tracker = store_tracker(config)
    finished = tracker.finished_iterations(tracker.experiment_id(config.campaign))
    assert sorted(finished) == list(range(config.iterations))
    for run in finished.values():
        assert run.tags["rlhf.code"] == code_in_use(base)
        assert run.tags["rlhf.package_version"] == package_version()
        assert json.loads(run.tags["rlhf.inputs"]) == input_contents(base)
        assert json.loads(run.tags["rlhf.versions"]) == versions_in_use(base, None) == library_versions()
    assert set(input_contents(base)) == {"model.policy", "data.prompts", "data.eval_prompts"}
    for manifest_path in (config.run_root / config.campaign).glob("*/*/_manifest.json"):
        manifest = read_manifest(manifest_path.parent, verify=False)
        assert manifest.code and manifest.package_version == package_version()
        assert manifest.runtime["inputs"] == base.contents
        assert manifest.runtime["versions"] == library_versions()  # issue 32
    assert difference_note(config, finished) is None


def test_the_reuse_decision_loads_neither_torch_nor_prefect(campaign):
    """What makes `rlhf run` of a finished campaign take seconds: the decision reads MLflow and the manifests
    only (torch, transformers and Prefect take most of a full command's start), and so does checking the finished
    outputs (issue 32)."""
    config, _ = campaign
    script = (
        "import json, sys\n"
        "from campaign.config import PipelineConfig\n"
        "from campaign.history import campaign_finished, difference_note, finished_iterations\n"
        "from campaign.verification import check_finished_outputs\n"
        "from flows.report import campaign_report\n"
        f"config = PipelineConfig.model_validate_json({config.model_dump_json()!r})\n"
        "runs = finished_iterations(config)\n"
        "restored = check_finished_outputs(config, runs)\n"
        "finished = restored == [] and campaign_finished(config, runs) and difference_note(config, runs) is None\n"
        "campaign_report(runs)\n"
        "print(json.dumps([finished, sorted({'torch', 'transformers', 'prefect', 'accelerate'} & set(sys.modules))]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(done.stdout.splitlines()[-1]) == [True, []]


def test_rlhf_run_of_a_finished_campaign_starts_no_flow(campaign, capsys):
    from flows.cli import main

    config, _ = campaign
    overrides = {
        "run_root": config.run_root,
        "campaign": config.campaign,
        "model.policy": config.model.policy,
        "data.prompts": config.data.prompts,
        "data.eval_prompts": config.data.eval_prompts,
    }
    arguments = [part for name, value in overrides.items() for part in ("--set", f"{name}={value}")]
    assert main(["run", "--config", str(CONFIGS / "tiny.yaml"), *arguments]) == 0
    assert "nothing to run" in capsys.readouterr().out


def test_other_ppo_settings_keep_the_finished_iterations_and_apply_from_the_next_one(campaign):
    """One finished run per iteration number: `demo:0` names one run, whatever settings later commands bring.
    (Before: a changed `ppo.*` setting, free to change between commands, started a second iteration 0.)"""
    import dataclasses

    config, first = campaign
    _, _, before = _mlflow_runs(config)
    kept = {r.data.tags["rlhf.iteration"]: r.info.run_id for r in before if r.data.tags.get("rlhf.kind") == "iteration"}
    changed = config.model_copy(
        update={
            "ppo": dataclasses.replace(config.ppo, epochs=config.ppo.epochs + 1),
            "iterations": config.iterations + 1,
        }
    )
    final = rlhf_campaign(changed)

    _, _, after = _mlflow_runs(config)
    iterations = [r for r in after if r.data.tags.get("rlhf.kind") == "iteration"]
    numbers = sorted(int(r.data.tags["rlhf.iteration"]) for r in iterations)
    assert numbers == list(range(changed.iterations)), "one run per iteration number"
    by_number = {r.data.tags["rlhf.iteration"]: r for r in iterations}
    assert {n: by_number[n].info.run_id for n in kept} == kept, "the finished iterations are kept as they are"
    new = by_number[str(config.iterations)]
    assert new.info.status == "FINISHED" and new.data.params["ppo.epochs"] == str(changed.ppo.epochs)
    from storage.manifest import read_manifest

    upstream = read_manifest(final.policy.directory, verify=False).upstream
    assert upstream["policy"] == first.result().policy.digest, "it continues from the last kept iteration"


def test_issue42_every_output_file_is_remembered_as_written_so_checking_the_campaign_reads_none(campaign, monkeypatch):
    """An iteration's stages remember their files' sha256 in the run root's fingerprint cache as they publish them
    (tests/runtime/test_stage.py): checking the finished campaign, as every rerun does, hashes none of them (with a
    14 GB checkpoint per iteration, minutes of reading)."""
    import storage.fingerprints
    from campaign.history import finished_iterations
    from campaign.verification import check_finished_outputs
    from flows.iterations import context_for, resolve_base

    config, _ = campaign
    context = context_for(config, 0, resolve_base.fn(config), experiment_id="0")
    assert context.fingerprints == config.run_root.resolve() / "cache" / "fingerprints.json"
    monkeypatch.setattr(storage.fingerprints, "SETTLE_SECONDS", 0.0)  # the newest were written a moment ago
    reads = []
    real = storage.fingerprints.file_sha256
    monkeypatch.setattr(storage.fingerprints, "file_sha256", lambda path, **kw: reads.append(path) or real(path, **kw))
    assert check_finished_outputs(config, finished_iterations(config)) == []
    outputs = config.run_root.resolve() / config.campaign
    assert [path for path in reads if Path(path).resolve().is_relative_to(outputs)] == []
