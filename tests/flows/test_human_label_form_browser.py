"""The human-label form as a person sees it: a Prefect server with its UI, a flow run paused on a
form, and headless Chromium opening the run's Resume form (slow; skipped without a ``chromium``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.flows.browser import Chromium, chromium_binary

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Tell me about the warm window.", "Tell me about the cold field."]
RESPONSES = ["The cat sat by the warm window and watched the rain. " * 8, "A dog ran across the cold field. " * 10]
# Two prompts with two pairs each: pairs 1-2 answer the first prompt, 3-4 the second.
ASKING = textwrap.dedent(
    f"""
    from prefect import flow
    from flows.human_labels import ask_for_labels
    from tasks.labelers import CandidatePair
    from tasks.text import Prompt

    pairs = [
        CandidatePair(prompt=Prompt(p), first=f"{{p.split()[-1][:-1]}} {{k}}A: {RESPONSES[0]}", second=f"{{p.split()[-1][:-1]}} {{k}}B: {RESPONSES[1]}",
                      first_ids=[1], second_ids=[2])
        for p in {PROMPTS!r} for k in range(2)
    ]
    flow(name="ask")(lambda: ask_for_labels(pairs, heading="test", pairs_per_form=8, timeout_seconds=300, poll_seconds=1))()
    """
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(chromium_binary() is None, reason="needs a chromium binary (Debian: apt-get install chromium)"),
]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait(condition, *, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if value := condition():
                return value
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(what)


def test_the_resume_form_shows_each_prompt_once_and_every_response(tmp_path):
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api, "PYTHONPATH": str(ROOT)}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    prefect = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen(prefect, env=env, stdout=log, stderr=subprocess.STDOUT)
    asking = None
    try:
        _wait(lambda: httpx.get(f"{api}/health").status_code == 200, timeout=180, what="the Prefect server")
        asking = subprocess.Popen(
            [sys.executable, "-c", ASKING], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        paused = {"flow_runs": {"state": {"type": {"any_": ["PAUSED"]}}}}
        (run,) = _wait(lambda: httpx.post(f"{api}/flow_runs/filter", json=paused).json(), timeout=120, what="a pause")
        with Chromium(chromium_binary(), width=1400, height=1500) as page:
            page.open(f"http://127.0.0.1:{port}/runs/flow-run/{run['id']}")  # the run's "View at" link
            buttons = "[...document.querySelectorAll('button')]"
            page.wait_for(f"{buttons}.some(b => b.innerText.trim() === 'Resume')", what="the Resume button")
            page.click(f"{buttons}.find(b => b.innerText.trim() === 'Resume')")
            text = page.wait_for(
                "document.querySelector('[role=dialog] blockquote') && document.querySelector('[role=dialog]').innerText",
                what="the form",
            )
            png = page.screenshot(tmp_path / "form.png")
    finally:
        for process in (asking, server):
            if process is not None:
                process.terminate()
                process.wait(timeout=30)
    for prompt in PROMPTS:
        assert text.count(prompt) == 1
    for name in ("window 0", "window 1", "field 0", "field 1"):
        assert f"{name}A: {RESPONSES[0].strip()}" in text
        assert f"{name}B: {RESPONSES[1].strip()}" in text
    assert [f"Pair {n} of 4" in text for n in range(1, 5)] == [True] * 4
    assert len(png) > 50_000  # a blank page of this size is a few kilobytes
