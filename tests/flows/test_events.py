"""runtime.events: the Prefect events the pipeline sends, as the session's Prefect server receives them."""

from __future__ import annotations

import pytest
from prefect import flow

from runtime.events import (
    CAMPAIGN_FAILED,
    EVENTS,
    POLICY_REGISTERED,
    announces_failure,
    campaign_resource,
    registered_event,
    send_campaign_event,
)
from tests.flows.conftest import prefect_events


def test_every_registered_model_has_its_event_and_the_policy_is_the_actor():
    assert registered_event("actor") == POLICY_REGISTERED == "rlhf.policy.registered"
    assert {registered_event(suffix) for suffix in ("actor", "critic", "reward-model")} < set(EVENTS)
    assert campaign_resource("demo") == {"prefect.resource.id": "rlhf.campaign.demo", "prefect.resource.name": "demo"}


def test_an_iteration_that_stops_on_an_error_says_so_and_the_error_goes_on(prefect_server):
    """What an automation that pauses a diverging campaign's schedule matches: the campaign, the run and the error."""

    @flow(name="failing-iteration")
    def failing() -> None:
        with announces_failure("events-test", {"iteration": 3, "policy_digest": "ab" * 32}):
            raise ValueError("ppo_update, iteration 3: the actor diverged\nmore detail")

    with pytest.raises(ValueError, match="diverged"):
        failing()
    (event,) = prefect_events(CAMPAIGN_FAILED, resource_prefix="rlhf.campaign.events-test")
    assert event.payload == {
        "campaign": "events-test",
        "iteration": 3,
        "policy_digest": "ab" * 32,
        "error": "ValueError",
        "message": "ppo_update, iteration 3: the actor diverged",
    }
    assert "flow-run" in {resource.role for resource in event.related}  # the run that failed, added by Prefect


def test_nothing_is_sent_outside_a_prefect_run(prefect_server):
    send_campaign_event(CAMPAIGN_FAILED, "events-outside", {"iteration": 0})

    @flow(name="marker")
    def marker() -> None:  # sent after the one above would have been: once it is in, the other would be too
        send_campaign_event(CAMPAIGN_FAILED, "events-outside-marker", {"iteration": 0})

    marker()
    prefect_events(CAMPAIGN_FAILED, resource_prefix="rlhf.campaign.events-outside-marker")
    events = prefect_events(CAMPAIGN_FAILED, resource_prefix="rlhf.campaign.events-outside", expect=0)
    assert [event.resource.id for event in events] == ["rlhf.campaign.events-outside-marker"]
