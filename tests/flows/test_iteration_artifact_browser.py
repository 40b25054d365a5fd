"""The iteration's Prefect artifact and the MLflow UI as a person sees them (issues 15 and 27): a Prefect server with
its UI and an `mlflow server` over the run's local store, each on a port of its own (neither 4200 nor 5000), a
real `rlhf run` of the tiny campaign told where the MLflow UI is (`tracking_ui_url`), and headless Chromium
(slow; skipped without ``chromium``).

The artifact (flows.iterations.close_iteration) holds a row per stage, the over-optimisation figure (embedded: it
shows with no server behind it) and one metric per row; every metric's name and value must be on the page, no table
cell may cut its text off, the figure must load and the MLflow link must open the iteration's run. The link `rlhf
run` prints must open the campaign's experiment on its runs, which MLflow 3.17 shows only in its machine-learning
view (storage.mlflow_store.UI_RUNS_VIEW): its bare experiment page opens on the GenAI overview instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.flows.browser import Chromium, chromium_binary
from tests.flows.test_human_label_form_browser import _free_port, _wait

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(chromium_binary() is None, reason="needs a chromium binary (Debian: apt-get install chromium)"),
]

# Every table cell whose text is wider than the cell (clipped or hidden), as "text" strings.
CUT_OFF_CELLS = """
[...document.querySelectorAll('td, th')]
  .filter(cell => cell.scrollWidth > cell.clientWidth + 1)
  .map(cell => cell.innerText.trim())
"""

FIGURE_LOADED = (
    "[...document.images].some(image => image.alt.startsWith('over-optimisation') && image.naturalWidth > 0)"
)
TEXT = "(document.body ? document.body.innerText : '')"


def _start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as output:
        return subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(server: subprocess.Popen) -> None:
    os.killpg(server.pid, 15)
    server.wait(timeout=30)


def test_the_artifact_and_the_mlflow_links_work_with_both_uis_on_ports_of_their_own(checkpoint_world, tmp_path):
    prefect_port, mlflow_port = _free_port(), _free_port()
    api, mlflow_url = f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api, "PYTHONPATH": str(ROOT)}
    env |= {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    runs = tmp_path / "runs"
    prefect = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)]
    mlflow = [
        sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{runs / 'mlflow.db'}",
        "--default-artifact-root", str(runs / "mlartifacts"), "--host", "127.0.0.1", "--port", str(mlflow_port),
        "--workers", "1",
    ]  # fmt: skip
    run = [sys.executable, "-m", "flows", "run", "--config", str(ROOT / "configs" / "tiny.yaml")]
    run += ["--set", f"run_root={runs}", "--set", f"tracking_ui_url={mlflow_url}", "--set", "iterations=1"]
    for setting, key in (
        ("model.policy", "policy"),
        ("data.prompts", "prompts"),
        ("data.eval_prompts", "eval_prompts"),
    ):
        run += ["--set", f"{setting}={checkpoint_world[key]}"]
    servers = [_start(prefect, tmp_path / "prefect.log", env)]
    try:
        _wait(lambda: httpx.get(f"{api}/health").status_code == 200, timeout=180, what="the Prefect server")
        finished = subprocess.run(run, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
        servers.append(_start(mlflow, tmp_path / "mlflow.log", env))  # over the store the run created
        _wait(lambda: httpx.get(f"{mlflow_url}/health").status_code == 200, timeout=180, what="the MLflow server")
        key = {"any_": ["tiny-iteration-0"]}
        (artifact,) = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": key}}).json()
        (experiment_link,) = re.findall(r"^MLflow: (\S+)$", finished.stdout, flags=re.MULTILINE)
        with Chromium(chromium_binary(), width=1400, height=2400) as page:
            page.open(f"http://127.0.0.1:{prefect_port}/artifacts/artifact/{artifact['id']}")
            text = page.wait_for(f"{TEXT}.includes('evaluate/kl_to_reference') && {TEXT}", what="the metrics")
            cut_off = page.evaluate(CUT_OFF_CELLS)
            page.wait_for(FIGURE_LOADED, what="the over-optimisation figure")
            png = page.screenshot(tmp_path / "artifact.png")
            run_link = page.evaluate("[...document.links].map(link => link.href).find(href => href.includes('#/'))")

            page.open(run_link)  # the iteration's run page in the MLflow UI
            page.wait_for(f"{TEXT}.includes('iteration-0')", what="the iteration's run")

            page.open(experiment_link)
            runs_page = page.wait_for(f"{TEXT}.includes('iteration-0') && {TEXT}", what="the campaign's runs")
            page.screenshot(tmp_path / "mlflow-runs.png")
            page.open(f"{mlflow_url}/#/experiments/{experiment_link.split('/experiments/')[1].split('/')[0]}")
            bare = page.wait_for(f"{TEXT}.includes('Observability') && {TEXT}", what="MLflow's GenAI overview")
    finally:
        for server in servers:
            _stop(server)
    metrics = re.findall(r"^\| (\S+/\S+) \| ([^|]+?) \|$", artifact["data"], flags=re.MULTILINE)
    assert len(metrics) > 20, artifact["data"]
    for name, value in metrics:
        assert name in text and value in text, f"{name} = {value} is not on the artifact page"
    assert cut_off == [], f"table cells cut off: {cut_off}"
    assert len(png) > 50_000  # a blank page of this size is a few kilobytes
    assert run_link.startswith(f"{mlflow_url}/#/experiments/"), run_link
    assert experiment_link.startswith(f"{mlflow_url}/#/experiments/"), experiment_link
    assert "Observability" not in runs_page, runs_page[:2000]  # the runs table, not the GenAI overview
    assert "iteration-0" not in bare, "MLflow's bare experiment page no longer opens on the GenAI overview"
    if os.environ.get("RLHF_UPDATE_SCREENSHOTS"):  # docs/iteration-artifact.png is this screenshot
        (DOCS / "iteration-artifact.png").write_bytes(png)
