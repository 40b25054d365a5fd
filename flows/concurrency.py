"""Prefect global concurrency limits around the flows: two iterations of one campaign never run at once.

An iteration or replay holds a slot of the Prefect global concurrency limit ``rlhf-campaign-<name>`` (limit 1,
created when missing) beside the campaign's lock file (which only covers one machine, or one shared file system).
Slots are leased: a process that dies without releasing its slot loses it once the lease runs out
(:data:`runtime.concurrency.LEASE_SECONDS`, when the server's repossessor service runs), or at once when the next run
of the campaign finds its lease recorded (:func:`campaign_slot`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from runtime.concurrency import create_limit, held_slot

CAMPAIGN_LIMIT_PREFIX = "rlhf-campaign-"


def campaign_limit(campaign: str) -> str:
    """The name of a campaign's Prefect global concurrency limit."""
    return f"{CAMPAIGN_LIMIT_PREFIX}{campaign}"


@contextmanager
def campaign_slot(campaign: str, record: Path) -> Iterator[None]:
    """Hold the campaign's one slot of its Prefect global concurrency limit (waiting for it), creating the limit.

    Call it holding the campaign's lock file: ``record`` (:meth:`storage.layout.RunLayout.slot_file`) keeps
    the lease of the slot taken under that lock, so a holder killed before releasing its slot (``kill -9``)
    leaves its lease there, and the next holder of the lock, which knows the killed one is gone, releases
    it first instead of waiting for the lease to run out (:func:`runtime.concurrency.held_slot`).
    """
    name = campaign_limit(campaign)
    create_limit(name, 1)
    waiting = (
        f"waiting for campaign {campaign}'s slot (Prefect global concurrency limit {name}): another iteration or "
        f"replay of it runs. If none does (a run killed while a server kept its leases in memory), free the slot: "
        f"prefect global-concurrency-limit update {name} --active-slots 0"
    )
    with held_slot(name, record=record, waiting=waiting, locked=True):
        yield
