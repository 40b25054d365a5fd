"""``rlhf serve`` as a user runs it, in a subprocess: the deployments it makes on the session's Prefect server, and
runs triggered the way the Prefect UI triggers them (each one a process of Prefect's runner), SIGTERM, and a Prefect
server that is not there or goes away. The deployments themselves, built without a server: tests/flows/test_serve.py.

Slow: each triggered run is a process that imports the pipeline, and the last test starts a Prefect server of its
own; ``.ci/run`` runs this module in its browser step, beside the Prefect UI's tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest

from campaign.config import PipelineConfig
from campaign.store import campaign_layout
from storage.locks import exclusive_lock
from tests.flows.conftest import flow_runs_in_state
from tests.flows.test_serve import CONFIGS, FLOWS, NEVER, REPO, served_campaign

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(checkpoint_world, tmp_path_factory) -> tuple[PipelineConfig, list[str]]:
    return served_campaign(checkpoint_world, tmp_path_factory)


@pytest.fixture(scope="module")
def served(prefect_server, tiny, tmp_path_factory):
    """``rlhf serve --cron NEVER`` in a subprocess, and the three deployments it created."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import get_current_settings

    config, overrides = tiny
    log = tmp_path_factory.mktemp("serve-log") / "serve.log"
    command = [sys.executable, "-m", "flows", "serve", "--config", str(CONFIGS / "tiny.yaml"), "--cron", NEVER]
    for override in overrides:
        command += ["--set", override]
    environment = {
        **os.environ,
        "PREFECT_API_URL": get_current_settings().api.url,
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
    }
    with log.open("w") as output:
        process = subprocess.Popen(command, cwd=REPO, env=environment, stdout=output, stderr=subprocess.STDOUT)
    deployments = {}
    deadline = time.monotonic() + 120
    with get_client(sync_client=True) as client:
        while len(deployments) < len(FLOWS):
            assert process.poll() is None, f"rlhf serve exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"rlhf serve made no deployments in 120 s:\n{log.read_text()}"
            for flow in FLOWS:
                try:
                    deployments[flow] = client.read_deployment_by_name(f"{flow}/{config.campaign}")
                except ObjectNotFound:
                    time.sleep(0.5)
    yield config, process, deployments, log
    if process.poll() is None:
        process.kill()
        process.wait()


def _mlflow_iteration_runs(config: PipelineConfig):
    from mlflow import MlflowClient

    if not (config.run_root / "mlflow.db").exists():
        return []
    client = MlflowClient(tracking_uri=f"sqlite:///{config.run_root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(config.campaign)
    if experiment is None:
        return []
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.`rlhf.kind` = 'iteration'")
    return sorted(runs, key=lambda run: int(run.data.tags["rlhf.iteration"]))


def _flow_runs_of(deployment_id):
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))


def test_served_deployments_carry_the_form_schedule_and_concurrency_limit(served):
    config, _, deployments, _ = served
    iteration = deployments["rlhf-iteration"]
    assert (
        iteration.parameter_openapi_schema["definitions"]["PPOConfig"]["properties"]["clip_eps"]["exclusiveMinimum"]
        == 0
    )
    assert [schedule.schedule.cron for schedule in iteration.schedules] == [NEVER]
    for deployment in deployments.values():
        assert deployment.global_concurrency_limit.limit == 1
        assert deployment.parameters == {"config": config.model_dump(mode="json")}


def test_bad_parameters_are_refused_before_anything_runs(served):
    from prefect.deployments import run_deployment
    from prefect.exceptions import PrefectHTTPStatusError

    config, _, deployments, _ = served
    before = _flow_runs_of(deployments["rlhf-iteration"].id)
    with pytest.raises(PrefectHTTPStatusError, match="config.ppo.clip_eps") as refused:
        run_deployment(
            "rlhf-iteration/tiny", parameters={"config": {"ppo": {"clip_eps": -1}}}, timeout=0, as_subflow=False
        )
    assert refused.value.response.status_code == 409
    assert _flow_runs_of(deployments["rlhf-iteration"].id) == before, "no flow run was created"
    assert _mlflow_iteration_runs(config) == []


