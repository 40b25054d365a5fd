"""Every Prefect API this project uses that Prefect does not publish, in one place, each with why and the public
way it would take if Prefect had one (issue 42). ``tests/runtime/test_prefect_internals.py`` checks each against the
installed Prefect, so an upgrade that changes one fails there, by name, rather than in a campaign.

1. Concurrency slots on a lease whose id the holder keeps (:mod:`runtime.concurrency`): the public
   ``prefect.concurrency.sync.concurrency`` holds a leased slot but does not say its lease, and a command must record
   it so that the next command can release the slot of one killed with ``kill -9`` (a temporary server runs no lease
   repossessor). Prefect's own ``concurrency`` is built on these three functions.
2. Stages run without one of the tags around them (:func:`without_tags`): ``prefect.tags`` only adds tags. This
   enters a new ``TagsContext``, as ``prefect.tags`` does, holding fewer.
3. A deployment's parameter schema with bounds and hidden fields (:mod:`flows.serve`): ``Flow.to_deployment`` derives
   it from the flow's signature and takes no schema; ``RunnerDeployment`` keeps it in a private attribute.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any
from uuid import UUID


def acquire_slot_lease(name: str, *, lease_seconds: float) -> UUID:
    """Take one slot of the global concurrency limit ``name``, waiting while it is full; the lease's id (choice 1)."""
    from prefect.concurrency._sync import acquire_concurrency_slots_with_lease

    return acquire_concurrency_slots_with_lease([name], 1, lease_duration=lease_seconds, strict=True).lease_id


def renewing_lease(lease: UUID, *, lease_seconds: float) -> AbstractContextManager[None]:
    """Renew ``lease`` in the background while the block runs (choice 1); a renewal that fails is logged."""
    from prefect.concurrency._sync import maintain_concurrency_lease

    return maintain_concurrency_lease(lease, lease_seconds, raise_on_lease_renewal_failure=False)


def release_slot_lease(lease: UUID) -> None:
    """Give back the slot ``lease`` holds (choice 1)."""
    from prefect.concurrency._sync import release_concurrency_slots_with_lease

    release_concurrency_slots_with_lease(lease)


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
