"""Prefect concurrency limits that keep campaigns off each other's accelerators: the ``gpu`` tag and the generation
engine's slot (a campaign's own slot, two iterations of one campaign never at once, is :mod:`flows.concurrency`'s).

Choices:

1. The stages of an iteration that runs on a GPU carry the Prefect task tag :data:`GPU_TAG` (:func:`gpu_stages`),
   but for the generation stages an overlapped iteration runs beside its update, which holds the campaign's GPU
   (:func:`sharing_the_gpu`).
   ``rlhf serve`` sets the tag's concurrency limit to the number of GPUs the machine has (:func:`ensure_gpu_limit`),
   so a second campaign's GPU stages wait (Pending, in the Prefect UI) until one is free. Prefect 3.8 keeps a tag's
   limit as the global concurrency limit ``tag:gpu``; without a limit the tag limits nothing.
2. A vLLM generation engine this process starts holds the one slot of the global limit ``rlhf-engine-<host>`` for as
   long as it runs (:func:`engine_slot`): an engine keeps its share of GPU memory between stages, so a second
   command on the machine waits for the slot before it starts its own.
3. Whoever waits says for what, once, before it waits (:func:`announce_wait`): Prefect's own waits are silent.
4. Slots are leased: a holder that dies loses its slot when the lease runs out, where the server's repossessor runs.
   A temporary server's does not (nor Prefect's test harness's), so each holder also records its lease and its
   process (:func:`held_slot`'s ``record``), and the next taker releases the lease of a holder that no longer runs.
5. Without a Prefect server configured (a benchmark script starting an engine) no slot is taken: Prefect would start
   a temporary server that no other process sees.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from uuid import UUID

from runtime.prefect_internals import acquire_slot_lease, release_slot_lease, renewing_lease, without_tags
from storage.files import temporary_sibling
from storage.tracking import process_token, writer_alive

logger = logging.getLogger(__name__)

GPU_TAG = "gpu"
ENGINE_LIMIT_PREFIX = "rlhf-engine-"
LEASE_SECONDS = 60.0
"""How long the slot of a process that died stays taken (a live holder renews its lease in the background)."""


def create_limit(name: str, slots: int) -> None:
    """Create the global concurrency limit ``name`` with ``slots`` slots, unless it exists (then it is left as set)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):  # another process created it first
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))


