"""The temporary Prefect server a command starts when no PREFECT_API_URL is set: it answers, Prefect uses
it, and it dies with the command, ``kill -9`` included (issue 14: it used to outlive it as an orphan)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMAND = """
import time
from flows.prefect_server import ensure_prefect_api
from prefect.settings import get_current_settings
ensure_prefect_api()
print(get_current_settings().api.url, flush=True)
time.sleep(600)
"""


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


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_issue14_the_temporary_server_dies_with_its_command_even_on_kill_minus_nine():
    environment = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    process = subprocess.Popen(
        [sys.executable, "-c", COMMAND], cwd=ROOT, env=environment, stdout=subprocess.PIPE, text=True
    )
    try:
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/api"), url
        (server,) = _children(process.pid)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _running(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(server), "the server outlived the command"
    finally:
        process.kill()
        process.wait()


HEARTBEAT_IN_A_FLOW = """
from prefect import flow
from prefect.settings import get_current_settings
from flows.prefect_server import ensure_prefect_api, flow_settings

@flow
def heartbeat_frequency():
    return get_current_settings().flows.heartbeat_frequency  # what the flow engine reads for this run

ensure_prefect_api()
with flow_settings():
    print(heartbeat_frequency())
print(heartbeat_frequency())
"""


def test_flows_against_the_commands_temporary_server_send_no_heartbeats():
    environment = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    out = subprocess.run(
        [sys.executable, "-c", HEARTBEAT_IN_A_FLOW], cwd=ROOT, env=environment, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["None", "180"]  # Prefect's default outside the command's flows


HEARTBEAT_IN_FLOW_SETTINGS = """
from prefect.settings import get_current_settings
from flows.prefect_server import flow_settings
with flow_settings():
    print(get_current_settings().flows.heartbeat_frequency)
"""


@pytest.mark.parametrize(
    ("setting", "heartbeat"),
    [
        ({}, "None"),  # Prefect would start a temporary server of its own
        ({"PREFECT_API_URL": "http://127.0.0.1:9/api"}, "180"),  # the user's own server may watch for them
        ({"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "60"}, "60"),  # the user's choice
        ({"prefect.toml": "[flows]\nheartbeat_frequency = 90\n"}, "90"),  # the same, in a settings file
    ],
)
def test_a_users_server_or_heartbeat_setting_keeps_prefects_heartbeats(tmp_path, setting, heartbeat):
    environment = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    environment["PYTHONPATH"] = str(ROOT)
    if "prefect.toml" in setting:
        (tmp_path / "prefect.toml").write_text(setting["prefect.toml"])
    else:
        environment.update(setting)
    out = subprocess.run(
        [sys.executable, "-c", HEARTBEAT_IN_FLOW_SETTINGS],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [heartbeat]


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
def test_the_server_launched_first_is_the_one_the_command_waits_for():
    process = _launch_first("wait")
    try:
        launched = int(process.stdout.readline())
        assert process.stdout.readline().strip().startswith("http://127.0.0.1:")
        assert _children(process.pid) == {launched}
    finally:
        process.kill()
        process.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the temporary server is Linux's")
def test_a_command_that_fails_before_waiting_for_the_server_stops_it():
    process = _launch_first("fail")
    launched = int(process.stdout.readline())
    assert process.wait(timeout=60) == 2
    deadline = time.monotonic() + 30
    while _running(launched) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(launched), "the server outlived the command"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the temporary server is Linux's")
def test_a_server_launched_before_an_api_url_was_configured_is_stopped_and_the_url_used():
    process = _launch_first("configured")
    try:
        launched = int(process.stdout.readline())
        assert process.stdout.readline().strip() == "http://127.0.0.1:9/api"
        assert not _running(launched) and not _children(process.pid)
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
