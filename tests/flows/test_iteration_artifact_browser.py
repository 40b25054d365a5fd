"""The iteration's Prefect artifact as a person sees it: a Prefect server with its UI, a real `rlhf run` of the
tiny campaign against it and a real MLflow tracking server, and headless Chromium opening the artifact page
(slow; skipped without ``chromium``).

The artifact (flows.campaign.close_iteration) holds a row per stage, the over-optimisation figure (served by the
tracking server) and one metric per row; every metric's name and value must be on the page, no table cell may
cut its text off, and the figure must load.
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
from tests.flows.test_tracking_server import tracking_server  # noqa: F401 - the fixture

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


def test_the_iteration_artifact_shows_every_metric_whole_and_the_figure(checkpoint_world, tracking_server, tmp_path):  # noqa: F811
    mlflow_url, _ = tracking_server
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api, "PYTHONPATH": str(ROOT)}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    prefect = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    run = [sys.executable, "-m", "flows", "run", "--config", str(ROOT / "configs" / "tiny.yaml")]
    run += ["--set", f"run_root={tmp_path / 'runs'}", "--set", f"tracking_uri={mlflow_url}", "--set", "iterations=1"]
    for setting, key in (
        ("model.policy", "policy"),
        ("data.prompts", "prompts"),
        ("data.eval_prompts", "eval_prompts"),
    ):
        run += ["--set", f"{setting}={checkpoint_world[key]}"]
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen(prefect, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: httpx.get(f"{api}/health").status_code == 200, timeout=180, what="the Prefect server")
        finished = subprocess.run(run, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
        key = {"any_": ["tiny-iteration-0"]}
        artifacts = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": key}})
        (artifact,) = artifacts.json()
        with Chromium(chromium_binary(), width=1400, height=2400) as page:
            page.open(f"http://127.0.0.1:{port}/artifacts/artifact/{artifact['id']}")
            text = page.wait_for(
                "document.body && document.body.innerText.includes('evaluate/kl_to_reference') && document.body.innerText",
                what="the artifact's metrics",
            )
            cut_off = page.evaluate(CUT_OFF_CELLS)
            page.wait_for(FIGURE_LOADED, what="the over-optimisation figure from the tracking server")
            png = page.screenshot(tmp_path / "artifact.png")
    finally:
        server.terminate()
        server.wait(timeout=30)
    metrics = re.findall(r"^\| (\S+/\S+) \| ([^|]+?) \|$", artifact["data"], flags=re.MULTILINE)
    assert len(metrics) > 20, artifact["data"]
    for name, value in metrics:
        assert name in text and value in text, f"{name} = {value} is not on the artifact page"
    assert cut_off == [], f"table cells cut off: {cut_off}"
    assert len(png) > 50_000  # a blank page of this size is a few kilobytes
    if os.environ.get("RLHF_UPDATE_SCREENSHOTS"):  # docs/iteration-artifact.png is this screenshot
        (DOCS / "iteration-artifact.png").write_bytes(png)
