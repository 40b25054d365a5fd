"""The stage mechanism: an input key from exactly the stage's arguments and code, reuse, and what every
stage records (seconds, peak memory, its runtime), against a real SQLite MLflow store in tmp_path."""

from __future__ import annotations

import dataclasses
import gc
import json
import weakref
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from pydantic import BaseModel

from rlhf_core.config import AdvantageConfig
from runtime.context import Execution, InputFile, StageContext
from runtime.declaration import StageResult, StageSettings, input_digests, setting, upstream
from runtime.job import Job
from runtime.models import accelerator_for
from runtime.stage import Stage, run_stage, setting_value
from runtime.versions import library_versions
from storage.manifest import read_manifest
from storage.schemas import PROMPTS
from tests.conftest import tiny_causal_lm
from tests.runtime.conftest import FILE, stage_context


class Sizes(BaseModel):
    prompts: int = 4


def test_setting_values_are_plain_data_and_files_count_by_content():
    assert setting_value(AdvantageConfig(kl_coef=0.1))["kl_coef"] == 0.1
    assert setting_value(Sizes()) == {"prompts": 4}
    assert setting_value((1, [2.0, None], {"a": True})) == [1, [2.0, None], {"a": True}]
    moved = dataclasses.replace(FILE, path="/elsewhere/prompts.jsonl")
    assert setting_value(FILE) == setting_value(moved) == {"sha256": "a" * 64}
    with pytest.raises(TypeError, match="pass an InputFile|plain data"):
        setting_value(Path("/data/prompts.jsonl"))


def _result(stage: str, digest: str) -> StageResult:
    return StageResult(stage=stage, path="/x", input_key="0" * 64, digest=digest, reused=True, run_id=None)


@dataclasses.dataclass(frozen=True)
class PairsSettings(StageSettings):
    stage = "pairs"
    policy: StageResult = upstream()
    labels: StageResult | None = upstream()
    pairs: tuple[StageResult, ...] = upstream()


def test_input_digests_name_tuples_by_position_and_skip_none():
    settings = PairsSettings(policy=_result("ppo", "p"), labels=None, pairs=(_result("a", "1"), _result("b", "2")))
    assert input_digests(settings) == {"policy": "p", "pairs_0": "1", "pairs_1": "2"}


@pytest.fixture
def context(tmp_path: Path) -> StageContext:
    return stage_context(tmp_path)


SEEN: list[dict] = []


@dataclasses.dataclass(frozen=True)
class ToySettings(StageSettings):
    stage = "toy"
    source: StageResult | None = upstream()
    rows: int = setting("rows")
    prompts: InputFile = setting("base.prompts")


def _write_rows(job: Job[ToySettings]) -> dict[str, float]:
    """A stage writing ``rows`` prompt rows; notes what it saw, to check what the mechanism set up."""
    rows = job.settings.rows
    SEEN.append({"threads": torch.get_num_threads(), "rows": rows})
    table = pa.table({"prompt_id": list(range(rows)), "prompt": ["p"] * rows, "messages": [[]] * rows}, schema=PROMPTS)
    job.out.write_table("prompts", table, schema=PROMPTS)
    _ = torch.ones(16_000_000)  # 64 MB written (above glibc's mmap threshold), so the peak is visible
    return {"rows": float(rows)}


toy = Stage(ToySettings, work=_write_rows)


def _toy(context: StageContext, source: StageResult | None, *, rows: int, prompts: InputFile) -> StageResult:
    return run_stage(toy, context, ToySettings(source=source, rows=rows, prompts=prompts))


def test_a_stage_runs_once_per_input_key_and_any_argument_changes_the_key(context):
    SEEN.clear()
    torch.set_num_threads(2)
    first = _toy(context, None, rows=3, prompts=FILE)
    assert not first.reused and SEEN == [{"threads": 1, "rows": 3}]  # the stage set its thread count
    again = _toy(context, None, rows=3, prompts=dataclasses.replace(FILE, path="/moved.jsonl"))
    assert again.reused and again.input_key == first.input_key and len(SEEN) == 1
    keys = {first.input_key}
    for changed in (
        _toy(context, None, rows=4, prompts=FILE),  # a setting
        _toy(context, None, rows=3, prompts=dataclasses.replace(FILE, sha256="b" * 64)),  # a file's content
        _toy(context, first, rows=3, prompts=FILE),  # an upstream output
        _toy(dataclasses.replace(context, iteration=1), None, rows=3, prompts=FILE),  # the iteration
        _toy(dataclasses.replace(context, seed=7), None, rows=3, prompts=FILE),  # the seed
    ):
        assert not changed.reused
        keys.add(changed.input_key)
    assert len(keys) == 6
    # Where it runs is not part of the key.
    elsewhere = dataclasses.replace(context, execution=Execution(device="cpu", torch_threads=2, checkpoint_seconds=1))
    assert _toy(elsewhere, None, rows=3, prompts=FILE).input_key == first.input_key


