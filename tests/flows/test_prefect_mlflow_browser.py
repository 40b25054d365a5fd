"""Issue 34 as a person sees it, in headless Chromium (slow; skipped without ``chromium``): a Prefect server with its
UI, `rlhf serve --replay-on-register advantages.kl_coef=0.1`, the campaign deployment run as the UI's *Quick run*
does (the tiny campaign: two iterations), and an `mlflow server` over the store it wrote, each on a port of its own.

- The asset graph: the lineage artifact the second iteration left, drawn by the Prefect UI from the base inputs
  to each evaluated policy.
- The automation firing: each registered policy's event triggered the automation, which started a replay of its
  iteration; the event feed shows the chain.
- MLflow's models view: a logged model per policy, critic and reward model, the registered versions with `best`,
  and the evaluation figures on the held-out prompts' dataset.

``RLHF_UPDATE_SCREENSHOTS=1`` rewrites the pictures in docs/ with these pages.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.parse
from pathlib import Path

import httpx
import pytest

from tests.flows.browser import Chromium, chromium_binary
from tests.flows.test_human_label_form_browser import _free_port, _wait
from tests.flows.test_iteration_artifact_browser import TEXT, _start, _stop

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CAMPAIGN = "tiny"
REPLAY_SETTING = "advantages.kl_coef=0.1"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(chromium_binary() is None, reason="needs a chromium binary (Debian: apt-get install chromium)"),
]

DIAGRAM_DRAWN = (
    "[...document.querySelectorAll('pre svg')]"
    ".filter(svg => svg.querySelector('g.node') && svg.getBoundingClientRect().height > 50).length"
)
NODE_LABELS = (
    "[...document.querySelectorAll('pre svg g.node')]"
    ".map(node => (node.querySelector('.nodeLabel') || node).innerText.trim().split('\\n'))"
)
"""Each node's label, as its lines (stage and iteration, digest, figure, what the run did)."""


def _keep(png: bytes, name: str) -> None:
    if os.environ.get("RLHF_UPDATE_SCREENSHOTS"):
        (DOCS / name).write_bytes(png)


@pytest.fixture(scope="module")
def served(checkpoint_world, tmp_path_factory):
    """The servers, `rlhf serve` with the replay automation, and the campaign deployment's run, finished with the
    replays the automation started."""
    tmp = tmp_path_factory.mktemp("issue34-browser")
    prefect_port, mlflow_port = _free_port(), _free_port()
    api, mlflow_url = f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}"
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "PREFECT_API_URL": api, "PYTHONPATH": str(ROOT)}
    env |= {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env |= {"PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    runs = tmp / "runs"
    prefect = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)]
    serve = [sys.executable, "-m", "flows", "serve", "--config", str(ROOT / "configs" / "tiny.yaml")]
    serve += ["--set", f"run_root={runs}", "--set", f"tracking_ui_url={mlflow_url}"]
    for setting, key in (
        ("model.policy", "policy"),
        ("data.prompts", "prompts"),
        ("data.eval_prompts", "eval_prompts"),
    ):
        serve += ["--set", f"{setting}={checkpoint_world[key]}"]
    serve += ["--replay-on-register", REPLAY_SETTING]
    mlflow = [
        sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{runs / 'mlflow.db'}",
        "--default-artifact-root", str(runs / "mlartifacts"), "--host", "127.0.0.1", "--port", str(mlflow_port),
        "--workers", "1",
    ]  # fmt: skip
    servers = [_start(prefect, tmp / "prefect.log", env)]
    try:
        _wait(lambda: httpx.get(f"{api}/health").status_code == 200, timeout=180, what="the Prefect server")
        servers.append(_start(serve, tmp / "serve.log", env))
        deployment = _deployment(api, f"rlhf-campaign/{CAMPAIGN}", tmp / "serve.log")
        _quick_run(api, deployment)
        campaign = _finished(api, f"{CAMPAIGN}-campaign", count=1, log=tmp / "serve.log")
        replays = _finished(api, f"{CAMPAIGN}-replay-of-", count=2, log=tmp / "serve.log")
        servers.append(_start(mlflow, tmp / "mlflow.log", env))  # over the store the runs created
        _wait(lambda: httpx.get(f"{mlflow_url}/health").status_code == 200, timeout=180, what="the MLflow server")
        yield {
            "ui": f"http://127.0.0.1:{prefect_port}",
            "api": api,
            "mlflow": mlflow_url,
            "runs": runs,
            "campaign": campaign,
            "replays": replays,
            "tmp": tmp,
        }
    finally:
        for server in reversed(servers):
            _stop(server)


