"""runtime.concurrency against the session's Prefect server: a second campaign's GPU stages and its generation engine
wait for the first's, and say for what (issue 34)."""

from __future__ import annotations

import contextvars
import logging
import os
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prefect import flow, task

from runtime.concurrency import (
    GPU_TAG,
    device_tags,
    engine_limit,
    engine_slot,
    ensure_gpu_limit,
    gpu_stages,
    held_slot,
)

ROOT = Path(__file__).resolve().parents[2]


def _limit(name: str):
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            return None


def _thread(target) -> threading.Thread:
    """A started thread running ``target`` with this thread's context (the test server's Prefect settings)."""
    thread = threading.Thread(target=contextvars.copy_context().run, args=(target,))
    thread.start()
    return thread


def _wait_until(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.2)


def test_only_stages_on_a_gpu_carry_the_tag():
    assert device_tags("cuda") == (GPU_TAG,) and device_tags("cpu") == ()


def test_serve_sets_the_gpu_tag_limit_to_the_device_count_and_none_without_gpus(prefect_server):
    ensure_gpu_limit(0)
    assert _limit(f"tag:{GPU_TAG}") is None  # a machine without GPUs limits nothing
    ensure_gpu_limit(2)
    assert _limit(f"tag:{GPU_TAG}").limit == 2
    ensure_gpu_limit(1)  # served again on another machine's count: the limit follows it
    assert _limit(f"tag:{GPU_TAG}").limit == 1


def test_a_second_campaigns_gpu_stage_waits_for_the_gpu_and_says_so(prefect_server, caplog):
    """One GPU (limit 1), held by another campaign's stage: this campaign's stage stays Pending until it is free."""
    ensure_gpu_limit(1)
    started: list[datetime] = []

    @task(name="gpu-stage")
    def stage() -> None:
        started.append(datetime.now(UTC))

    @flow(name="second-campaign")
    def second() -> None:
        with gpu_stages("cuda", campaign="second"):
            stage()

    release = threading.Event()
    held = threading.Event()

    def first_campaigns_stage() -> None:
        with held_slot(f"tag:{GPU_TAG}"):
            held.set()
            release.wait(timeout=300)

    holder = _thread(first_campaigns_stage)
    held.wait(timeout=120)
    with caplog.at_level(logging.WARNING, logger="runtime.concurrency"):
        runner = _thread(second)
        _wait_until(lambda: _pending_gpu_task_runs() > 0, "the second campaign's stage waiting in Pending")
        assert started == []
        released = datetime.now(UTC)
        release.set()
        holder.join()
        runner.join(timeout=300)
    assert started and started[0] > released
    assert "campaign second: its GPU stages wait for a free GPU" in caplog.text
    assert f"tag:{GPU_TAG}" in caplog.text


def _pending_gpu_task_runs() -> int:
    from prefect import get_client
    from prefect.client.schemas.filters import (
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
        TaskRunFilterTags,
    )

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            task_run_filter=TaskRunFilter(
                tags=TaskRunFilterTags(all_=[GPU_TAG]),
                state=TaskRunFilterState(type=TaskRunFilterStateType(any_=["PENDING"])),
            )
        )
    return len(runs)


def test_issue33_an_overlapped_iterations_generation_shares_its_campaigns_gpu_with_the_update(prefect_server):
    """One GPU (limit 1): the update, submitted, holds the campaign's slot of the gpu tag; the next iteration's
    generation stages run beside it (:func:`flows.overlap.beside`) without the tag, so they start at once instead of
    waiting for the update's end. Here the update ends only once the generation stage has run."""
    from prefect.runtime import task_run

    from flows.overlap import beside

    ensure_gpu_limit(1)
    order: list[str] = []
    tags: dict[str, list[str]] = {}
    generated = threading.Event()

    @task(name="update")
    def update() -> str:
        tags["update"] = sorted(task_run.tags)
        order.append("update starts")
        generated.wait(timeout=60)  # without the generation stage beside it: a minute, then on
        order.append("update ends")
        return "policy"

    @task(name="rollout")
    def rollout() -> None:
        tags["rollout"] = sorted(task_run.tags)
        order.append("rollout runs")
        generated.set()

    @flow(name="overlapped-campaign")
    def campaign() -> str:
        with gpu_stages("cuda", campaign="overlapped"):
            future = update.submit()
            _wait_until(lambda: order == ["update starts"], "the update holding the GPU")
            return beside(future, rollout)

    assert campaign() == "policy"
    assert order == ["update starts", "rollout runs", "update ends"]
    assert tags == {"update": [GPU_TAG], "rollout": []}


