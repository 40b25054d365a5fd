"""The temporary Prefect server a command starts when no PREFECT_API_URL is set: it answers, Prefect uses
it, and it dies with the command, ``kill -9`` included (issue 14: it used to outlive it as an orphan)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.processes import running

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> set[int]:
    children = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                children.add(int(entry.name))
    return children


COMMAND = """
import time
from prefect import flow
from prefect.settings import get_current_settings
import flows.prefect_server as server

@flow
def heartbeat_frequency():
    return get_current_settings().flows.heartbeat_frequency  # what the flow engine reads for this run

server.start_prefect_api()
server.start_prefect_api()  # launched once
print(server._launching[0].pid, flush=True)
server.ensure_prefect_api()
print(get_current_settings().api.url, flush=True)
with server.flow_settings():
    print(heartbeat_frequency(), flush=True)
print(heartbeat_frequency(), flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def command():
    """A command's temporary server, launched first and waited for last, and two flow runs against it, the first
    with the command's flow settings; then the command waits to be killed. What it printed, its children then."""
    environment = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    process = subprocess.Popen(
        [sys.executable, "-c", COMMAND], cwd=ROOT, env=environment, stdout=subprocess.PIPE, text=True
    )
    try:
        launched, url, in_flow_settings, outside = (process.stdout.readline().strip() for _ in range(4))
        yield SimpleNamespace(
            process=process, launched=int(launched), url=url, heartbeats=[in_flow_settings, outside],
            children=_children(process.pid),
        )  # fmt: skip
    finally:
        process.kill()
        process.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the temporary server is Linux's")
def test_the_server_launched_first_is_the_one_the_command_waits_for(command):
    assert command.url.startswith("http://127.0.0.1:") and command.url.endswith("/api"), command.url
    assert command.children == {command.launched}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the temporary server is Linux's")
def test_flows_against_the_commands_temporary_server_send_no_heartbeats(command):
    assert command.heartbeats == ["None", "180"]  # Prefect's default outside the command's flows


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_issue14_the_temporary_server_dies_with_its_command_even_on_kill_minus_nine(command):
    """At once (issue 42: tied to SIGTERM, its graceful stop was still running 3 s after the kill in 1 of 24 crash
    cases; it is tied to SIGKILL now, tests/runtime/test_children.py)."""
    assert running(command.launched)
    os.kill(command.process.pid, signal.SIGKILL)
    command.process.wait(timeout=30)
    deadline = time.monotonic() + 3
    while running(command.launched) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(command.launched), "the server outlived the command by 3 s"


HEARTBEAT_IN_FLOW_SETTINGS = """
import json, os, sys
from prefect.context import refresh_global_settings_context
from prefect.settings import get_current_settings
from flows.prefect_server import flow_settings
base = dict(os.environ)
for folder in sys.argv[1:]:  # each case's folder: its environment, and its prefect.toml if it has one
    os.chdir(folder)
    os.environ.clear()
    os.environ.update(base, **json.loads(open("environment.json").read()))
    refresh_global_settings_context()  # Prefect's settings read again, as a fresh process would read them
    with flow_settings():
        print(get_current_settings().flows.heartbeat_frequency, flush=True)
"""
SETTINGS = [
    ({}, "None"),  # Prefect would start a temporary server of its own
    ({"PREFECT_API_URL": "http://127.0.0.1:9/api"}, "180"),  # the user's own server may watch for them
    ({"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "60"}, "60"),  # the user's choice
    ({"prefect.toml": "[flows]\nheartbeat_frequency = 90\n"}, "90"),  # the same, in a settings file
]


@pytest.fixture(scope="module")
def heartbeats_under_settings(tmp_path_factory) -> list[str]:
    """The heartbeat frequency of the command's flow settings under each of :data:`SETTINGS`, in one process that
    reads Prefect's settings again for each."""
    folders = []
    for index, (setting, _) in enumerate(SETTINGS):
        folder = tmp_path_factory.mktemp(f"setting-{index}")
        if "prefect.toml" in setting:
            (folder / "prefect.toml").write_text(setting["prefect.toml"])
        (folder / "environment.json").write_text(json.dumps({k: v for k, v in setting.items() if k != "prefect.toml"}))
        folders.append(str(folder))
    environment = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    environment["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", HEARTBEAT_IN_FLOW_SETTINGS, *folders], env=environment, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


@pytest.mark.parametrize(("setting", "heartbeat"), SETTINGS)
def test_a_users_server_or_heartbeat_setting_keeps_prefects_heartbeats(heartbeats_under_settings, setting, heartbeat):
    assert heartbeats_under_settings[SETTINGS.index((setting, heartbeat))] == heartbeat


LAUNCH_FIRST = """
import sys, time
import flows.prefect_server as server
from prefect.settings import get_current_settings
server.start_prefect_api()
server.start_prefect_api()  # launched once
print(server._launching[0].pid, flush=True)
if sys.argv[1] == "fail":  # as a command whose input checks fail before it waits for the server
    raise SystemExit(2)
if sys.argv[1] == "configured":  # an API URL set since, in this context: that one is used
    import os
    from prefect.context import refresh_global_settings_context
    os.environ["PREFECT_API_URL"] = "http://127.0.0.1:9/api"
    refresh_global_settings_context()
server.ensure_prefect_api()
print(get_current_settings().api.url, flush=True)
time.sleep(600)
"""


def _launch_first(then: str) -> subprocess.Popen:
    environment = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCH_FIRST, then], cwd=ROOT, env=environment, stdout=subprocess.PIPE, text=True
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the temporary server is Linux's")
def test_a_command_that_fails_before_waiting_for_the_server_stops_it():
    process = _launch_first("fail")
    launched = int(process.stdout.readline())
    assert process.wait(timeout=60) == 2
    deadline = time.monotonic() + 30
    while running(launched) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(launched), "the server outlived the command"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the temporary server is Linux's")
def test_a_server_launched_before_an_api_url_was_configured_is_stopped_and_the_url_used():
    process = _launch_first("configured")
    try:
        launched = int(process.stdout.readline())
        assert process.stdout.readline().strip() == "http://127.0.0.1:9/api"
        assert not running(launched) and not _children(process.pid)
    finally:
        process.kill()
        process.wait()


REFUSED_IN_PROCESS = """
import os, sys, time
from flows.cli import main
print(main(sys.argv[1:]), flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the temporary server is Linux's")
def test_a_command_refused_in_a_process_that_goes_on_leaves_no_server_behind(checkpoint_world, tmp_path):
    """Tests call ``flows.cli.main`` in their own process: a refused replay must not leave its server running."""
    command = [
        "replay", "--config", str(ROOT / "configs" / "tiny.yaml"), f"--set=run_root={tmp_path}",
        f"--set=model.policy={checkpoint_world['policy']}", f"--set=data.prompts={checkpoint_world['prompts']}",
        f"--set=data.eval_prompts={checkpoint_world['eval_prompts']}", "nosuch:0",
    ]  # fmt: skip
    environment = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    process = subprocess.Popen(
        [sys.executable, "-c", REFUSED_IN_PROCESS, *command], cwd=ROOT, env=environment, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert process.stdout.readline().strip() == "2"
        assert not _children(process.pid)
    finally:
        process.kill()
        process.wait()
