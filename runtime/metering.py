"""What a stage costs: its wall time and peak memory, recorded with its output, and the pace of its mid-stage saves.

Every stage records ``seconds`` and ``peak_memory_mb`` (the growth of the process's resident memory on CPU,
``max_memory_allocated`` on CUDA) as metrics; a stage that launches training processes also records each one's peak
(``peak_memory_mb_rank<r>``), and ``peak_memory_mb`` is the largest.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


def release_memory() -> None:
    """Give the CUDA cache of a finished stage's models back before the next stage starts.

    The models themselves are freed by reference counting when the stage function returns (nothing
    keeps them in a cycle; ``tests/tasks/test_stage.py`` checks it), so no ``gc.collect()`` is
    needed: it would cost about 0.3 s per stage with torch, Prefect and MLflow loaded. The frozen
    models the process keeps for later stages (:data:`runtime.models.PROCESS_FROZEN_MODELS`) stay.
    """
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


_STATUS_FIELD = re.compile(r"^(VmHWM|VmRSS):\s+(\d+) kB$", re.MULTILINE)


def _memory_status() -> dict[str, int] | None:
    """VmHWM and VmRSS of this process in kB, or None where /proc is unavailable."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    return {name: int(value) for name, value in _STATUS_FIELD.findall(text)}


PEAKS = "peak_memory_mb_per_process"
"""Where a launched training job's processes report their peak memory (MiB, by rank) in the output's runtime."""


def peak_metrics(own: float, processes: list[float]) -> dict[str, float]:
    """``peak_memory_mb``: the largest of this process's peak and those of the training processes it launched
    (each also as ``peak_memory_mb_rank<r>``)."""
    ranks = {f"peak_memory_mb_rank{rank}": peak for rank, peak in enumerate(processes)}
    return {"peak_memory_mb": max([own, *processes]), **ranks}


@contextmanager
def peak_memory(device: torch.device) -> Iterator[Callable[[], float]]:
    """Yield a function giving the block's peak memory so far, in MiB.

    CUDA: ``max_memory_allocated`` since the block began (frozen models kept from earlier stages
    included). CPU: the growth of the resident set's
    high-water mark over the resident set at the start (Linux resets the mark through
    ``/proc/self/clear_refs``); 0 where the system offers neither.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield lambda: torch.cuda.max_memory_allocated(device) / 2**20
        return
    start = _memory_status()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        start = None
    if start is None:
        yield lambda: 0.0
        return
    baseline = start.get("VmRSS", 0)

    def peak() -> float:
        now = _memory_status() or {}
        return max(now.get("VmHWM", baseline) - baseline, 0) / 1024

    yield peak


class Throttle:
    """``due()`` is True at most once per ``seconds`` (every time for 0): paces mid-stage saves."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.last = time.monotonic()

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.seconds:
            return False
        self.last = now
        return True
