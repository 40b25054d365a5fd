"""Each stage output as a Prefect asset: its key, what it was made from, and the events that tell Prefect.

Prefect draws lineage from assets: a key (a URI) per thing a workflow makes, the keys it was made from, and
metadata. A stage output is exactly such a thing, named by its manifest digest and made from named upstream outputs
and base inputs; this module states that once, for the events (:func:`publish_output`) and for the lineage graph the
flows draw (:mod:`flows.lineage`).

Choices:

1. Keys are stable, as Prefect's asset model has them: an asset is a thing made again and again, each
   materialisation a version (issue 42: content-addressed keys made every output an asset of its own, materialised
   once, about 9 more assets a campaign iteration, and showed no freshness). A stage's outputs are the asset
   ``rlhf://<campaign>/<stage>`` (:func:`output_asset`); each materialisation's payload says which output it is (its
   digest, input key and iteration, the MLflow run, and whether an iteration or a replay made it). A base input is
   ``rlhf://<campaign>/base/<name>`` (:func:`base_asset`), its sha256 in the payload of what was made from it. The
   graph of the stage assets holds the loop itself (the rollout made from the update, the update from the
   advantages made from the rollout); the lineage artifact (:mod:`flows.lineage`) draws every output.
2. The events are Prefect's own asset grammar, what ``@materialize`` emits: ``prefect.asset.materialization.succeeded``
   for the output with its upstream assets as related resources and its metadata as payload, and
   ``prefect.asset.referenced`` for each upstream. They are emitted here rather than by ``@materialize`` because an
   output's key names its digest, known only once the stage has run, and ``@materialize`` takes its keys before
   the task starts. Emitted inside the stage's task run, they carry that run, its flow run and flow as related
   resources, as ``@materialize``'s do.
3. The materialisation is also the event "a stage output was written": its payload holds the campaign, iteration,
   stage, digest, input key and MLflow run, so an automation can match ``rlhf://<campaign>/*`` and read them.
4. A reused output is not materialised again: the run only references it, so its asset keeps the one
   materialisation that wrote it, while the outputs made from it still name it as their upstream. The call that
   records an output in MLflow materialises it: an output computed ahead of its iteration (``sampling.staleness``,
   recorded by nobody yet) is materialised when its iteration finds and records it, and so is one a crashed
   attempt wrote but did not record.
5. Which base inputs a stage reads is declared in :data:`BASE_INPUTS` (the model and data files; tokenizers go with
   their models).
6. Events are sent only from inside a Prefect run (:func:`runtime.events.send`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from runtime.declaration import StageResult
from runtime.events import in_prefect_run, send
from storage.manifest import Manifest, read_manifest

if TYPE_CHECKING:
    from runtime.context import StageContext

SCHEME = "rlhf"
SHORT_DIGEST = 16
MATERIALIZED = "prefect.asset.materialization.succeeded"
REFERENCED = "prefect.asset.referenced"

BASE_INPUTS: dict[str, tuple[str, ...]] = {
    "initialize": ("policy",),
    "sample_candidates": ("prompts",),
    "collect_preferences": ("preferences",),
    "train_reward_model": ("reward_model",),
    "rollout": ("prompts",),
    "evaluate": ("eval_prompts",),
}
"""``stage -> the base inputs it reads`` (:attr:`runtime.context.BaseInputs.contents` names); one a campaign does not
have (no imported preferences, no pretrained reward model) is left out. The base policy is named where it enters
(``initialize``) only: evaluation reads it again as its reference, and so does every stage that loads the frozen
reference, but an edge from it to each of those would say nothing the graph does not already show."""


def output_asset(campaign: str, stage: str) -> str:
    """The asset key of a stage's outputs in a campaign (see the module docstring)."""
    return f"{SCHEME}://{campaign}/{stage}"


def base_asset(campaign: str, name: str) -> str:
    """The asset key of a base input (``policy``, ``prompts``, ...)."""
    return f"{SCHEME}://{campaign}/base/{name}"


def campaign_assets(campaign: str) -> str:
    """The pattern every asset of ``campaign`` matches, as an automation's resource filter."""
    return f"{SCHEME}://{campaign}/*"


def manifest_iteration(manifest: Manifest) -> int:
    """The iteration that wrote an output (its input key's context)."""
    return int(manifest.config["context"]["iteration"])


def manifest_asset(campaign: str, manifest: Manifest) -> str:
    """:func:`output_asset` of the output ``manifest`` describes."""
    return output_asset(campaign, manifest.stage)


def base_contents(manifest: Manifest) -> dict[str, str]:
    """``name -> sha256`` of each base input the output was made from (:data:`BASE_INPUTS`), as its manifest records
    them."""
    contents = manifest.runtime.get("inputs", {})
    return {name: contents[name] for name in BASE_INPUTS.get(manifest.stage, ()) if name in contents}


