"""Issue 14 crash suite: ``kill -9`` of a real ``rlhf run`` at every stage, in three windows, then the same
command again; the campaign must end exactly as one that never crashed.

In the ``computing`` window each command runs as a user runs it at a terminal (its own temporary Prefect server, no
``PREFECT_API_URL``), and its temporary server must die with it; in the other windows and the overlapped campaign
the commands talk to the test run's one Prefect server, as under ``rlhf serve`` or a team's server (issue 41: a
temporary server costs each command about 10 s of CPU, and whether it dies with its command is proved by the 8 kills
of the first window and by tests/runtime/test_warm.py). Each command is held at
``<stage>:<window>`` (``storage/holds.py``: the process writes a file there and waits, so the kill lands at a known
point, not after a sleep) and killed with SIGKILL. One run root per window is killed at every stage in turn (issue
41: a chain of kills costs one campaign and a command's start-up per kill, where a run root per kill cost a campaign
and two start-ups each): the same command again resumes what the kill left and is held at the next stage's point,
and the last one runs to the end. Right after each kill:

* the killed command and every process it started are gone (its temporary Prefect server, where it has one);
* the iteration run is RUNNING, the stage held while recording has its RUNNING run with its output's digest, and
  every other stage run is FINISHED (so the command after a kill finished what that kill interrupted);
* every finished output equals the uncrashed campaign's, the store is consistent so far (each stage run's artifacts
  exactly its output, one run per output, nothing the uncrashed campaign lacks), and no stage but the held one has a
  half-written folder; a kill in a training stage's ``computing`` window lands after its first mid-stage checkpoint.

When the last command has ended:

* every stage output file and every manifest digest equals the uncrashed campaign's;
* the MLflow store is clean: every run FINISHED, one run per stage output and per iteration, as many
  runs and model versions as the uncrashed campaign, each stage run's artifacts exactly its output
  (verified against the manifest), no artifact folder without its run;
* no process is left and no half-written folder.

Issue 33 adds the overlapped mode (``sampling.staleness=1``: iteration 1's generation stages run in the command's
process while iteration 0's update trains in a process of its own), one run root killed in both lanes (the update
after its first checkpoint, iteration 1's rollout computed and not published), then in the rollout (published and not
yet recorded: its iteration records it) while the resumed update is published and not recorded, then in iteration 1's
off-policy update (once it has kept pi_prox and checkpointed an epoch). The same checks hold, against an uncrashed
overlapped campaign, and the killed command's training process must die with it.

Issue 44 adds a campaign of multi-turn episodes killed during its rollout, after its first shard of episodes (the
environment's process alive): the same command again reuses that shard and ends as the uncrashed campaign; an
environment that declares itself non-deterministic has that shard sampled again, and the rollout's manifest says so.

Issue 43 adds an iteration that samples a second round of fresh prompts (its first short of the decisive pairs
asked for), killed in that round's sampling and then in its labelling: each command reuses the rounds finished
before it, and the last ends the campaign as the uncrashed one.

Slow: ``.ci/run`` runs it as its own step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from storage.manifest import read_manifest
from storage.shards import read_table
from tasks.staleness import PROX_FILE
from tests.flows.conftest import episode_overrides
from tests.flows.test_rounds import SPARSE_ROUNDS
from tests.processes import running

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
STAGES = [
    "initialize",
    "sample_candidates",
    "collect_preferences",
    "train_reward_model",
    "rollout",
    "compute_advantages",
    "ppo_update",
    "evaluate",
]
WINDOWS = ["computing", "output", "recording"]
COMMON = ["ppo.epochs=2", "reward_model.epochs=2", "execution.checkpoint_seconds=0"]
"""Two epochs of each training stage and a checkpoint after each: a kill in its ``computing`` window (held after the
first checkpoint) lands mid-stage, with an epoch left for the next command to resume."""
DEADLINE = 600
DPO = ["update=dpo", "dpo.epochs=2", "dpo.learning_rate=1e-3", "iterations=1"]
"""Issue 45: one DPO iteration, its update two epochs with a checkpoint after the first."""
DPO_KILLS = ("dpo_update:computing", "dpo_update:recording")
ROUND_KILLS = ("sample_candidates:computing#2", "collect_preferences:output")
"""The second round's candidates sampled and not published (the first command's second arrival there); then, the
next command reusing the first round whole, the second round's labels published and not recorded (its first
arrival at a labelling it computes)."""
OVERLAPPED = ["sampling.staleness=1"]
OVERLAP_KILLS = {
    "both lanes": "rollout:computing#2,ppo_update:computing#1",
    "in the rollout": "rollout:output#1,ppo_update:output#1",
    "in the off-policy update": "ppo_update:computing#1",
}
"""Where the overlapped campaign is killed, in turn. The first command reaches iteration 0's rollout itself, so
``#2`` is iteration 1's, run beside iteration 0's update; the later commands reuse iteration 0's rollout, so
iteration 1's is their first. The update's ``computing`` point is held in its own training process (a fresh count
each), after its first checkpoint: the second command finishes iteration 0's update, so the third's training process
is iteration 1's."""