def test_the_schedule_makes_runs_that_continue_the_campaign(served):
    """What Prefect's scheduler service does each minute in a real server (the test server runs no services):
    insert the schedule's upcoming runs. They carry only the served config, no `iteration`, so each one
    continues the campaign. (prefect 3.8.8's scheduler fails on SQLAlchemy 2.1; pyproject pins 2.0.)"""
    import asyncio

    from prefect import get_client
    from prefect.server.database import provide_database_interface
    from prefect.server.models.deployments import schedule_runs

    config, _, deployments, _ = served
    iteration = deployments["rlhf-iteration"]

    async def schedule() -> list:
        async with provide_database_interface().session_context(begin_transaction=True) as session:
            return await schedule_runs(session, deployment_id=iteration.id)

    # The test writes into the test server's SQLite database beside the server itself; SQLite answers
    # "database is locked" while the server holds its write lock (a known Prefect/SQLite behaviour), so retry.
    from sqlalchemy.exc import OperationalError

    for attempt in range(20):
        try:
            run_ids = asyncio.run(schedule())
            break
        except OperationalError as error:
            if "database is locked" not in str(error) or attempt == 19:
                raise
            time.sleep(0.5)
    with get_client(sync_client=True) as client:
        scheduled = [client.read_flow_run(run_id) for run_id in run_ids]
        for flow_run in scheduled:
            client.delete_flow_run(flow_run.id)
    assert scheduled
    for flow_run in scheduled:
        assert flow_run.state.is_scheduled()
        assert (flow_run.expected_start_time.month, flow_run.expected_start_time.day) == (1, 1)
        assert flow_run.parameters == {"config": config.model_dump(mode="json")}


def _wait_for_state(flow_run_id, names: set[str], *, timeout: float = 300):
    from prefect import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            flow_run = client.read_flow_run(flow_run_id)
            if flow_run.state.name in names or flow_run.state.is_final():
                return flow_run
            assert time.monotonic() < deadline, f"flow run still {flow_run.state.name} after {timeout} s"
            time.sleep(0.5)


def _wait_for_running_flow_runs(count: int, *, started_after: datetime, timeout: float = 120) -> None:
    """Wait until ``count`` flow runs started after ``started_after`` are Running on the session's Prefect server."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilterStartTime

    running = flow_runs_in_state("RUNNING", start_time=FlowRunFilterStartTime(after_=started_after))
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while len(client.read_flow_runs(flow_run_filter=running)) < count:
            assert time.monotonic() < deadline, f"fewer than {count} flow runs Running after {timeout} s"
            time.sleep(0.2)


def test_a_custom_run_with_changed_parameters_continues_the_campaign(served):
    """What the UI's Custom run sends: the deployment's config, with one field changed in the form."""
    from prefect import get_client
    from prefect.deployments import run_deployment

    from flows.rlhf_pipeline import rlhf_iteration

    config, _, deployments, log = served
    rlhf_iteration(config)
    parameters = deployments["rlhf-iteration"].parameters
    parameters["config"]["advantages"]["kl_coef"] = 0.125
    flow_run = run_deployment(
        "rlhf-iteration/tiny", parameters=parameters, timeout=300, poll_interval=1, as_subflow=False
    )
    assert flow_run.state.is_completed(), f"{flow_run.state}\n{log.read_text()[-3000:]}"
    runs = _mlflow_iteration_runs(config)
    assert [run.data.tags["rlhf.iteration"] for run in runs] == ["0", "1"]
    assert runs[1].data.params["advantages.kl_coef"] == "0.125"
    assert runs[0].data.params["advantages.kl_coef"] == str(config.advantages.kl_coef)
    assert runs[1].data.tags["prefect.flow_run_id"] == str(flow_run.id)
    with get_client(sync_client=True) as client:  # issue 27: started as tiny-iteration-next, named once it is known
        assert client.read_flow_run(flow_run.id).name == "tiny-iteration-1"


def test_parameters_the_schema_cannot_check_fail_the_run_before_its_first_task(served):
    """A cross-field check (labeler `import` needs `data.preferences`) passes the server and fails the flow's own
    parameter validation: the run fails before any task, and nothing reaches MLflow."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    config, _, deployments, _ = served
    before = len(_mlflow_iteration_runs(config))
    parameters = deployments["rlhf-iteration"].parameters
    parameters["config"]["labeler"] = "import"
    flow_run = run_deployment(
        "rlhf-iteration/tiny", parameters=parameters, timeout=300, poll_interval=1, as_subflow=False
    )
    assert flow_run.state.is_failed() and "data.preferences" in flow_run.state.message, flow_run.state
    with get_client(sync_client=True) as client:
        assert client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))) == []
    assert len(_mlflow_iteration_runs(config)) == before


