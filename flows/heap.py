"""The process's long-lived objects, kept out of Python's full garbage collections.

A flow process holds about a million objects that live as long as it does (the modules of torch, transformers,
Prefect and MLflow, the Prefect client, the MLflow store). Python's cyclic collector walks every one of them in
each full (generation-2) collection: about 0.5 s on this machine, one every two or three iterations, and three
in a process's first iteration. When a process starts its second iteration, :func:`iteration_starting` collects
once and moves every surviving object to the permanent generation (:func:`gc.freeze`), so later full collections
walk only what later iterations create (0.02 s; ``bench/NOTES.md``, issue 13). A process that runs one iteration
(``rlhf iterate``, a flow run of ``rlhf serve``) pays for no collection.

Frozen objects are still freed by reference counting; only a reference cycle among them that becomes garbage
later stays in memory. Freezing happens once per process, between iterations (no stage holds a model then), so
that cost is bounded.
"""

from __future__ import annotations

import gc

_iterations_started = 0


def iteration_starting() -> None:
    """Count an iteration starting in this process; at the second, collect, then freeze every object alive
    (unless something in this process froze objects already)."""
    global _iterations_started
    _iterations_started += 1
    if _iterations_started == 2 and gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()