def test_a_second_engine_on_the_machine_waits_for_the_first_and_says_so(prefect_server, caplog):
    order: list[str] = []
    release = threading.Event()
    held = threading.Event()

    def first_command() -> None:
        with engine_slot():
            order.append("first starts its engine")
            held.set()
            release.wait(timeout=300)
            order.append("first stops its engine")

    first = _thread(first_command)
    held.wait(timeout=120)
    with caplog.at_level(logging.WARNING, logger="runtime.concurrency"):

        def second_command() -> None:
            with engine_slot():
                order.append("second starts its engine")

        second = _thread(second_command)
        _wait_until(lambda: "waiting to start the vLLM generation engine" in caplog.text, "the second's message")
        release.set()
        first.join()
        second.join(timeout=300)
    assert order == ["first starts its engine", "first stops its engine", "second starts its engine"]
    assert engine_limit() in caplog.text
    assert _limit(engine_limit()).active_slots == 0  # both released


HOLDER = """
import sys, time
from runtime.concurrency import engine_slot
with engine_slot():
    print("held", flush=True)
    time.sleep(600)
"""


def test_an_engine_slot_whose_holder_was_killed_is_taken_at_once(prefect_server):
    """kill -9 of a command that held the engine's slot: the next command releases the dead holder's lease instead of
    waiting for it to expire, which it never does on a server whose repossessor does not run (the test harness's,
    a command's temporary server). Before, the vLLM suite's resume after kill -9 waited forever."""
    from prefect.settings import PREFECT_API_URL

    from runtime.concurrency import engine_slot_record

    environment = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_API_URL": PREFECT_API_URL.value()}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER], cwd=ROOT, env=environment, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert _limit(engine_limit()).active_slots == 1 and engine_slot_record().is_file()
    finally:
        holder.kill()
        holder.wait()
    started = time.monotonic()
    with engine_slot():
        assert _limit(engine_limit()).active_slots == 1
    assert time.monotonic() - started < 30  # not the 60 s lease, nor forever
    assert _limit(engine_limit()).active_slots == 0 and not engine_slot_record().exists()


@pytest.mark.slow  # a second Prefect server: about 20 s (CI's sharded step)
def test_a_slot_is_taken_and_given_back_on_the_server_of_the_settings_in_force(prefect_server, tmp_path):
    """A process that held a limit's slot on one server, then holds it on another (a test session: an in-process
    command on a temporary server of its own, then the session's server): each slot is taken and given back on its
    own server. Prefect's acquisition service, one per limit name and process, kept the first server: the slot was
    taken there and given back to the second, and the next taker waited for ever (the vLLM suite's hang)."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_DATABASE_CONNECTION_URL, temporary_settings

    from runtime.concurrency import create_limit
    from tests.flows.test_human_label_form_browser import _free_port

    name = f"rlhf-test-two-servers-{os.getpid()}"
    database = f"sqlite+aiosqlite:///{tmp_path / 'first.db'}"
    with temporary_settings(updates={PREFECT_SERVER_DATABASE_CONNECTION_URL: database}):
        first = SubprocessASGIServer(port=_free_port())
        first.start(timeout=180)
    try:
        with temporary_settings(updates={PREFECT_API_URL: first.api_url}):
            create_limit(name, 1)
            with held_slot(name):
                assert _limit(name).active_slots == 1
            assert _limit(name).active_slots == 0
        create_limit(name, 1)  # on the session's server
        taken: list[int] = []

        def take_twice() -> None:
            for _ in range(2):
                with held_slot(name):
                    taken.append(_limit(name).active_slots)

        taker = _thread(take_twice)
        taker.join(timeout=120)
        assert not taker.is_alive(), "the second taker waits for a slot given back to another server"
        assert taken == [1, 1] and _limit(name).active_slots == 0
        with temporary_settings(updates={PREFECT_API_URL: first.api_url}):
            assert _limit(name).active_slots == 0
    finally:
        first.stop()
