"""Prefect global concurrency limits around the flows: two iterations of one campaign never run at once.

An iteration or replay holds a slot of the Prefect global concurrency limit ``rlhf-campaign-<name>`` (limit 1,
created when missing) beside the campaign's lock file (which only covers one machine, or one shared file system).
Slots are leased: a process that dies without releasing its slot loses it once the lease runs out
(:data:`runtime.concurrency.LEASE_SECONDS`, when the server's repossessor service runs), or at once when the next run of the campaign
on the same machine finds its lease recorded (:func:`campaign_slot`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from uuid import UUID

from runtime.concurrency import LEASE_SECONDS, create_limit, limit_full

logger = logging.getLogger(__name__)

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
    it first instead of waiting for the lease to run out.
    """
    from prefect.concurrency._sync import (
        acquire_concurrency_slots_with_lease,
        maintain_concurrency_lease,
        release_concurrency_slots_with_lease,
    )

    name = campaign_limit(campaign)
    create_limit(name, 1)
    if record.is_file():
        with contextlib.suppress(Exception):  # already released, or expired and revoked by the server
            release_concurrency_slots_with_lease(UUID(record.read_text().strip()))
            logger.info("released the campaign slot of a run that stopped without releasing it")
        record.unlink()
    if limit_full(name):
        logger.warning(
            "waiting for campaign %s's slot (Prefect global concurrency limit %s): another iteration or replay of "
            "it runs. If none does (a run killed while a server kept its leases in memory), free the slot: "
            "prefect global-concurrency-limit update %s --active-slots 0",
            campaign, name, name,
        )  # fmt: skip
    lease = acquire_concurrency_slots_with_lease([name], 1, lease_duration=LEASE_SECONDS, strict=True).lease_id
    record.write_text(f"{lease}\n")
    try:
        with maintain_concurrency_lease(lease, LEASE_SECONDS, raise_on_lease_renewal_failure=False):
            yield
    finally:
        try:
            release_concurrency_slots_with_lease(lease)
        finally:  # a release that fails (the server is gone, Ctrl-C) leaves a lease that expires on its own
            record.unlink(missing_ok=True)
