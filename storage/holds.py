"""Named points where a process can be held, so that a crash test kills it at an exact moment, not after a sleep.

A point is ``<stage>:<window>``, one of four windows in the life of a stage output:

* ``shard``: a fan-out stage has just written one shard's piece (:mod:`runtime.fanout`), its next shards to come;

* ``computing``: the stage's work is done (or a training stage has saved its first mid-stage
  checkpoint) but nothing is published under the output's real name;
* ``output``: the output folder has just appeared and nothing is recorded in MLflow;
* ``recording``: the stage's MLflow run holds its artifacts but is neither finished nor registered.

``<stage>:<window>#<n>`` is the n-th time a process reaches that point (``#1`` when left out): with
``sampling.staleness`` a process runs an iteration's generation stages ahead while the previous update runs, so the
second ``rollout:computing`` is the next iteration's.

The ``rlhf`` command, and the training processes it launches, arm points from the environment (``RLHF_HOLD_AT``,
comma-separated, and ``RLHF_HOLD_FILE``; :func:`arm_from_environment`); nothing else does. With no point armed,
:func:`hold` returns at once. A held process appends ``<point> <pid>`` to the file, so a test holding two processes
(the flow's and a training process) waits for both lines.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path

WINDOWS = ("shard", "computing", "output", "recording")

_armed: tuple[frozenset[str], Path] | None = None
_reached: Counter[str] = Counter()
_lock = threading.Lock()


def arm(points: str, signal_file: Path) -> None:
    """Hold the process forever at each of ``points`` (comma-separated), after appending it and the pid to
    ``signal_file``.

    Raises:
        ValueError: a point is not ``<stage>:<window>[#<n>]`` with a window of :data:`WINDOWS` and n >= 1.
    """
    global _armed
    parsed = set()
    for point in points.split(","):
        name, _, count = point.partition("#")
        stage, _, window = name.partition(":")
        if not stage or window not in WINDOWS or not (count or "1").isdigit() or int(count or "1") < 1:
            raise ValueError(f"a hold point is `<stage>:<window>[#<n>]` with a window of {WINDOWS}, got {point!r}")
        parsed.add(f"{name}#{int(count or '1')}")
    _armed = (frozenset(parsed), Path(signal_file))


def arm_from_environment() -> None:
    """Arm the points ``RLHF_HOLD_AT`` names, if any (crash tests only)."""
    if points := os.environ.get("RLHF_HOLD_AT"):
        arm(points, Path(os.environ["RLHF_HOLD_FILE"]))


def hold(stage: str, window: str) -> None:
    """Block here forever if this is an armed point's n-th arrival (a test then kills the process)."""
    if _armed is None:
        return
    with _lock:
        _reached[f"{stage}:{window}"] += 1
        point = f"{stage}:{window}#{_reached[f'{stage}:{window}']}"
        if point not in _armed[0]:
            return
        with open(_armed[1], "a") as signal_file:
            signal_file.write(f"{point} {os.getpid()}\n")
    while True:
        time.sleep(0.1)  # in short steps, so Ctrl-C (SIGINT) still interrupts the process here
