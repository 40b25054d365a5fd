"""Every Prefect API this project uses that Prefect does not publish, in one place, each with why and the public
way it would take if Prefect had one (issue 42). ``tests/runtime/test_prefect_internals.py`` checks each against the
installed Prefect, so an upgrade that changes one fails there, by name, rather than in a campaign.

1. Concurrency slots on a lease whose id the holder keeps (:mod:`runtime.concurrency`): the public
   ``prefect.concurrency.sync.concurrency`` holds a leased slot but does not say its lease, and a command must record
   it so that the next command can release the slot of one killed with ``kill -9`` (a temporary server runs no lease
   repossessor). The slot is taken and given back through a client of the settings in force where it is asked for
   (the client's public lease requests), the lease renewed by Prefect's own ``maintain_concurrency_lease``. Prefect's
   own acquisition goes through one service per limit name and process whose client keeps the server of its first
   use: a process that then talks to another server (a test session: each in-process command on a server of its
   own, then the session's) took its slot on the first server, released it on the second, and the next taker waited
   for ever.
2. Stages run without one of the tags around them (:func:`without_tags`): ``prefect.tags`` only adds tags. This
   enters a new ``TagsContext``, as ``prefect.tags`` does, holding fewer.
3. A deployment's parameter schema with bounds and hidden fields (:mod:`flows.serve`): ``Flow.to_deployment`` derives
   it from the flow's signature and takes no schema; ``RunnerDeployment`` keeps it in a private attribute.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any
from uuid import UUID

import httpx


def acquire_slot_lease(name: str, *, lease_seconds: float) -> UUID:
    """Take one slot of the global concurrency limit ``name`` on the server of the settings in force, waiting while
    it is full (as long as the server's ``Retry-After`` says each time); the lease's id (choice 1).

    Raises:
        LookupError: the limit does not exist.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.responses import ConcurrencyLimitWithLeaseResponse

    with get_client(sync_client=True) as client:
        while True:
            try:
                response = client.increment_concurrency_slots_with_lease(
                    names=[name], slots=1, mode="concurrency", lease_duration=lease_seconds
                )
            except httpx.HTTPStatusError as error:
                if error.response.status_code != httpx.codes.LOCKED:
                    raise
                time.sleep(float(error.response.headers.get("Retry-After", 1.0)))
                continue
            granted = ConcurrencyLimitWithLeaseResponse.model_validate(response.json())
            if not granted.limits:
                raise LookupError(f"the Prefect concurrency limit {name} does not exist")
            return granted.lease_id


def renewing_lease(lease: UUID, *, lease_seconds: float) -> AbstractContextManager[None]:
    """Renew ``lease`` in the background while the block runs (choice 1); a renewal that fails is logged."""
    from prefect.concurrency._sync import maintain_concurrency_lease

    return maintain_concurrency_lease(lease, lease_seconds, raise_on_lease_renewal_failure=False)


def release_slot_lease(lease: UUID) -> None:
    """Give back the slot ``lease`` holds, on the server of the settings in force (choice 1): the server it was taken
    on (a lease the server does not know is ignored there)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.release_concurrency_slots_with_lease(lease_id=lease)


@contextmanager
def without_tags(*names: str) -> Iterator[None]:
    """Run the block's tasks without the tags ``names`` that the blocks around it gave them (choice 2)."""
    from prefect.context import TagsContext

    with TagsContext(current_tags=TagsContext.get().current_tags - set(names)):
        yield


def parameter_schema(deployment: Any) -> dict[str, Any]:
    """The OpenAPI schema of ``deployment``'s parameters, as a dict (choice 3)."""
    return deployment._parameter_openapi_schema.model_dump()


def set_parameter_schema(deployment: Any, schema: dict[str, Any]) -> None:
    """Give ``deployment`` the parameter schema ``schema`` (choice 3)."""
    current = deployment._parameter_openapi_schema
    deployment._parameter_openapi_schema = type(current).model_validate(schema)