def test_two_iterations_of_a_campaign_never_run_at_once(served):
    """A run of the deployment (what the schedule starts) and a command-line iteration, started together."""
    from prefect import get_client
    from prefect.deployments import run_deployment

    from flows.rlhf_pipeline import rlhf_iteration

    config, _, _, log = served
    before = len(_mlflow_iteration_runs(config))
    # The test holds the campaign's lock until both flow runs are Running, so they surely overlap: a tiny
    # iteration (about 3 s) could otherwise finish before the second run has started.
    since = datetime.now(UTC)
    with ThreadPoolExecutor(1) as pool:
        with exclusive_lock(campaign_layout(config).lock_file()):
            scheduled = run_deployment("rlhf-iteration/tiny", timeout=0, as_subflow=False)
            assert _wait_for_state(scheduled.id, {"Running"}).state.name == "Running"
            local_future = pool.submit(rlhf_iteration, config, return_state=True)
            _wait_for_running_flow_runs(2, started_after=since)
        local = local_future.result(timeout=300)
    scheduled = _wait_for_state(scheduled.id, set())
    assert local.is_completed() and scheduled.state.is_completed(), f"{scheduled.state}\n{log.read_text()[-3000:]}"

    runs = _mlflow_iteration_runs(config)[before:]
    assert [int(run.data.tags["rlhf.iteration"]) for run in runs] == [before, before + 1]
    first, second = runs
    assert first.info.end_time <= second.info.start_time, "the two iterations overlapped"
    with get_client(sync_client=True) as client:
        local_run = client.read_flow_run(local.state_details.flow_run_id)
    both_started = max(local_run.start_time, scheduled.start_time).timestamp() * 1000
    assert both_started < first.info.end_time, (
        "the two flow runs did not actually run at the same time: local flow run started "
        f"{local_run.start_time}, scheduled {scheduled.start_time}, first iteration "
        f"{first.info.start_time}..{first.info.end_time} ms\n{log.read_text()[-3000:]}"
    )


def test_sigterm_cancels_the_running_iteration_and_pauses_the_schedule(served):
    """`kill <rlhf serve>` (prefect 3.8.8 alone would leave the run Running, its slot taken, the schedule on)."""
    from prefect import get_client
    from prefect.deployments import run_deployment

    _, process, deployments, log = served
    flow_run = run_deployment("rlhf-iteration/tiny", timeout=0, as_subflow=False)
    assert _wait_for_state(flow_run.id, {"Running"}).state.name == "Running"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0, log.read_text()[-3000:]
    with get_client(sync_client=True) as client:
        iteration = client.read_deployment(deployments["rlhf-iteration"].id)
        flow_run = client.read_flow_run(flow_run.id)
    assert flow_run.state.is_cancelled(), flow_run.state
    assert iteration.paused and iteration.global_concurrency_limit.active_slots == 0, log.read_text()[-3000:]


def test_issue27_serve_without_its_prefect_server_says_so_and_exits_within_seconds(tiny, tmp_path):
    """A server that never answered: refused at once. One that stops while served: SIGTERM ends `rlhf serve` in
    seconds with one line, where Prefect's clients retried for half a minute and printed tracebacks."""
    import httpx

    from tests.flows.test_human_label_form_browser import _free_port, _wait

    _, overrides = tiny
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["PREFECT_UI_ENABLED"] = "false"  # what is tested is the API going away; the UI's files cost seconds to copy
    serve = [sys.executable, "-m", "flows", "serve", "--config", str(CONFIGS / "tiny.yaml")]
    for override in overrides:
        serve += ["--set", override]

    refused = subprocess.run(serve, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines() == [
        f"rlhf: the Prefect server at PREFECT_API_URL={api} does not answer: start it (`prefect server start`), "
        "or point PREFECT_API_URL at one that runs"
    ]

    prefect = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(
        prefect, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    log = tmp_path / "serve.log"
    try:
        _wait(lambda: httpx.get(f"{api}/health").status_code == 200, timeout=180, what="the Prefect server")
        with log.open("w") as output:
            served = subprocess.Popen(serve, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT)
        _wait(lambda: "serving rlhf-iteration/tiny" in log.read_text(), timeout=120, what="rlhf serve serving")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    time.sleep(1)  # the runner has installed its signal handlers just after saying it serves
    started = time.monotonic()
    served.send_signal(signal.SIGTERM)
    code = served.wait(timeout=120)
    took = time.monotonic() - started
    text = log.read_text()
    assert code == 2, text[-3000:]
    assert took < 15, f"rlhf serve took {took:.0f} s to stop"
    assert "Traceback" not in text, text[-3000:]
    assert text.strip().splitlines()[-1].startswith(f"rlhf: the Prefect server at {api} does not answer"), text