def base_dependencies(campaign: str, manifest: Manifest) -> list[str]:
    """The asset keys of the base inputs the output was made from (:func:`base_contents`)."""
    return [base_asset(campaign, name) for name in base_contents(manifest)]


def output_metadata(manifest: Manifest, *, campaign: str, run_id: str | None, kind: str) -> dict[str, Any]:
    """What a materialisation says of its output: which output it is (its digest: the asset's version), where it
    belongs, what made it (an ``iteration`` or a ``replay``) and from what (upstream digests, base inputs' sha256),
    rows, bytes and the stage's metrics."""
    rows = [entry.rows for entry in manifest.files if entry.rows is not None]
    return {
        "campaign": campaign,
        "iteration": manifest_iteration(manifest),
        "kind": kind,
        "stage": manifest.stage,
        "digest": manifest.digest,
        "input_key": manifest.input_key,
        "upstream": dict(manifest.upstream),
        "base_inputs": base_contents(manifest),
        "mlflow_run_id": run_id,
        "files": len(manifest.files),
        "rows": sum(rows) if rows else None,
        "bytes": sum(entry.bytes for entry in manifest.files),
        "metrics": dict(manifest.metrics),
    }


def _stage_results(upstream: Any) -> list[StageResult]:
    """The stage outputs a stage was given: among a mapping's values, or a settings dataclass's fields (a tuple counts
    each; optimizer states and settings are not outputs)."""
    given = (
        upstream.values() if isinstance(upstream, Mapping) else [getattr(upstream, f.name) for f in fields(upstream)]
    )
    values = [item for value in given for item in (value if isinstance(value, tuple | list) else (value,))]
    return [value for value in values if isinstance(value, StageResult)]


@dataclass(frozen=True)
class AssetEvent:
    """One Prefect event about an asset: its name, the asset (a Prefect resource), related assets and payload."""

    event: str
    resource: dict[str, str]
    related: tuple[dict[str, str], ...] = ()
    payload: dict[str, Any] | None = None


def output_events(
    campaign: str,
    manifest: Manifest,
    parents: list[str],
    *,
    reused: bool,
    run_id: str | None,
    path: str,
    kind: str = "iteration",
) -> list[AssetEvent]:
    """The events that tell Prefect about one output (see the module docstring).

    Args:
        campaign: the campaign it belongs to.
        manifest: its manifest.
        parents: the asset keys of the upstream outputs it was made from (its base inputs are added here).
        reused: the run reused it rather than wrote it.
        run_id: the MLflow run recording it.
        path: its folder.
        kind: what recorded it: an ``iteration`` or a ``replay``.
    """
    resource = {
        "prefect.resource.id": manifest_asset(campaign, manifest),
        "prefect.resource.name": f"{manifest.stage} of campaign {campaign}",
        "prefect.asset.description": (
            f"{manifest.stage} output {manifest.digest[:SHORT_DIGEST]} of iteration {manifest_iteration(manifest)} "
            f"in {path}"
        ),
    }
    if reused:
        return [AssetEvent(REFERENCED, resource)]
    # each upstream asset once (a reward model trained on several iterations' preferences names that stage's asset
    # once), and not the output's own: an update made from the previous update is the same asset's new version
    own = resource["prefect.resource.id"]
    parents = [key for key in dict.fromkeys([*parents, *base_dependencies(campaign, manifest)]) if key != own]
    return [
        *(AssetEvent(REFERENCED, {"prefect.resource.id": parent}) for parent in parents),
        AssetEvent(
            MATERIALIZED,
            resource,
            related=tuple({"prefect.resource.id": parent, "prefect.resource.role": "asset"} for parent in parents),
            payload=output_metadata(manifest, campaign=campaign, run_id=run_id, kind=kind),
        ),
    ]


def publish_output(context: StageContext, result: StageResult, upstream: Any, *, reused: bool | None = None) -> None:
    """Send Prefect the events of a stage output (:func:`output_events`), from inside a Prefect run only.

    Args:
        context: the iteration.
        result: the output, written or reused.
        upstream: what the stage was given: ``{name: output}``, or a settings dataclass holding its inputs.
        reused: whether it was materialised before (choice 4); ``result.reused`` when None.
    """
    if not in_prefect_run():
        return
    manifest = read_manifest(result.directory, verify=False)
    # one parent per output, given once or twice (the reward model as the reward and as the critic's start)
    folders = dict.fromkeys(parent.directory for parent in _stage_results(upstream))
    parents = [manifest_asset(context.campaign, read_manifest(folder, verify=False)) for folder in folders]
    events = output_events(
        context.campaign,
        manifest,
        parents,
        reused=result.reused if reused is None else reused,
        run_id=result.run_id,
        path=result.path,
        kind="iteration" if context.register_models else "replay",  # replays register no versions
    )
    for event in events:
        send(event.event, event.resource, related=event.related, payload=event.payload)
