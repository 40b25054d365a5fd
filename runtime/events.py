"""What the pipeline tells as it goes, in one place: the mark a log record carries for the console.

A log record whose :data:`STAGE_EVENT` attribute is set is an event, not a line of log: ``"started"`` (with
``rlhf_stage``) and ``"finished"`` (with ``rlhf_result``, the :class:`runtime.stage.StageResult`) of a stage,
``"iteration"`` and ``"notice"``; the stage and iteration events also carry their iteration (:data:`ITERATION_EVENT`),
since with ``sampling.staleness`` an iteration's generation stages run while the previous iteration's update does.
:mod:`flows.console` shows these as stages and notices rather than log lines.
"""

from __future__ import annotations

STAGE_EVENT = "rlhf_stage_event"
"""The log record attribute that marks an event (see the module docstring)."""
ITERATION_EVENT = "rlhf_iteration"
"""The log record attribute of an event that says which iteration it belongs to."""
