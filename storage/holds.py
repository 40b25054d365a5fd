"""Named points where a process can be held, so that a crash test kills it at an exact moment, not after a sleep.

A point is ``<stage>:<window>``, one of three windows in the life of a stage output:

* ``computing``: the stage's work is done (or a training stage has saved its first mid-stage
  checkpoint) but nothing is published under the output's real name;
* ``output``: the output folder has just appeared and nothing is recorded in MLflow;
* ``recording``: the stage's MLflow run holds its artifacts but is neither finished nor registered.

The ``rlhf`` command arms at most one point, from the environment (``RLHF_HOLD_AT`` and
``RLHF_HOLD_FILE``); nothing else does. With no point armed, :func:`hold` returns at once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

WINDOWS = ("computing", "output", "recording")

_armed: tuple[str, Path] | None = None


def arm(point: str, signal_file: Path) -> None:
    """Hold the process forever at ``point``, after writing its pid to ``signal_file``.

    Raises:
        ValueError: ``point`` is not ``<stage>:<window>`` with a window of :data:`WINDOWS`.
    """
    global _armed
    stage, _, window = point.partition(":")
    if not stage or window not in WINDOWS:
        raise ValueError(f"a hold point is `<stage>:<window>` with a window of {WINDOWS}, got {point!r}")
    _armed = (point, Path(signal_file))


def hold(stage: str, window: str) -> None:
    """Block here forever if ``<stage>:<window>`` is the armed point (a test then kills the process)."""
    if _armed is None or _armed[0] != f"{stage}:{window}":
        return
    _armed[1].write_text(f"{os.getpid()}\n")
    while True:
        time.sleep(0.1)  # in short steps, so Ctrl-C (SIGINT) still interrupts the process here
