"""A campaign's lineage as the Prefect UI draws it: the asset graph from the base inputs to each evaluated policy.

Prefect Cloud draws an asset graph from the asset events the stages send (:mod:`runtime.assets`); the open-source
server keeps those events (its event feed lists each materialisation with its upstream assets) but draws no graph.
So every iteration (and replay) also leaves a Prefect artifact, ``<campaign>-lineage``, holding the same graph as a
Mermaid diagram, which the Prefect UI (its V2 pages, the default in Prefect 3.8) draws.

Choices:

1. The graph is read from the campaign's own records, not from Prefect's events, which the server deletes after
   its retention period: every output's manifest names its upstream outputs by digest and the base inputs by
   content, and MLflow says which evaluations belong to the campaign's finished iterations.
2. It holds the evaluations of every finished iteration (and the outputs of the run it is drawn for) and everything
   they were made from; outputs of abandoned attempts and superseded iterations are left out.
3. Each node is one output, named in a comment beside it by its stage's asset key
   (:func:`runtime.assets.manifest_asset`) and its version (the first 16 hex digits of its digest, as the
   materialisation's payload has it), so the diagram and the events name the same things; a base input is one node
   per content. Node ids are short (``n3``), and the diagram draws the newest
   :data:`DRAWN_ITERATIONS` iterations only: Mermaid draws no diagram of more than 50,000 characters, and an
   iteration takes about 1,000 (the tiny campaign: 1,616 characters for one iteration, 3,643 for three). The
   run's own outputs are marked written or reused, and each evaluation shows its headline figure.
4. An output whose manifest is no longer on disk (``rlhf gc`` removed it) ends its branch: the graph shows what
   the folder still holds.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.assets import base_asset, base_contents, manifest_asset, manifest_iteration
from storage.manifest import Manifest, read_manifest
from storage.tracking import TAG_MANIFEST_DIGEST, TAG_OUTPUT_PREFIX

if TYPE_CHECKING:
    from runtime.context import StageContext
    from runtime.declaration import StageResult
    from storage.tracking import Tracker

LINEAGE_ARTIFACT = "lineage"
EVALUATION_STAGE = "evaluate"
DRAWN_ITERATIONS = 12
"""The newest iterations the diagram draws (see the module docstring)."""
HEADLINE = (("gold_win_rate", "gold win rate"), ("rubric_mean", "rubric"), ("reward_mean", "reward"))
"""The figure an evaluation node shows: the first of these its metrics hold."""


def artifact_key(campaign: str, *parts: object) -> str:
    """A Prefect artifact key for ``campaign`` (keys are lowercase letters, digits and dashes). A name that is not one
    already is made one and followed by 8 hex digits of its sha256, so two campaigns whose names differ only where
    a key cannot (``My_Run`` and ``my-run``) never share their artifacts."""
    name = re.sub(r"[^a-z0-9-]", "-", campaign.lower())
    if name != campaign:
        name += "-" + hashlib.sha256(campaign.encode()).hexdigest()[:8]
    return "-".join([name, *map(str, parts)])


@dataclass(frozen=True)
class Lineage:
    """The outputs a lineage graph holds (each by manifest, in drawing order) and what the run drawn for did.

    Args:
        outputs: every output drawn, ancestors first.
        wrote: digests of the outputs the run wrote.
        reused: digests of the outputs the run reused.
    """

    outputs: tuple[Manifest, ...]
    wrote: frozenset[str]
    reused: frozenset[str]


def campaign_manifests(folders: Iterable[Path]) -> dict[str, Manifest]:
    """``digest -> manifest`` of the outputs in ``folders`` (unreadable ones are left out)."""
    manifests = {}
    for folder in folders:
        try:
            manifest = read_manifest(folder, verify=False)
        except (OSError, ValueError):  # a corrupt or foreign manifest is not lineage: its stage reports it
            continue
        manifests[manifest.digest] = manifest
    return manifests


def ancestry(manifests: dict[str, Manifest], roots: Iterable[str]) -> list[Manifest]:
    """The outputs ``roots`` name and all they were made from, each after what it was made from (a depth-first
    order); digests ``manifests`` lacks are skipped."""
    ordered: list[Manifest] = []
    seen: set[str] = set()

    def visit(digest: str) -> None:
        if digest in seen or digest not in manifests:
            return
        seen.add(digest)
        manifest = manifests[digest]
        for parent in sorted(manifest.upstream.values()):
            visit(parent)
        ordered.append(manifest)

    for root in roots:
        visit(root)
    return ordered


def _label(manifest: Manifest, *, status: str) -> str:
    lines = [f"{manifest.stage} · {manifest_iteration(manifest)}", manifest.digest[:8]]
    if manifest.stage == EVALUATION_STAGE:
        figures = [f"{name} {manifest.metrics[metric]:.3g}" for metric, name in HEADLINE if metric in manifest.metrics]
        lines += figures[:1]
    if status:
        lines.append(status)
    return "<br/>".join(lines)


def drawn(lineage: Lineage) -> tuple[Manifest, ...]:
    """The outputs the diagram holds: those of the newest :data:`DRAWN_ITERATIONS` iterations."""
    iterations = sorted({manifest_iteration(manifest) for manifest in lineage.outputs})[-DRAWN_ITERATIONS:]
    return tuple(manifest for manifest in lineage.outputs if manifest_iteration(manifest) in iterations)


def mermaid(campaign: str, lineage: Lineage) -> str:
    """The lineage as a Mermaid flowchart, top to bottom: the base inputs, then each output below what it was made
    from (no box per iteration: Mermaid lays boxes side by side, which the artifact's column shrinks unreadably).
    Nodes have short ids, each named by its asset key and version in a comment line (see the module docstring)."""
    lines = [
        "flowchart TB",
        "  classDef base fill:#e8eef8,stroke:#5b7bb0,color:#1d2b44",
        "  classDef wrote fill:#dff3e4,stroke:#2f8f4e,stroke-width:2px,color:#123",
        "  classDef reused fill:#f4f4f4,stroke:#888,stroke-dasharray:4 3,color:#333",
        "  classDef evaluated fill:#fff3d6,stroke:#c08a00,stroke-width:2px,color:#321",
    ]
    outputs = drawn(lineage)
    node = {manifest.digest: f"n{index}" for index, manifest in enumerate(outputs)}
    bases: dict[tuple[str, str], str] = {}
    edges: list[tuple[str, str]] = []
    for manifest in outputs:
        child = node[manifest.digest]
        edges += [(node[parent], child) for parent in sorted(manifest.upstream.values()) if parent in node]
        for content in base_contents(manifest).items():
            bases.setdefault(content, f"b{len(bases)}")
            edges.append((bases[content], child))
    for (name, sha), base in bases.items():
        lines += [f"  %% {base}: {base_asset(campaign, name)} {sha[:16]}", f'  {base}[("{name}<br/>{sha[:8]}")]:::base']
    for manifest in outputs:
        status = "wrote" if manifest.digest in lineage.wrote else "reused" if manifest.digest in lineage.reused else ""
        style = status or ("evaluated" if manifest.stage == EVALUATION_STAGE else "")
        lines += [
            f"  %% {node[manifest.digest]}: {manifest_asset(campaign, manifest)} {manifest.digest[:16]}",
            f'  {node[manifest.digest]}["{_label(manifest, status=status)}"]' + (f":::{style}" if style else ""),
        ]
    lines += [f"  {parent} --> {child}" for parent, child in dict.fromkeys(edges)]
    return "\n".join(lines)


def lineage_markdown(campaign: str, lineage: Lineage, *, title: str) -> str:
    """The artifact: the graph, then a row per output the run wrote or reused with its asset key and version."""
    lines = [
        f"# {title}",
        "",
        "Every stage output is a version of its stage's Prefect asset; an arrow goes from what it was made from. "
        "Green: written by this run; dashed: reused by it; gold: an evaluated policy.",
        "",
        "```mermaid",
        mermaid(campaign, lineage),
        "```",
        "",
        *_left_out(lineage),
        "| stage | iteration | asset | version | this run | rows | MB |",
        "| --- | ---: | --- | --- | --- | ---: | ---: |",
    ]
    for manifest in lineage.outputs:
        if manifest.digest not in lineage.wrote | lineage.reused:
            continue
        rows = sum(entry.rows or 0 for entry in manifest.files)
        size = sum(entry.bytes for entry in manifest.files) / 2**20
        did = "wrote" if manifest.digest in lineage.wrote else "reused"
        lines.append(
            f"| {manifest.stage} | {manifest_iteration(manifest)} | `{manifest_asset(campaign, manifest)}` "
            f"| `{manifest.digest[:16]}` | {did} | {rows or ''} | {size:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _left_out(lineage: Lineage) -> list[str]:
    """A line saying which iterations the diagram leaves out, if any."""
    left = len(lineage.outputs) - len(drawn(lineage))
    if not left:
        return []
    first = min(manifest_iteration(manifest) for manifest in drawn(lineage))
    return [
        f"The diagram starts at iteration {first}: {left} outputs of earlier iterations are in earlier versions of "
        "this artifact.",
        "",
    ]


def evaluated_outputs(tracker: Tracker, experiment_id: str) -> list[str]:
    """The digests of the evaluations of the campaign's finished iterations, by iteration (older records name the
    output they used with a tag; an iteration recorded without one is left out)."""
    digests = []
    for run in tracker.finished_iterations(experiment_id).values():
        stage_run = run.tags.get(f"{TAG_OUTPUT_PREFIX}{EVALUATION_STAGE}")
        if stage_run is not None:
            digests.append(tracker.run(stage_run).tags.get(TAG_MANIFEST_DIGEST, ""))
    return digests


def run_lineage(context: StageContext, stages: list[StageResult]) -> Lineage:
    """The lineage of the campaign as of the run ``stages`` belong to: every finished iteration's evaluation and this
    run's outputs, with all they were made from."""
    manifests = campaign_manifests(context.layout.outputs())
    roots = [*evaluated_outputs(context.tracker, context.experiment_id), *(result.digest for result in stages)]
    return Lineage(
        outputs=tuple(ancestry(manifests, roots)),
        wrote=frozenset(result.digest for result in stages if not result.reused),
        reused=frozenset(result.digest for result in stages if result.reused),
    )


def create_lineage_artifact(context: StageContext, stages: list[StageResult], *, kind: str) -> None:
    """Leave the campaign's lineage (:func:`run_lineage`) as the Prefect artifact ``<campaign>-lineage`` (a new
    version of it per run)."""
    from prefect.artifacts import create_markdown_artifact

    title = f"Lineage of campaign `{context.campaign}` after {kind} {context.iteration}"
    create_markdown_artifact(
        key=artifact_key(context.campaign, LINEAGE_ARTIFACT),
        markdown=lineage_markdown(context.campaign, run_lineage(context, stages), title=title),
        description=f"RLHF campaign {context.campaign}: its assets from the base inputs to each evaluated policy",
    )
