"""The Prefect APIs Prefect does not publish, checked against the installed Prefect (runtime/prefect_internals.py,
issue 42): an upgrade that renames, moves or reshapes one fails here, naming it. What each does for the pipeline is
tested where it is used: the slot leases and the tags in tests/flows/test_concurrency.py, the parameter schema in
tests/flows/test_serve.py."""

from __future__ import annotations

import inspect

from prefect import flow


def test_the_lease_requests_take_what_the_adapter_passes_and_return_a_lease_id():
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.responses import ConcurrencyLimitWithLeaseResponse
    from prefect.concurrency import _sync

    increment = inspect.signature(SyncPrefectClient.increment_concurrency_slots_with_lease)
    assert {"names", "slots", "mode", "lease_duration"} <= set(increment.parameters)
    assert {"lease_id", "limits"} <= set(ConcurrencyLimitWithLeaseResponse.model_fields)
    assert "lease_id" in inspect.signature(SyncPrefectClient.release_concurrency_slots_with_lease).parameters
    maintain = inspect.signature(_sync.maintain_concurrency_lease)
    assert list(maintain.parameters)[:2] == ["lease_id", "lease_duration"]
    assert "raise_on_lease_renewal_failure" in maintain.parameters


def test_without_tags_removes_only_the_named_tags_and_restores_them():
    from prefect import tags
    from prefect.context import TagsContext

    from runtime.prefect_internals import without_tags

    with tags("gpu", "campaign-a"):
        with without_tags("gpu"):
            assert TagsContext.get().current_tags == {"campaign-a"}
        assert TagsContext.get().current_tags == {"gpu", "campaign-a"}


@flow
def _a_flow(steps: int = 3) -> int:
    return steps


def test_a_deployments_parameter_schema_reads_and_sets_as_a_dict():
    from runtime.prefect_internals import parameter_schema, set_parameter_schema

    deployment = _a_flow.to_deployment(name="schema-check")
    schema = parameter_schema(deployment)
    assert schema["properties"]["steps"]["default"] == 3
    schema["properties"]["steps"]["minimum"] = 1
    set_parameter_schema(deployment, schema)
    assert parameter_schema(deployment)["properties"]["steps"]["minimum"] == 1
    assert type(deployment._parameter_openapi_schema).__name__ == "ParameterSchema"
