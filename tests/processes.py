"""What the tests ask of a process by its pid, from /proc."""

from __future__ import annotations

from pathlib import Path


def running(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is not a zombie (ended, not yet reaped by its parent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