def _quick_run(api: str, deployment: str) -> None:
    """What the UI's *Quick run* does. A Prefect server on SQLite answers 503 while its database is locked (a loaded
    machine); Prefect's own client retries that, and so does this."""
    deadline = time.monotonic() + 120
    while (answer := httpx.post(f"{api}/deployments/{deployment}/create_flow_run", json={})).status_code == 503:
        assert time.monotonic() < deadline, answer.text
        time.sleep(2)
    answer.raise_for_status()


def _deployment(api: str, name: str, log: Path) -> str:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        found = httpx.get(f"{api}/deployments/name/{name}")
        if found.status_code == 200:
            return found.json()["id"]
        time.sleep(1)
    raise AssertionError(f"rlhf serve made no deployment {name} in 180 s:\n{log.read_text()[-3000:]}")


def _finished(api: str, name: str, *, count: int, log: Path) -> list[dict]:
    """The flow runs whose name starts with ``name``, once ``count`` of them are Completed (any ending otherwise
    fails the test at once, with the serving log)."""
    deadline = time.monotonic() + 1200
    while time.monotonic() < deadline:
        found = httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": {"name": {"like_": name}}}).json()
        found = [run for run in found if run["name"].startswith(name)]
        ended = [run for run in found if run["state_type"] in ("FAILED", "CRASHED", "CANCELLED")]
        assert not ended, f"{[run['name'] for run in ended]} ended {ended[0]['state_type']}:\n{log.read_text()[-5000:]}"
        if len([run for run in found if run["state_type"] == "COMPLETED"]) >= count:
            return found
        time.sleep(2)
    raise AssertionError(f"fewer than {count} runs {name}* finished in 20 minutes:\n{log.read_text()[-5000:]}")


def _artifact_of(api: str, key: str, flow_run_name: str) -> dict:
    (run,) = [
        run
        for run in httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": {"name": {"any_": [flow_run_name]}}}).json()
    ]
    artifacts = httpx.post(
        f"{api}/artifacts/filter",
        json={"artifacts": {"key": {"any_": [key]}, "flow_run_id": {"any_": [run["id"]]}}},
    ).json()
    return artifacts[0]


def test_the_asset_graph_shows_the_campaigns_lineage_to_each_evaluated_policy(served):
    """The Prefect UI now answers "what was this policy made from?": base policy and prompts, every stage output as
    an asset named by its digest, through both iterations, to each evaluation and its gold win rate."""
    artifact = _artifact_of(served["api"], f"{CAMPAIGN}-lineage", f"{CAMPAIGN}-iteration-1")
    with Chromium(chromium_binary(), width=1600, height=2300) as page:
        page.open(f"{served['ui']}/v2/artifacts/artifact/{artifact['id']}")
        page.wait_for(DIAGRAM_DRAWN, what="the lineage diagram")
        labels = page.evaluate(NODE_LABELS)
        png = page.screenshot(served["tmp"] / "asset-graph.png")
    stages = ("initialize", "sample_candidates", "collect_preferences", "train_reward_model", "rollout")
    stages += ("compute_advantages", "ppo_update", "evaluate")
    drawn = {label[0]: label[1:] for label in labels}
    expected = [f"{stage} · 0" for stage in stages] + [f"{stage} · 1" for stage in stages[1:]]
    reference = "sample_reference · 0"  # the reference's samples, made once per campaign, reused by iteration 1
    assert set(drawn) == {*expected, reference, "policy", "prompts", "eval_prompts"}, labels
    assert drawn[reference][-1] == "reused"
    assert all(re.fullmatch(r"[0-9a-f]{8}", lines[0]) for lines in drawn.values())  # digest or content, in short
    assert drawn["evaluate · 0"][1].startswith("gold win rate") and drawn["evaluate · 1"][1].startswith("gold win rate")
    assert all(drawn[f"{stage} · 1"][-1] == "wrote" for stage in stages[1:])  # this run's own outputs
    assert len(png) > 50_000
    _keep(png, "prefect-asset-graph.png")


