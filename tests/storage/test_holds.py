"""Hold points (storage.holds): the n-th arrival at a point holds, and several points can be armed at once."""

from __future__ import annotations

import threading
import time

import pytest

import storage.holds as holds


@pytest.fixture(autouse=True)
def _disarmed():
    yield
    holds._armed = None
    holds._reached.clear()


def test_issue33_the_second_arrival_holds_and_writes_its_point_and_pid(tmp_path):
    signal_file = tmp_path / "held"
    holds.arm("rollout:computing#2,ppo_update:output", signal_file)
    holds.hold("rollout", "computing")  # the first rollout goes on
    holds.hold("rollout", "output")  # not armed
    assert not signal_file.exists()
    second = threading.Thread(target=holds.hold, args=("rollout", "computing"), daemon=True)
    second.start()
    deadline = time.monotonic() + 10
    while not signal_file.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert signal_file.read_text().split()[0] == "rollout:computing#2"
    assert second.is_alive(), "held"


@pytest.mark.parametrize("point", ["rollout", "rollout:done", "rollout:output#0", "rollout:output#x"])
def test_a_point_that_is_not_a_stage_window_and_arrival_is_refused(point, tmp_path):
    with pytest.raises(ValueError, match="a hold point is"):
        holds.arm(point, tmp_path / "held")