def _command(run_root: Path, world: dict[str, Path], *more: str) -> list[str]:
    overrides = [
        f"run_root={run_root}",
        f"model.policy={world['policy']}",
        f"data.prompts={world['prompts']}",
        f"data.eval_prompts={world['eval_prompts']}",
        *COMMON,
        *more,
    ]
    return [sys.executable, "-m", "flows", "run", "--config", str(TINY), *(f"--set={o}" for o in overrides)]


OWN_SERVER_WINDOW = "computing"
"""The window whose commands start their own temporary Prefect server, as at a user's terminal."""


def _environment(api_url: str | None = None, **extra: str) -> dict[str, str]:
    """The test's environment, with ``PREFECT_API_URL`` set to ``api_url``, or without one (None), so the command
    starts its own temporary server."""
    environment = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    return {**environment, **({"PREFECT_API_URL": api_url} if api_url else {}), **extra}


@pytest.fixture(scope="module")
def api_url(prefect_server) -> str:
    """The test run's one Prefect server."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, their children, ...), from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    """The processes of ``pids`` that still run (zombies count as gone)."""
    return {pid for pid in pids if running(pid)}


def _wait_gone(pids: set[int], seconds: float = 30) -> set[int]:
    deadline = time.monotonic() + seconds
    while (left := _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _run_to_end(command: list[str], log: Path, api_url: str | None = None) -> None:
    """Run the command to its end; it must succeed and leave no process behind."""
    with open(log, "ab") as output:
        process = subprocess.Popen(command, cwd=ROOT, env=_environment(api_url), stdout=output, stderr=output)
        children: set[int] = set()
        while process.poll() is None:
            children |= _descendants(process.pid)
            time.sleep(0.2)
    assert process.returncode == 0, f"`rlhf run` failed; see {log}"
    assert not _wait_gone(children), f"processes left by a finished `rlhf run`: {_alive(children)}"


def _file_hashes(campaign_dir: Path) -> dict[str, str]:
    """``stage/key/file -> sha256`` of every finished stage output, from the (verified) manifests."""
    hashes = {}
    for manifest_path in campaign_dir.glob("*/*/_manifest.json"):
        manifest = read_manifest(manifest_path.parent, verify=True)
        for entry in manifest.files:
            hashes[f"{manifest_path.parent.relative_to(campaign_dir)}/{entry.path}"] = entry.sha256
    return hashes


def _client(run_root: Path) -> MlflowClient:
    uri = f"sqlite:///{run_root / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _runs(client: MlflowClient, campaign: str) -> list:
    return client.search_runs([client.get_experiment_by_name(campaign).experiment_id], max_results=10_000)


def _store(run_root: Path, campaign: str) -> dict:
    """What the MLflow store holds, checked for the invariants every campaign must keep."""
    client = _client(run_root)
    experiment = client.get_experiment_by_name(campaign)
    runs = _runs(client, campaign)
    stage_runs = [run for run in runs if run.data.tags.get("rlhf.kind") == "stage"]
    iteration_runs = [run for run in runs if run.data.tags.get("rlhf.kind") == "iteration"]
    outputs = sorted(
        (run.data.tags["rlhf.stage"], run.data.tags["rlhf.input_key"], run.data.tags["rlhf.manifest_digest"])
        for run in stage_runs
    )
    artifact_root = Path(experiment.artifact_location.removeprefix("file://"))
    for run in stage_runs:
        # Recorded by reference (a local store): the artifacts are the manifest of the folder the tag names.
        artifacts = Path(run.info.artifact_uri.removeprefix("file://")) / "output"
        folder = Path(run.data.tags["rlhf.output_path"])
        assert read_manifest(folder, verify=True).digest == run.data.tags["rlhf.manifest_digest"]
        assert [path.name for path in artifacts.iterdir()] == ["_manifest.json"]
        assert (artifacts / "_manifest.json").read_bytes() == (folder / "_manifest.json").read_bytes()
    versions = [
        (model.name, str(version.version), version.run_id)
        for model in client.search_registered_models()
        for version in client.search_model_versions(f"name = '{model.name}'")
    ]
    return {
        "statuses": sorted({run.info.status for run in runs}),
        "runs": len(runs),
        "outputs": outputs,
        "unique outputs": len(set(outputs)) == len(outputs),
        "iteration keys": sorted(run.data.tags["rlhf.iteration_key"] for run in iteration_runs),
        "model versions": sorted((name, version) for name, version, _ in versions),
        "versions of known runs": all(run_id in {run.info.run_id for run in runs} for *_, run_id in versions),
        "artifact folders": _artifact_folders(artifact_root) == sorted(r.info.run_id for r in runs)
        and _model_folders(artifact_root)
        == sorted(model.model_id for model in client.search_logged_models([experiment.experiment_id])),
    }


def _artifact_folders(artifact_root: Path) -> list[str]:
    """The runs' artifact folders (one per run, by id) of an experiment's artifact root."""
    return sorted(path.name for path in artifact_root.iterdir() if path.name != "models")


def _model_folders(artifact_root: Path) -> list[str]:
    """The logged models' artifact folders (``models/<model_id>``: an external model's ``MLmodel`` file)."""
    return (
        sorted(path.name for path in (artifact_root / "models").iterdir())
        if (artifact_root / "models").is_dir()
        else []
    )


def _uncrashed(world: dict[str, Path], run_root: Path, api_url: str, *more: str) -> tuple[dict[str, str], dict]:
    _run_to_end(_command(run_root, world, *more), run_root / "run.log", api_url)
    store = _store(run_root, "tiny")
    assert store["statuses"] == ["FINISHED"] and store["unique outputs"] and store["artifact folders"]
    return _file_hashes(run_root / "tiny"), store


@pytest.fixture(scope="module")
def uncrashed(checkpoint_world, tmp_path_factory, api_url):
    return _uncrashed(checkpoint_world, tmp_path_factory.mktemp("uncrashed"), api_url)


@pytest.fixture(scope="module")
def uncrashed_overlapped(checkpoint_world, tmp_path_factory, api_url):
    return _uncrashed(checkpoint_world, tmp_path_factory.mktemp("uncrashed-overlapped"), api_url, *OVERLAPPED)


@pytest.fixture(scope="module")
def uncrashed_dpo(checkpoint_world, tmp_path_factory, api_url):
    return _uncrashed(checkpoint_world, tmp_path_factory.mktemp("uncrashed-dpo"), api_url, *DPO)


def _kill_when_held(command: list[str], points: str, held: Path, log: Path, api_url: str | None) -> None:
    """Run ``command`` until every one of ``points`` holds (each process appends the point it holds at to ``held``),
    ``kill -9`` it and check that nothing it started outlives it; its output goes to the end of ``log``. Without
    ``api_url`` the command runs its own temporary Prefect server, which must die with it."""
    expected = {point if "#" in point else f"{point}#1" for point in points.split(",")}
    environment = _environment(api_url, RLHF_HOLD_AT=points, RLHF_HOLD_FILE=str(held))
    with open(log, "ab") as output:
        process = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=output, stderr=output)
        deadline = time.monotonic() + DEADLINE
        try:
            while not (held.exists() and {line.split()[0] for line in held.read_text().splitlines()} == expected):
                assert process.poll() is None, f"`rlhf run` ended before reaching {points}; see {log}"
                assert time.monotonic() < deadline, f"timed out waiting for {points}"
                time.sleep(0.02)
            children = _descendants(process.pid)
            assert children or api_url, "the command runs its temporary Prefect server as a child"
            os.kill(process.pid, signal.SIGKILL)
        finally:
            process.kill()
            process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert not _wait_gone(children), f"processes outliving the `rlhf run` killed at {points}: {_alive(children)}"


def _check_after_kill(run_root: Path, uncrashed: tuple[dict[str, str], dict], points: str, recording: str = "") -> list:
    """What a kill at ``points`` must leave, checked right after it so that a failure names the kill that broke the
    campaign; the runs in the store.

    * the iteration run is RUNNING; every stage run is FINISHED but ``recording``'s (the stage held while recording);
    * every finished output (manifest present) has exactly the uncrashed campaign's files, and the store is consistent
      so far: each stage run's artifacts are its output's manifest, one run per output, only outputs and model
      versions the uncrashed campaign has, no model version or artifact folder without its run;
    * no half-written folder but the held stages' own: an earlier kill's leftovers were cleared by the command that
      finished its stage.
    """
    hashes, store = uncrashed
    finished = _file_hashes(run_root / "tiny")
    wrong = sorted(path for path, sha in finished.items() if hashes.get(path) != sha)
    assert not wrong, f"killed at {points}: finished outputs differ from the uncrashed campaign's: {wrong}"
    runs = _runs(_client(run_root), "tiny")
    kinds = {kind: [run for run in runs if run.data.tags.get("rlhf.kind") == kind] for kind in ("iteration", "stage")}
    assert "RUNNING" in {run.info.status for run in kinds["iteration"]}, f"{points}: the iteration run is RUNNING"
    unfinished = [r.data.tags["rlhf.stage"] for r in kinds["stage"] if r.info.status != "FINISHED"]
    assert unfinished == ([recording] if recording else []), f"killed at {points}: stage runs not finished"
    now = _store(run_root, "tiny")
    assert now["unique outputs"] and now["versions of known runs"], f"killed at {points}: {now}"
    assert set(now["outputs"]) <= set(store["outputs"]), f"killed at {points}: outputs the uncrashed run lacks"
    assert set(now["model versions"]) <= set(store["model versions"]), f"killed at {points}: {now['model versions']}"
    artifact_root = Path(_client(run_root).get_experiment_by_name("tiny").artifact_location.removeprefix("file://"))
    assert set(_artifact_folders(artifact_root)) <= {run.info.run_id for run in runs}, points
    experiment = _client(run_root).get_experiment_by_name("tiny")
    models = {model.model_id for model in _client(run_root).search_logged_models([experiment.experiment_id])}
    assert set(_model_folders(artifact_root)) <= models, points
    held = {point.split(":")[0] for point in points.split(",")}
    leftovers = [
        path
        for path in (run_root / "tiny").glob("*/*")
        if (path.name.startswith(".") or path.name.endswith(".partial")) and path.parent.name not in held
    ]
    assert not leftovers, f"killed at {points}: half-written folders of stages not held: {leftovers}"
    return runs


def _rerun_equals(
    command: list[str], log: Path, run_root: Path, uncrashed: tuple[dict[str, str], dict], api_url: str | None
) -> None:
    """The same command again finishes the campaign exactly as the uncrashed one."""
    _run_to_end(command, log, api_url)
    hashes, store = uncrashed
    assert _file_hashes(run_root / "tiny") == hashes
    assert _store(run_root, "tiny") == store
    leftovers = [p for p in (run_root / "tiny").glob("*/*") if p.name.startswith(".") or p.name.endswith(".partial")]
    assert not leftovers, f"half-written folders left: {leftovers}"


@pytest.mark.parametrize("window", WINDOWS)
def test_issue14_kill_minus_nine_at_each_stage_in_turn_then_rerun_equals_a_run_that_never_crashed(
    window, uncrashed, checkpoint_world, tmp_path, api_url
):
    """One run root killed in ``window`` at every stage in turn: the first command at the first stage's point, the
    same command again (resuming what the kill left) at the next stage's, and so on; the last command runs to the
    end. Iteration 0's points, each the first arrival of its command (an output finished by an earlier command is
    reused, not computed again)."""
    run_root, log = tmp_path / "runs", tmp_path / "run.log"
    command = _command(run_root, checkpoint_world)
    api_url = None if window == OWN_SERVER_WINDOW else api_url
    for stage in STAGES:
        point = f"{stage}:{window}"
        _kill_when_held(command, point, tmp_path / f"held-{stage}", log, api_url)
        runs = _check_after_kill(run_root, uncrashed, point, recording=stage if window == "recording" else "")
        if window == "recording":
            (recording,) = [run for run in runs if run.data.tags.get("rlhf.stage") == stage]
            assert "rlhf.manifest_digest" in recording.data.tags, f"{point}: the stage run has its output's digest"
        if window == "computing" and stage in ("train_reward_model", "ppo_update"):
            assert list((run_root / "tiny" / stage).glob("*.partial/epoch-*")), f"{point}: after a checkpoint"
    _rerun_equals(command, log, run_root, uncrashed, api_url)


def test_issue33_kill_minus_nine_of_an_overlapped_campaign_in_turn_then_rerun_equals_a_run_that_never_crashed(
    uncrashed_overlapped, checkpoint_world, tmp_path, api_url
):
    """One overlapped run root (``sampling.staleness=1``) killed three times in turn, each command resuming what the
    previous kill left:

    1. in both lanes: iteration 0's update after its first checkpoint (held in its own training process), iteration
       1's rollout computed ahead and not published;
    2. in the rollout: iteration 1's rollout published and not yet recorded (its iteration records it), while
       iteration 0's update, resumed from its checkpoint, is published and not recorded either;
    3. in iteration 1's off-policy update, once it has kept pi_prox and checkpointed an epoch: its actor has moved on,
       and the last command reads pi_prox back rather than computing it from the checkpoint's actor.

    The last command ends the campaign as the uncrashed one (the update's actor included)."""
    run_root, log = tmp_path / "runs", tmp_path / "run.log"
    command = _command(run_root, checkpoint_world, *OVERLAPPED)
    updates, rollouts = run_root / "tiny" / "ppo_update", run_root / "tiny" / "rollout"

    points = OVERLAP_KILLS["both lanes"]
    _kill_when_held(command, points, tmp_path / "held-both-lanes", log, api_url)
    runs = _check_after_kill(run_root, uncrashed_overlapped, points)
    assert {run.data.tags.get("rlhf.iteration") for run in runs} == {"0"}, "iteration 1 ran ahead, unrecorded"
    assert list(updates.glob("*.partial/epoch-*")), "the update had checkpointed"
    assert list(rollouts.glob("*.partial/shards/*")), "the next rollout had its shards"

    points = OVERLAP_KILLS["in the rollout"]
    _kill_when_held(command, points, tmp_path / "held-in-the-rollout", log, api_url)
    runs = _check_after_kill(run_root, uncrashed_overlapped, points)
    assert {run.data.tags.get("rlhf.iteration") for run in runs} == {"0"}, "iteration 1 ran ahead, unrecorded"
    assert len(list(rollouts.glob("*/_manifest.json"))) == 2, "iteration 1's rollout published"
    assert len(list(updates.glob("*/_manifest.json"))) == 1, "iteration 0's update published"
    assert "ppo_update" not in {run.data.tags.get("rlhf.stage") for run in runs}, "the update not recorded"

    points = OVERLAP_KILLS["in the off-policy update"]
    _kill_when_held(command, points, tmp_path / "held-in-the-off-policy-update", log, api_url)
    _check_after_kill(run_root, uncrashed_overlapped, points)
    assert len(list(updates.glob("*/_manifest.json"))) == 1, "iteration 0's update published, iteration 1's not"
    (partial,) = updates.glob("*.partial")
    assert (partial / PROX_FILE).exists() and list(partial.glob("epoch-*")), "killed mid-stage, pi_prox kept"

    _rerun_equals(command, log, run_root, uncrashed_overlapped, api_url)


def test_issue45_kill_minus_nine_of_a_dpo_update_in_turn_then_rerun_equals_a_run_that_never_crashed(
    uncrashed_dpo, checkpoint_world, tmp_path, api_url
):
    """One DPO run root killed in its update twice in turn: after the update's first epoch checkpoint (mid-stage),
    then, the next command having resumed it from that checkpoint and published it, while recording it. The last
    command ends the campaign as the uncrashed one, byte for byte (the actor included)."""
    run_root, log = tmp_path / "runs", tmp_path / "run.log"
    command = _command(run_root, checkpoint_world, *DPO)
    for point in DPO_KILLS:
        window = point.partition(":")[2]
        _kill_when_held(command, point, tmp_path / f"held-{window}", log, api_url)
        _check_after_kill(run_root, uncrashed_dpo, point, recording="dpo_update" if window == "recording" else "")
        if window == "computing":
            assert list((run_root / "tiny" / "dpo_update").glob("*.partial/epoch-*")), f"{point}: after a checkpoint"
    _rerun_equals(command, log, run_root, uncrashed_dpo, api_url)


EPISODES = ["iterations=1", "advantages.estimator=grpo", "sizes.rows_per_shard=4"]
"""A campaign of episodes (tests/flows/conftest.py): 8 episodes in two shards of the rollout, one iteration."""


def _episode_command(run_root: Path, world: dict[str, Path], environment: str) -> list[str]:
    overrides = episode_overrides(world, run_root, *EPISODES, f"environment.class=tests.environments:{environment}")
    return [sys.executable, "-m", "flows", "run", "--config", str(TINY), *(f"--set={o}" for o in overrides)]


def _rollout(run_root: Path) -> Path:
    (folder,) = [path.parent for path in (run_root / "tiny" / "rollout").glob("*/_manifest.json")]
    return folder


def test_issue43_kill_minus_nine_between_rounds_of_candidates_then_rerun_equals_a_run_that_never_crashed(
    checkpoint_world, tmp_path, api_url
):
    """An iteration that samples a second round of fresh prompts (too few decisive pairs in its first), killed in
    turn in that round's sampling and in its labelling: each command reuses the rounds finished before it and samples
    no prompt of the first round again, and the last ends the campaign as one that never crashed, to the byte."""
    (tmp_path / "uncrashed").mkdir()
    uncrashed = _uncrashed(checkpoint_world, tmp_path / "uncrashed", api_url, *SPARSE_ROUNDS)
    rounds = {path.split("/")[1] for path in uncrashed[0] if path.startswith("sample_candidates/")}
    assert len(rounds) == 2, "the uncrashed iteration sampled two rounds"
    run_root, log = tmp_path / "runs", tmp_path / "run.log"
    command = _command(run_root, checkpoint_world, *SPARSE_ROUNDS)
    sampled = run_root / "tiny" / "sample_candidates"
    for point in ROUND_KILLS:
        _kill_when_held(command, point, tmp_path / f"held-{point.partition(':')[0]}", log, api_url)
        _check_after_kill(run_root, uncrashed, point)
        if point.startswith("sample_candidates"):
            (first,) = [json.loads(path.read_text()) for path in sampled.glob("*/_manifest.json")]
            unpublished = [path for path in sampled.iterdir() if not (path / "_manifest.json").is_file()]
            assert first["metrics"]["round"] == 0 and unpublished, f"{point}: the first round published, the second not"
    _rerun_equals(command, log, run_root, uncrashed, api_url)


def test_issue44_kill_minus_nine_during_an_episode_rollout_then_rerun_equals_a_run_that_never_crashed(
    episode_world, tmp_path, api_url
):
    """``kill -9`` after the rollout's first shard of episodes (tests.environments:Guess, the environment's process
    alive): nothing outlives the command, and the same command again reuses the shard and ends exactly as a campaign
    that never crashed. With :class:`tests.environments.Coin` (the same game, declared non-deterministic) the shard is
    sampled again, and the rollout's manifest says so."""
    uncrashed_root, log, point = tmp_path / "uncrashed", tmp_path / "run.log", "rollout:shard"
    _run_to_end(_episode_command(uncrashed_root, episode_world, "Guess"), log, api_url)
    uncrashed = (_file_hashes(uncrashed_root / "tiny"), _store(uncrashed_root, "tiny"))
    assert uncrashed[1]["statuses"] == ["FINISHED"] and any(path.startswith("evaluate/") for path in uncrashed[0])

    run_root = tmp_path / "crashed"
    command = _episode_command(run_root, episode_world, "Guess")
    _kill_when_held(command, point, tmp_path / "held-guess", log, api_url)
    _check_after_kill(run_root, uncrashed, point)
    assert len(list((run_root / "tiny" / "rollout").glob("*.partial/shards/*"))) == 1, "one shard of two written"
    _rerun_equals(command, log, run_root, uncrashed, api_url)
    assert "sampled_again" not in read_manifest(_rollout(run_root)).runtime

    coin_root = tmp_path / "coin"
    command = _episode_command(coin_root, episode_world, "Coin")
    _kill_when_held(command, point, tmp_path / "held-coin", log, api_url)
    _run_to_end(command, log, api_url)
    sampled_again = read_manifest(_rollout(coin_root)).runtime["sampled_again"]
    assert sampled_again["shards"] == 1 and "declares itself non-deterministic" in sampled_again["why"]
    coin, guess = (read_table(_rollout(root), "experience") for root in (coin_root, uncrashed_root))
    assert coin.equals(guess)  # Coin plays Guess's game: sampled again, its episodes are the same


@pytest.mark.parametrize("packing", [(), ("sft.packing=true", "sft.packed_length=64")], ids=["padded", "packed"])
def test_issue45_kill_minus_nine_mid_sft_then_rerun_equals_a_run_that_never_crashed(
    packing, checkpoint_world, tmp_path, api_url
):
    """SFT before iteration 0 (two epochs of 3 steps, a checkpoint after every step), killed right after its first
    checkpoint, in the middle of its first epoch: the same command again continues from that step and ends the campaign
    (SFT, then one iteration) as one that never crashed, to the byte; padded, and packed into rows of up to 64."""
    prompts = [json.loads(line)["prompt"] for line in checkpoint_world["prompts"].read_text().splitlines()]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": " happy ."}) + "\n" for p in prompts))
    more = ("iterations=1", f"sft.data={data}", "sft.epochs=2", "sft.batch_size=16", "sft.learning_rate=1e-2", *packing)
    (tmp_path / "uncrashed").mkdir()
    uncrashed = _uncrashed(checkpoint_world, tmp_path / "uncrashed", api_url, *more)
    assert any(path.startswith("sft/") and path.endswith("actor/model.safetensors") for path in uncrashed[0])

    run_root, log = tmp_path / "runs", tmp_path / "run.log"
    command = _command(run_root, checkpoint_world, *more)
    _kill_when_held(command, "sft:computing", tmp_path / "held-sft", log, api_url)
    [partial] = (run_root / "tiny" / "sft").glob("*.partial")
    assert [path.name for path in partial.glob("epoch-*")] == ["epoch-00001"], "one step of six done: mid-epoch"
    assert not list((run_root / "tiny").glob("*/*/_manifest.json")), "nothing finished before the SFT stage"
    _rerun_equals(command, log, run_root, uncrashed, api_url)