def test_a_registered_policy_fires_the_automation_that_replays_its_iteration(served):
    """The Prefect UI now answers "what happened when a policy was registered?": the event, the automation it
    triggered, the replay run the automation started and that replay's evaluation, in order."""
    api = served["api"]
    (automation,) = httpx.post(f"{api}/automations/filter", json={}).json()
    assert automation["trigger"]["expect"] == ["rlhf.policy.registered"]
    iterations = {
        run["id"]: run
        for run in httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": {"name": {"like_": "iteration"}}}).json()
    }
    for replay in served["replays"]:
        assert replay["created_by"]["type"] == "AUTOMATION" and replay["created_by"]["id"] == automation["id"]
        assert replay["parameters"]["config"]["advantages"]["kl_coef"] == 0.1
        assert re.fullmatch(r"[0-9a-f]{32}", replay["parameters"]["source_run_id"])
    assert len(iterations) == 2  # each replayed the iteration whose policy it was told of: two policies, two replays
    assert len({replay["parameters"]["source_run_id"] for replay in served["replays"]}) == 2

    resources = [f"rlhf.campaign.{CAMPAIGN}", f"prefect.automation.{automation['id']}"]
    shown = ["rlhf.policy.registered", "prefect.automation.triggered", "prefect.automation.action.executed"]
    shown += ["rlhf.iteration.evaluated"]
    wanted = {"rlhf.policy.registered": 2, "prefect.automation.action.executed": 2, "rlhf.iteration.evaluated": 1}
    _wait(lambda: _stored_events(api, wanted), timeout=300, what=f"the Prefect server to store the events {wanted}")
    query = urllib.parse.urlencode({"resource": json.dumps(resources), "events": json.dumps(shown), "order": "ASC"})
    with Chromium(chromium_binary(), width=1500, height=2400) as page:
        page.open(f"{served['ui']}/v2/events?{query}")
        text = page.wait_for(
            f"{TEXT}.split('Automation Action Executed').length > 2 && {TEXT}.split('Rlhf Policy Registered').length > 2 "
            f"&& {TEXT}.includes('Rlhf Iteration Evaluated') && {TEXT}",
            what="both policies' events, the automation's and an evaluation's",
        )
        png = page.screenshot(served["tmp"] / "automation.png")
    order = [
        text.index(name) for name in ("Rlhf Policy Registered", "Automation Triggered", "Automation Action Executed")
    ]
    assert order == sorted(order), text[:3000]
    assert automation["name"] in text and f"rlhf://{CAMPAIGN}/ppo_update" in text
    _keep(png, "prefect-automation.png")


def _stored_events(api: str, wanted: dict[str, int]) -> bool:
    """Whether the server holds at least ``wanted[name]`` events of each name. Events reach the server's database
    through its persister, in batches, so the replays can finish before their events are stored. Last stop's CI
    failed this test with a page short of these events after 120 s; waiting for the server first tells a late store
    from a slow page (whose wait is then the browser's default, 180 s)."""
    body = {"filter": {"event": {"name": list(wanted)}}, "limit": 50}  # a page: Prefect's largest, above ours
    answer = httpx.post(f"{api}/events/filter", json=body)
    if answer.status_code == 503:  # a server on SQLite answers so while its database is locked
        return False
    assert answer.status_code == 200, answer.text
    names = [event["event"] for event in answer.json()["events"]]
    return all(names.count(name) >= count for name, count in wanted.items())


def test_mlflow_models_view_compares_the_policies_on_the_held_out_prompts(served):
    """MLflow's UI now answers "which policy is best on the held-out prompts, with which reward model?": a logged
    model per checkpoint, its registered version (`best` on the top one), its figures on the eval prompts' dataset."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{served['runs'] / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(CAMPAIGN)
    models = client.search_logged_models([experiment.experiment_id])
    names = sorted(model.name for model in models)
    assert names == sorted(
        [f"{role}-iteration-{i}" for role in ("actor", "critic", "reward_model") for i in (0, 1)]
        + [f"{role}-iteration-{i}-replay" for role in ("actor", "critic") for i in (0, 1)]
    )
    best = client.get_model_version_by_alias(f"{CAMPAIGN}-actor", "best")
    url = f"{served['mlflow']}/#/experiments/{experiment.experiment_id}/models?workflowType=machine_learning"
    with Chromium(chromium_binary(), width=2200, height=900) as page:
        page.open(url)
        page.wait_for(f"{TEXT}.includes('actor-iteration-1-replay')", what="the logged models")
        page.evaluate("document.querySelector('button[aria-label=Close]')?.click() ?? true")  # MLflow's assistant panel
        headers = page.wait_for(
            "[...document.querySelectorAll('[role=columnheader]')].map(h => h.innerText).join(' | ')"
            ".includes('evaluate/gold_win_rate') && "
            "[...document.querySelectorAll('[role=columnheader]')].map(h => h.innerText).join(' | ')",
            what="the evaluation columns",
        )
        text = page.evaluate(TEXT)
        png = page.screenshot(served["tmp"] / "models.png")
    assert "eval_prompts[:8]" in headers and "held_out_pairs" in text
    for name in names:
        assert name in text
    assert f"{CAMPAIGN}-actor" in text and f"v{best.version}" in text
    _keep(png, "mlflow-models.png")