def limit_full(name: str) -> bool:
    """Whether the global concurrency limit ``name`` exists and has no free slot now (a taker would wait)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            return False
    return limit.active and limit.active_slots >= limit.limit


def announce_wait(name: str, message: str) -> None:
    """Log ``message`` (what waits, and for what) when the limit ``name`` is full: Prefect waits without a word."""
    if limit_full(name):
        logger.warning("%s (Prefect concurrency limit %s; the Prefect UI's Concurrency page shows it)", message, name)


@contextmanager
def held_slot(
    name: str, *, record: Path | None = None, waiting: str | None = None, locked: bool = False
) -> Iterator[str]:
    """Hold one slot of the global limit ``name`` (waiting for it, saying ``waiting`` first when it must) for the
    block, on a lease renewed in the background; the lease id.

    With ``record`` (choice 4), the holder writes its lease and its process there while it holds the slot, and first
    releases the lease a holder that died without releasing it left there (:func:`release_dead_holder`); ``locked``:
    the caller holds a lock every holder of the slot takes first, so the recorded holder is gone, on any machine.
    """
    if record is not None:
        release_dead_holder(record, gone=locked)
    if waiting is not None:
        announce_wait(name, waiting)
    lease = acquire_slot_lease(name, lease_seconds=LEASE_SECONDS)
    if record is not None:
        _write_record(record, str(lease))
    try:
        with renewing_lease(lease, lease_seconds=LEASE_SECONDS):
            yield str(lease)
    finally:
        try:
            release_slot_lease(lease)
        except Exception as error:  # the server is gone (Ctrl-C at exit), or did not answer in time
            # The record stays: the next holder releases the lease (a server that expires none would keep it).
            logger.warning("could not release the slot lease %s of %s (%s)", lease, name, error)
        else:
            if record is not None and _recorded(record) == (str(lease), process_token()):
                record.unlink(missing_ok=True)


def release_dead_holder(record: Path, *, gone: bool = False) -> None:
    """Release the slot lease ``record`` names if the process that took it no longer runs (``kill -9``), or is known
    to be ``gone``: a server whose lease repossessor does not run (a temporary server, Prefect's test harness) never
    expires it, and the next taker would wait forever. A record naming no process (by an earlier release) counts
    as gone."""
    recorded = _recorded(record)
    if recorded is None:
        return
    lease, holder = recorded
    if not gone and holder is not None and writer_alive(holder):
        return
    with contextlib.suppress(Exception):  # already released, or expired and revoked by the server
        release_slot_lease(UUID(lease))
        logger.info("released the slot %s of a process that stopped without releasing it", record.stem)
    record.unlink(missing_ok=True)


def _recorded(record: Path) -> tuple[str, str | None] | None:
    """The lease and holder ``record`` names (the holder None in a record of a bare lease id), None without one."""
    try:
        text = record.read_text().strip()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text, None
    return (str(data["lease"]), str(data["holder"])) if isinstance(data, dict) else (text, None)


def _write_record(record: Path, lease: str) -> None:
    temporary = temporary_sibling(record)
    temporary.write_text(json.dumps({"lease": lease, "holder": process_token()}) + "\n")
    os.replace(temporary, record)


def prefect_server_configured() -> bool:
    """Whether a Prefect server is configured (``PREFECT_API_URL``), one other processes share."""
    from prefect.settings import get_current_settings

    return bool(get_current_settings().api.url)


def engine_limit() -> str:
    """The global concurrency limit of this machine's generation engine."""
    return f"{ENGINE_LIMIT_PREFIX}{socket.gethostname()}"


def engine_slot_record() -> Path:
    """Where the holder of this machine's engine slot records its lease: in ``PREFECT_HOME``, where a command's
    temporary Prefect server keeps its database (each on a port of its own: the server's address would not find a
    killed command's record), and which every command of one user's Prefect profile shares (two test sessions have
    their own)."""
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home) / f"{engine_limit()}.lease"


@contextmanager
def engine_slot() -> Iterator[None]:
    """Hold this machine's generation-engine slot (see the module docstring), saying so when it has to wait; nothing
    without a Prefect server configured."""
    if not prefect_server_configured():
        yield
        return
    name = engine_limit()
    create_limit(name, 1)
    waiting = (
        "waiting to start the vLLM generation engine: another command on this machine runs one (one engine per "
        "machine); it frees its slot when that command ends"
    )
    with held_slot(name, record=engine_slot_record(), waiting=waiting):
        yield


def device_tags(device_type: str) -> tuple[str, ...]:
    """The Prefect tags of stages that run on a device of this type (``cuda`` or ``cpu``)."""
    return (GPU_TAG,) if device_type == "cuda" else ()


def ensure_gpu_limit(devices: int) -> None:
    """Set the ``gpu`` tag's concurrency limit to ``devices`` (at least one stage per GPU at once); nothing on a
    machine without GPUs."""
    from prefect.client.orchestration import get_client

    if devices < 1:
        return
    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag=GPU_TAG, concurrency_limit=devices)  # an upsert of `tag:gpu`
    logger.info("GPU stages: at most %d at once on this Prefect server (tag concurrency limit `%s`)", devices, GPU_TAG)


@contextmanager
def gpu_stages(device_type: str, *, campaign: str) -> Iterator[None]:
    """Tag the tasks the block runs with :func:`device_tags` (stages on a GPU wait for a free one, see the module
    docstring), saying so first when every GPU is taken."""
    from prefect import tags

    names = device_tags(device_type)
    if names:
        announce_wait(
            f"tag:{GPU_TAG}", f"campaign {campaign}: its GPU stages wait for a free GPU, all are in use by other runs"
        )
    with tags(*names):
        yield


@contextmanager
def sharing_the_gpu() -> Iterator[None]:
    """Run the block's stages without the :data:`GPU_TAG` of :func:`gpu_stages`: they share the GPU whose slot a
    stage of the same campaign running meanwhile holds (an overlapped iteration's generation stages beside its
    update, :mod:`flows.overlap`). With the tag they would wait for that stage's end, and overlap nothing."""
    with without_tags(GPU_TAG):
        yield
