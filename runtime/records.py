"""Stage outputs found through their MLflow records: what continuing and replaying a campaign start from."""

from __future__ import annotations

from runtime.context import StageContext
from runtime.declaration import StageResult
from storage.manifest import read_manifest
from storage.recorded import recorded_output
from storage.tracking import KIND_STAGE, TAG_KIND, TAG_MANIFEST_DIGEST


def recorded_result(context: StageContext, run_id: str) -> StageResult:
    """The output of a stage run recorded in MLflow, downloaded into the run folder if it is not there."""
    stage_dir, manifest = recorded_output(context.tracker, context.layout, run_id)
    return StageResult.of(stage_dir, manifest, reused=True, run_id=run_id)


def upstream_result(context: StageContext, result: StageResult, name: str) -> StageResult:
    """The recorded output that ``result`` names as its upstream ``name`` (found by manifest digest)."""
    digest = read_manifest(result.directory, verify=False).upstream[name]
    run_id = context.tracker.find_run(
        context.experiment_id, tags={TAG_MANIFEST_DIGEST: digest, TAG_KIND: KIND_STAGE}, status="FINISHED"
    )
    if run_id is None:
        raise LookupError(f"no finished stage run in MLflow holds the {name!r} output {digest[:16]} of {result.stage}")
    return recorded_result(context, run_id)


def optional_upstream_result(context: StageContext, result: StageResult, name: str) -> StageResult | None:
    """:func:`upstream_result`, or None when ``result`` had no upstream ``name`` (it was called with None)."""
    if name not in read_manifest(result.directory, verify=False).upstream:
        return None
    return upstream_result(context, result, name)


def upstream_names(result: StageResult, *, prefix: str) -> list[str]:
    """The names of ``result``'s upstream outputs that start with ``prefix``, in their numeric order
    (``preferences_0``, ``preferences_1``, ...)."""
    names = [name for name in read_manifest(result.directory, verify=False).upstream if name.startswith(prefix)]
    return sorted(names, key=lambda name: int(name[len(prefix) :]))
