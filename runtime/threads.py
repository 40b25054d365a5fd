"""How many torch threads a command's stages run on (``execution.torch_threads``).

Choices:
1. ``auto`` is chosen once per campaign and machine, the first time the campaign runs there, and recorded in the
   campaign's folder (``torch_threads.json``, by host name and usable cores): every later command of the campaign on
   that machine, a crashed one's rerun included, runs on the same count whatever the load then, so its stages round
   floats alike. Another count is a number in the config (or the record deleted).
2. What ``auto`` leaves out is the cores other processes keep busy *now*, sampled from ``/proc/stat`` over
   :data:`SAMPLE_SECONDS` (:func:`busy_cores`), not the 1-minute load average: that average still counts a command
   that ended seconds ago (load 1.1 after one had finished on 2 cores), so a command started right after another ran
   on half the threads.
3. Stages that run two at a time (``sampling.staleness`` >= 1: an iteration's generation stages beside the previous
   iteration's update) each get half the count, at least one (:func:`lane_threads`). Every stage of the two lanes
   gets that count whether or not the other lane runs at that moment, so no output depends on how they overlapped.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from pathlib import Path

from rlhf_core.loading import count_parameters
from rlhf_core.precision import resolve_threads
from storage.files import write_text_replacing

SAMPLE_SECONDS = 0.5
"""How long :func:`busy_cores` watches the cores: long enough for a busy core's share to show (the kernel counts in
10 ms ticks), short beside a command's start."""


def command_threads(choice: int | str, policy: str | Path, *, record: Path | None = None, keep: bool = True) -> int:
    """The torch threads ``execution.torch_threads`` (``choice``) gives the policy in the folder ``policy`` on this
    machine (:func:`rlhf_core.precision.resolve_threads`); ``auto`` is read from ``record`` (the campaign's
    :meth:`storage.layout.RunLayout.threads_file`) when it holds this machine's, else chosen now (once per process)
    and, with ``keep``, written there (choice 1). Without ``keep`` nothing is written: a command refused before its
    stages run (an engine that does not start) leaves no file behind."""
    if choice != "auto":
        return resolve_threads(choice, parameters=0, cores=1)
    machine = f"{socket.gethostname()} ({len(os.sched_getaffinity(0))} cores)"
    recorded = json.loads(record.read_text()) if record is not None and record.is_file() else {}
    if machine not in recorded:
        recorded[machine] = _auto_threads(str(policy))
        if record is not None and keep:
            record.parent.mkdir(parents=True, exist_ok=True)
            write_text_replacing(record, json.dumps(recorded, indent=2, sort_keys=True) + "\n")
    return int(recorded[machine])


@functools.cache
def _auto_threads(policy: str) -> int:
    """``auto`` for ``policy`` on this machine now, once per process: the command's engine and stages agree."""
    cores = os.sched_getaffinity(0)
    return resolve_threads("auto", parameters=count_parameters(policy), cores=len(cores), load=busy_cores(cores))


def lane_threads(threads: int, *, lanes: int) -> int:
    """The threads of each of ``lanes`` stages running at once on a command's ``threads`` (choice 3)."""
    return max(1, threads // lanes)


def busy_cores(cores: set[int], *, seconds: float = SAMPLE_SECONDS) -> float:
    """How many of ``cores`` other processes keep busy now (choice 2): each core's busy share over ``seconds``,
    summed, less this process's own use; the 1-minute load average where ``/proc/stat`` cannot be read."""
    try:
        before, own_before, started = _core_ticks(cores), sum(os.times()[:2]), time.monotonic()
        time.sleep(seconds)
        after, own_after, ended = _core_ticks(cores), sum(os.times()[:2]), time.monotonic()
    except OSError:
        return os.getloadavg()[0]
    return busy_between(before, after, own_seconds=own_after - own_before, wall_seconds=ended - started)


def busy_between(
    before: dict[int, tuple[int, int]],
    after: dict[int, tuple[int, int]],
    *,
    own_seconds: float,
    wall_seconds: float,
) -> float:
    """Busy cores between two ``{core: (all ticks, idle ticks)}`` samples: each core's busy ticks over its ticks,
    summed, less ``own_seconds`` of CPU this process used in ``wall_seconds``; at least 0."""
    busy = 0.0
    for core, (total, idle) in after.items():
        elapsed = total - before[core][0]
        if elapsed > 0:
            busy += (elapsed - (idle - before[core][1])) / elapsed
    return max(0.0, busy - own_seconds / max(wall_seconds, 1e-9))


def _core_ticks(cores: set[int]) -> dict[int, tuple[int, int]]:
    """``{core: (all ticks, idle ticks)}`` of ``cores`` from ``/proc/stat`` (idle counts iowait: a core waiting on
    the disk is free to compute)."""
    ticks = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            counts = [int(value) for value in values[:8]]  # user nice system idle iowait irq softirq steal
            ticks[int(name[3:])] = (sum(counts), counts[3] + counts[4])
    return ticks