def test_issue42_a_computed_output_is_remembered_as_written_and_a_reused_one_is_read_by_nobody(context, monkeypatch):
    """The run root's fingerprint cache holds each file of a computed output with its manifest's sha256 (what the
    first check of the campaign would otherwise hash again); reusing the output reads none of its bytes."""
    import storage.fingerprints

    result = _toy(context, None, rows=3, prompts=FILE)
    remembered = json.loads(context.fingerprints.read_text())["files"]
    files = read_manifest(result.directory).files
    assert {str((result.directory / f.path).resolve()): f.sha256 for f in files} == {
        path: entry["sha256"] for path, entry in remembered.items()
    }
    monkeypatch.setattr(storage.fingerprints, "SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(storage.fingerprints, "file_sha256", lambda path, **kw: pytest.fail(f"{path} was read"))
    cache = storage.fingerprints.FingerprintCache(context.fingerprints)
    assert read_manifest(result.directory, cache=cache).input_key == result.input_key


def test_the_code_is_part_of_the_key(context, monkeypatch):
    import runtime.stage

    one = _toy(context, None, rows=1, prompts=FILE)
    same = _toy(context, None, rows=1, prompts=FILE)
    monkeypatch.setattr(runtime.stage, "code_fingerprint", lambda module: "2" * 64)
    edited = _toy(context, None, rows=1, prompts=FILE)
    assert same.reused and same.input_key == one.input_key
    assert not edited.reused and edited.input_key != one.input_key


def test_every_stage_records_seconds_peak_memory_where_it_ran_and_its_inputs(context):
    result = _toy(context, None, rows=2, prompts=FILE)
    manifest = read_manifest(result.directory)
    assert manifest.metrics["rows"] == 2.0 and manifest.metrics["seconds"] > 0
    assert manifest.metrics["peak_memory_mb"] >= 60  # the 64 MB buffer
    versions = library_versions()  # Python, torch, transformers, peft, accelerate; no engine, no GGUF model here
    assert manifest.runtime == {
        "device": "cpu",
        "torch_threads": 1,
        "inputs": context.base.contents,
        "versions": versions,
    }
    assert set(context.base.contents) == {"policy", "prompts", "eval_prompts"}  # the tokenizer is the policy's
    assert manifest.config["stage"] == {"rows": 2, "prompts": {"sha256": "a" * 64}}
    assert manifest.config["context"] == {"seed": 0, "iteration": 0, "base": context.base.fingerprint}


LOADED: list[weakref.ref] = []


@dataclasses.dataclass(frozen=True)
class LoaderSettings(StageSettings):
    stage = "loads_a_model"
    source: str = setting("source")


def _load_a_model(job: Job[LoaderSettings]) -> dict[str, float]:
    models = job.models("fp32")
    actor = models.load("actor", job.settings.source, trainable=True)
    accelerator = accelerator_for(models.device, models.precision)
    optimizer = torch.optim.AdamW(actor.parameters())
    actor, optimizer = accelerator.prepare(actor, optimizer)
    LOADED.append(weakref.ref(accelerator.unwrap_model(actor)))
    (job.out.path / "done").write_text("")
    return {}


loads_a_model = Stage(LoaderSettings, work=_load_a_model)


def test_a_stages_models_are_freed_when_it_returns_and_are_recorded(context, tmp_path):
    tiny_causal_lm("gpt2").save_pretrained(tmp_path / "policy")
    gc.disable()  # so that only reference counting can free them
    try:
        result = run_stage(loads_a_model, context, LoaderSettings(source=str(tmp_path / "policy")))
        assert LOADED and LOADED[-1]() is None
    finally:
        gc.enable()
    models = read_manifest(result.directory).runtime["models"]
    assert models == [{"role": "actor", "device": "cpu", "dtype": "float32", "trainable": True}]


def _dead_writer() -> str:
    """A ``rlhf.process`` value naming a process of this host that has exited."""
    import socket
    import subprocess

    process = subprocess.Popen(["true"])
    process.wait()
    return f"{socket.gethostname()}:{process.pid}:1"


@dataclasses.dataclass(frozen=True)
class TrainerSettings(StageSettings):
    stage = "trainer"
    n: int = setting("n")


def _produce_actor(job: Job[TrainerSettings]) -> dict[str, float]:
    (job.out.path / "actor").mkdir()
    (job.out.path / "actor" / "weights.bin").write_bytes(bytes(range(256)) * 64)
    (job.out.path / "actor" / "config.json").write_text("{}")
    return {"loss": 0.5}


trainer = Stage(TrainerSettings, work=_produce_actor, register={"actor": "actor"})


def test_issue14_an_interrupted_record_is_finished_in_place_never_duplicated(context, monkeypatch):
    """Killed while the stage run was recorded: RUNNING, its artifacts half written, no model version. The
    next attempt finishes that run: one run, FINISHED, its ``output/`` artifacts exactly what a recording
    that never stopped leaves (the manifest, the output being recorded by reference), each metric and model
    version once."""
    from mlflow import MlflowClient

    import runtime.record
    from storage.tracking import TAG_PROCESS

    def killed(stage, window):
        if window == "recording":
            raise KeyboardInterrupt

    monkeypatch.setattr(runtime.record, "hold", killed)
    with pytest.raises(KeyboardInterrupt):
        run_stage(trainer, context, TrainerSettings(n=1))
    client = MlflowClient(context.tracking.uri, registry_uri=context.tracking.uri)
    (interrupted,) = client.search_runs([context.experiment_id])
    assert interrupted.info.status == "KILLED"
    # As kill -9 leaves it: RUNNING, written by a process that is gone, one artifact cut short, one missing.
    client.set_tag(interrupted.info.run_id, TAG_PROCESS, _dead_writer())
    client.update_run(interrupted.info.run_id, status="RUNNING")
    artifacts = Path(interrupted.info.artifact_uri.removeprefix("file://")) / "output"
    (artifacts / "_manifest.json").write_text("{half")
    (artifacts / "stray.tmp").write_text("left by the interrupted copy")

    monkeypatch.setattr(runtime.record, "hold", lambda stage, window: None)
    assert context.tracker.reconcile_runs(context.experiment_id) == [interrupted.info.run_id]
    result = run_stage(trainer, context, TrainerSettings(n=1))

    (finished,) = client.search_runs([context.experiment_id])
    assert finished.info.run_id == interrupted.info.run_id == result.run_id
    assert finished.info.status == "FINISHED"
    assert [path.name for path in artifacts.iterdir()] == ["_manifest.json"]
    assert (artifacts / "_manifest.json").read_bytes() == (result.directory / "_manifest.json").read_bytes()
    assert finished.data.tags["rlhf.output_path"] == str(result.directory)
    assert len(client.get_metric_history(result.run_id, "trainer/loss")) == 1
    versions = client.search_model_versions("name = 'camp-actor'")
    assert [(str(v.version), v.run_id) for v in versions] == [("1", result.run_id)]


def test_issue14_a_run_being_written_by_a_live_process_or_another_host_is_left_alone(context):
    from mlflow import MlflowClient

    from storage.tracking import TAG_PROCESS

    tracker = context.tracker
    mine = tracker.start_run(context.experiment_id, name="live", tags={})
    elsewhere = tracker.start_run(context.experiment_id, name="remote", tags={})
    dead = tracker.start_run(context.experiment_id, name="dead", tags={})
    MlflowClient(context.tracking.uri).set_tag(elsewhere, TAG_PROCESS, "another-host:1:1")
    MlflowClient(context.tracking.uri).set_tag(dead, TAG_PROCESS, _dead_writer())
    assert tracker.reconcile_runs(context.experiment_id) == [dead]
    assert [tracker.run(run).status for run in (mine, elsewhere, dead)] == ["RUNNING", "RUNNING", "KILLED"]
