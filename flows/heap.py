"""The process's long-lived objects, kept out of Python's full garbage collections.

A flow process holds about a million objects that live as long as it does (the modules of torch, transformers,
Prefect and MLflow, the Prefect client, the MLflow store). Python's cyclic collector walks every one of them in
each full (generation-2) collection: about 0.5 s on this machine, one every two or three iterations, and three
in a process's first iteration. After the first iteration, :func:`freeze_long_lived` collects once and moves
every surviving object to the permanent generation (:func:`gc.freeze`), so later full collections walk only what
later iterations create (0.02 s; ``bench/RESULTS.md``, section 3).

Frozen objects are still freed by reference counting; only a reference cycle among them that becomes garbage
later stays in memory. Freezing happens once per process, so that cost is bounded: a long-lived ``rlhf serve``
process does not freeze each run's leftovers.
"""

from __future__ import annotations

import gc


def freeze_long_lived() -> None:
    """Collect, then freeze every object alive, unless this process has frozen objects already."""
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()
