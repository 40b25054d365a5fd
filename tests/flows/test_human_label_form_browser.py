"""The human-label forms as a person sees them: a Prefect server with its UI, a flow run paused on a
form, and headless Chromium opening the run's Resume form, then the labelling page the waiting run
serves (slow; skipped without a ``chromium``)."""

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
DOCS = ROOT / "docs"
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
    ask = lambda: ask_for_labels(
        pairs, heading="test", pairs_per_form=8, timeout_seconds=300, poll_seconds=1, page_address=("127.0.0.1", PORT)
    )
    print("choices:", flow(name="ask")(ask)())
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


@pytest.fixture(scope="module")
def paused(tmp_path_factory):
    """A Prefect server with its UI and a flow run paused on a form of 4 pairs: ``(server port, run, page URL,
    the asking process)``. One for the module (issue 41: a server with its UI and a paused run cost 80-150 s): its
    first test only looks at the form, its second answers it, so the second comes last."""
    tmp_path = tmp_path_factory.mktemp("paused")
    port, page_port = _free_port(), _free_port()
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
            [sys.executable, "-c", f"PORT = {page_port}\n{ASKING}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        paused = {"flow_runs": {"state": {"type": {"any_": ["PAUSED"]}}}}
        (run,) = _wait(lambda: httpx.post(f"{api}/flow_runs/filter", json=paused).json(), timeout=120, what="a pause")
        yield port, run, f"http://127.0.0.1:{page_port}/", asking
    finally:
        for process in (asking, server):
            if process is not None:
                process.terminate()
                process.wait(timeout=30)


def test_the_resume_form_shows_each_prompt_once_and_every_response(paused, tmp_path):
    port, run, page_url, _ = paused
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
    for prompt in PROMPTS:
        assert text.count(prompt) == 1
    for name in ("window 0", "window 1", "field 0", "field 1"):
        assert f"{name}A: {RESPONSES[0].strip()}" in text
        assert f"{name}B: {RESPONSES[1].strip()}" in text
    assert [f"Pair {n} of 4" in text for n in range(1, 5)] == [True] * 4
    assert page_url in text  # the form points to the labelling page
    assert len(png) > 50_000  # a blank page of this size is a few kilobytes
    if os.environ.get("RLHF_UPDATE_SCREENSHOTS"):  # docs/human-label-form.png is this screenshot
        (DOCS / "human-label-form.png").write_bytes(png)


# A and B of each pair side by side, each box wide enough for its text (nothing cut off sideways), and its
# whole text readable (shown, or scrollable within the box).
LAYOUT = """[...document.querySelectorAll('.pair')].map(pair => {
  const [a, b] = [...pair.querySelectorAll('.response')].map(box => box.getBoundingClientRect());
  const boxes = [...pair.querySelectorAll('.response')];
  return {sideBySide: Math.abs(a.top - b.top) < 1 && a.right < b.left && a.width > 400 && b.width > 400,
          wraps: boxes.every(box => box.scrollWidth <= box.clientWidth),
          readable: boxes.every(box => box.scrollHeight <= box.clientHeight || getComputedStyle(box).overflowY === 'auto')};
})"""


def test_the_labelling_page_takes_one_click_per_pair_and_resumes_the_run(paused, tmp_path):
    port, run, page_url, asking = paused
    choices = ["A", "B", "tie/skip", "B"]
    buttons = {"A": 0, "tie/skip": 1, "B": 2}  # the order of the three buttons under a pair
    with Chromium(chromium_binary(), width=1400, height=1200) as page:
        page.open(page_url)
        page.wait_for("document.querySelectorAll('.pair').length === 4", what="the labelling page")
        text = page.evaluate("document.body.innerText")
        layout = page.evaluate(LAYOUT)
        for pair, choice in enumerate(choices):
            page.click(
                f"document.querySelectorAll('.pair')[{pair}].querySelectorAll('.choices span')[{buttons[choice]}]"
            )
        counted = page.evaluate("document.getElementById('count').textContent")
        page.evaluate("window.scrollTo(0, 0)")
        png = page.screenshot(tmp_path / "page.png")
        page.click("document.querySelector('footer button')")
        sent = page.wait_for(
            "document.body.innerText.includes('Sent 4 answers') && document.body.innerText", what="the answers sent"
        )
    out, _ = asking.communicate(timeout=60)
    for prompt in PROMPTS:
        assert text.count(prompt) == 1
    for name in ("window 0", "window 1", "field 0", "field 1"):
        assert f"{name}A: {RESPONSES[0].strip()}" in text and f"{name}B: {RESPONSES[1].strip()}" in text
    assert layout == [{"sideBySide": True, "wraps": True, "readable": True}] * 4
    assert counted == "4" and "The run resumes" in sent
    assert f"choices: {choices}" in out  # the flow run resumed with exactly the clicked answers
    assert len(png) > 50_000
    if os.environ.get("RLHF_UPDATE_SCREENSHOTS"):  # docs/label-page.png is this screenshot
        (DOCS / "label-page.png").write_bytes(png)
