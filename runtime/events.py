"""What the pipeline tells as it goes, in one place: the mark a log record carries for the console, and the Prefect
events automations react to.

A log record whose :data:`STAGE_EVENT` attribute is set is an event, not a line of log: ``"started"`` (with
``rlhf_stage``) and ``"finished"`` (with ``rlhf_result``, the :class:`runtime.stage.StageResult`) of a stage,
``"iteration"`` and ``"notice"``; the stage and iteration events also carry their iteration (:data:`ITERATION_EVENT`),
since with ``sampling.staleness`` an iteration's generation stages run while the previous iteration's update does.
:mod:`flows.console` shows these as stages and notices rather than log lines.

Prefect events (what an automation's trigger matches; the names are :data:`EVENTS`' keys):

1. A stage output written is its asset's materialisation (:mod:`runtime.assets`), resource ``rlhf://<campaign>/...``.
2. The others are about a campaign: their resource is ``rlhf.campaign.<name>`` (:func:`campaign_resource`, so a
   trigger matches one campaign, or ``rlhf.campaign.*`` all of them), their related resources the assets they
   concern, and their payload always holds ``campaign`` and ``iteration`` and the digests of the outputs involved.
3. Events are sent only from inside a Prefect run (:func:`send`): elsewhere there is no server to tell, and Prefect
   would start a temporary one for a single event.
4. At least once: a stage recording that an earlier attempt left unfinished is finished by the next, which sends
   its events again (an automation that must act once per policy keys on the payload's ``model_id``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

STAGE_EVENT = "rlhf_stage_event"
"""The log record attribute that marks an event (see the module docstring)."""
ITERATION_EVENT = "rlhf_iteration"
"""The log record attribute of an event that says which iteration it belongs to."""

POLICY_REGISTERED = "rlhf.policy.registered"
ITERATION_EVALUATED = "rlhf.iteration.evaluated"
CAMPAIGN_FAILED = "rlhf.campaign.failed"
EVENTS = {
    POLICY_REGISTERED: "a PPO update's actor was registered as a new version of `<campaign>-actor`",
    "rlhf.critic.registered": "its critic, as a version of `<campaign>-critic`",
    "rlhf.reward-model.registered": "a trained reward model, as a version of `<campaign>-reward-model`",
    ITERATION_EVALUATED: "an iteration's (or replay's) evaluation was recorded, with the model it evaluated",
    CAMPAIGN_FAILED: "an iteration or replay stopped on an error",
}
"""Every event the pipeline sends besides the asset events, and when (docs/operating.md lists them too)."""


def registered_event(suffix: str) -> str:
    """The event of a model registered as ``<campaign>-<suffix>`` (``actor`` is the policy)."""
    return POLICY_REGISTERED if suffix == "actor" else f"rlhf.{suffix}.registered"


def campaign_resource(campaign: str) -> dict[str, str]:
    """The Prefect resource a campaign's events are about."""
    return {"prefect.resource.id": f"rlhf.campaign.{campaign}", "prefect.resource.name": campaign}


def in_prefect_run() -> bool:
    """Whether this code runs inside a Prefect flow or task run."""
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def send(
    event: str,
    resource: dict[str, str],
    *,
    related: Iterable[dict[str, str]] = (),
    payload: dict[str, Any] | None = None,
) -> None:
    """Send a Prefect event, from inside a Prefect run only (see the module docstring). Prefect adds the run, its
    flow and deployment as related resources."""
    from prefect.events import emit_event

    if in_prefect_run():
        emit_event(event, resource=resource, related=list(related), payload=payload)


def send_campaign_event(event: str, campaign: str, payload: dict[str, Any], *, assets: Iterable[str] = ()) -> None:
    """Send one of :data:`EVENTS` about ``campaign`` (``payload`` gets its name), related to the asset keys
    ``assets``."""
    related = [{"prefect.resource.id": key, "prefect.resource.role": "asset"} for key in assets]
    send(event, campaign_resource(campaign), related=related, payload={"campaign": campaign, **payload})


@contextmanager
def announces_failure(campaign: str, payload: dict[str, Any]) -> Iterator[None]:
    """Send :data:`CAMPAIGN_FAILED` (``payload`` plus the error's type and message) if the block raises, then let the
    error go on: what an automation that pauses a diverging campaign's schedule reacts to."""
    try:
        yield
    except BaseException as error:
        failure = {"error": type(error).__name__, "message": str(error).splitlines()[0] if str(error) else ""}
        send_campaign_event(CAMPAIGN_FAILED, campaign, {**payload, **failure})
        raise
