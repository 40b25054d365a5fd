"""Issue 33: `execution.torch_threads: auto` is chosen once per campaign and machine from the cores idle *now*, and
two stages that run at once share the count."""

from __future__ import annotations

import json
import os
import socket

import pytest

import runtime.threads as threads
from runtime.threads import busy_between, command_threads, lane_threads


def test_busy_cores_by_hand():
    # Core 0: 100 ticks passed, 20 of them idle: 0.8 busy. Core 1: 100 ticks, 90 idle: 0.1 busy.
    before = {0: (1000, 500), 1: (2000, 1500)}
    after = {0: (1100, 520), 1: (2100, 1590)}
    assert busy_between(before, after, own_seconds=0.0, wall_seconds=1.0) == pytest.approx(0.9)
    # This process used 0.25 s of CPU in those 0.5 s: half a core of the busy 0.9 was its own.
    assert busy_between(before, after, own_seconds=0.25, wall_seconds=0.5) == pytest.approx(0.4)
    assert busy_between(before, after, own_seconds=5.0, wall_seconds=1.0) == 0.0


def test_the_load_average_of_a_command_that_just_ended_does_not_halve_the_next(monkeypatch, tmp_path):
    """2 idle cores after another command: the 1-minute load average still says 1.1 (issue 33), the cores say 0."""
    monkeypatch.setattr(os, "getloadavg", lambda: (1.1, 1.0, 0.9))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "busy_cores", lambda cores: 0.05)
    monkeypatch.setattr(threads, "count_parameters", lambda policy: 134_515_008)  # SmolLM2-135M
    threads._auto_threads.cache_clear()
    assert command_threads("auto", "policy", record=tmp_path / "torch_threads.json") == 2


def test_auto_is_chosen_once_per_campaign_and_machine_whatever_the_load_later(monkeypatch, tmp_path):
    record = tmp_path / "campaign" / "torch_threads.json"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "count_parameters", lambda policy: 134_515_008)
    monkeypatch.setattr(threads, "busy_cores", lambda cores: 0.0)
    threads._auto_threads.cache_clear()
    assert command_threads("auto", "policy", record=record, keep=False) == 2 and not record.exists()  # the engine's
    assert command_threads("auto", "policy", record=record) == 2
    machine = f"{socket.gethostname()} (2 cores)"
    assert json.loads(record.read_text()) == {machine: 2}
    # A later command (a crashed one's rerun) under a load that would give 1: the campaign keeps its 2.
    monkeypatch.setattr(threads, "busy_cores", lambda cores: 1.5)
    threads._auto_threads.cache_clear()
    assert command_threads("auto", "policy", record=record) == 2
    # Another campaign (another record) chooses anew; a number in the config is taken as it is, and recorded nowhere.
    assert command_threads("auto", "policy", record=tmp_path / "other.json") == 1
    assert command_threads(3, "policy", record=tmp_path / "third.json") == 3 and not (tmp_path / "third.json").exists()


@pytest.mark.parametrize(("threads_", "lanes", "each"), [(2, 2, 1), (1, 2, 1), (16, 2, 8), (5, 2, 2)])
def test_two_stages_at_once_share_the_threads(threads_, lanes, each):
    assert lane_threads(threads_, lanes=lanes) == each
