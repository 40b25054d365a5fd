"""flows.lineage: the campaign's asset graph as the Prefect artifact draws it (Mermaid), from the outputs' manifests."""

from __future__ import annotations

import re

from flows.lineage import (
    DRAWN_ITERATIONS,
    Lineage,
    ancestry,
    artifact_key,
    campaign_manifests,
    lineage_markdown,
    mermaid,
)
from runtime.assets import base_asset, manifest_asset
from tests.runtime.test_assets import SHA, write_output


def _campaign(root):
    """Two iterations of initialize -> rollout -> ppo_update -> evaluate, plus an abandoned rollout."""
    initialize = write_output(root, "initialize", 0, upstream={})
    outputs, policy = [initialize], initialize
    for iteration in (0, 1):
        rollout = write_output(root, "rollout", iteration, upstream={"policy": policy.digest})
        update = write_output(
            root, "ppo_update", iteration, upstream={"policy": policy.digest, "scored": rollout.digest}
        )
        evaluation = write_output(root, "evaluate", iteration, upstream={"policy": update.digest})
        outputs += [rollout, update, evaluation]
        policy = update
    abandoned = write_output(root, "rollout", 1, upstream={"policy": initialize.digest}, rows=5)
    return outputs, abandoned


def test_the_graph_holds_the_evaluations_and_all_they_were_made_from_ancestors_first(tmp_path):
    outputs, abandoned = _campaign(tmp_path)
    manifests = campaign_manifests(sorted(path.parent for path in tmp_path.glob("*/*/_manifest.json")))
    assert set(manifests) == {manifest.digest for manifest in [*outputs, abandoned]}
    evaluations = [manifest.digest for manifest in outputs if manifest.stage == "evaluate"]
    ordered = ancestry(manifests, evaluations)
    assert {manifest.digest for manifest in ordered} == {
        manifest.digest for manifest in outputs
    }  # not the abandoned one
    position = {manifest.digest: index for index, manifest in enumerate(ordered)}
    for manifest in ordered:
        assert all(position[parent] < position[manifest.digest] for parent in manifest.upstream.values())
    assert ancestry(manifests, ["f" * 64]) == []  # an output gc removed ends the branch


def test_the_mermaid_graph_draws_every_asset_and_edge_and_marks_what_the_run_did(tmp_path):
    outputs, _ = _campaign(tmp_path)
    last_update, last_evaluation = outputs[-2], outputs[-1]
    lineage = Lineage(tuple(outputs), wrote=frozenset({last_evaluation.digest}), reused=frozenset({last_update.digest}))
    text = mermaid("demo", lineage)
    named = re.findall(r"^  %% (\w+): (\S+) (\w+)$", text, flags=re.MULTILINE)  # node id, asset key, version
    node = {(key, version): node for node, key, version in named}
    edges = re.findall(r"^  (\w+) --> (\w+)$", text, flags=re.MULTILINE)
    node |= {manifest.digest: node[manifest_asset("demo", manifest), manifest.digest[:16]] for manifest in outputs}
    for manifest in outputs:
        assert {(node[parent], node[manifest.digest]) for parent in manifest.upstream.values()} <= set(edges)
    prompts, policy = (
        node[base_asset("demo", "prompts"), SHA["prompts"][:16]],
        node[base_asset("demo", "policy"), SHA["policy"][:16]],
    )
    assert (prompts, node[outputs[1].digest]) in edges and (policy, node[outputs[0].digest]) in edges
    assert (
        f'{node[last_evaluation.digest]}["evaluate · 1<br/>{last_evaluation.digest[:8]}<br/>gold win rate 0.625<br/>wrote"]:::wrote'
        in text
    )
    reused = next(line for line in text.splitlines() if line.strip().startswith(f"{node[last_update.digest]}["))
    assert reused.endswith('reused"]:::reused')
    assert (
        f'{node[outputs[3].digest]}["evaluate · 0<br/>{outputs[3].digest[:8]}<br/>gold win rate 0.625"]:::evaluated'
        in text
    )


def test_the_artifact_lists_the_runs_own_assets_by_key(tmp_path):
    outputs, _ = _campaign(tmp_path)
    lineage = Lineage(tuple(outputs), wrote=frozenset({outputs[-1].digest}), reused=frozenset({outputs[-2].digest}))
    markdown = lineage_markdown("demo", lineage, title="Lineage")
    assert "```mermaid\nflowchart TB" in markdown
    rows = re.findall(r"^\| (\w+) \| (\d+) \| `(\S+)` \| `(\w+)` \| (wrote|reused) \|", markdown, flags=re.M)
    assert rows == [
        ("ppo_update", "1", manifest_asset("demo", outputs[-2]), outputs[-2].digest[:16], "reused"),
        ("evaluate", "1", manifest_asset("demo", outputs[-1]), outputs[-1].digest[:16], "wrote"),
    ]


def test_artifact_keys_are_what_prefect_accepts_and_never_shared_by_two_campaigns():
    assert artifact_key("demo", "iteration", 3) == "demo-iteration-3"
    assert re.fullmatch(r"my-campaign-v2-[0-9a-f]{8}-lineage", artifact_key("My_Campaign.v2", "lineage"))
    keys = {artifact_key(name, "lineage") for name in ("my-run", "My_Run", "my_run", "MY-RUN", "my.run")}
    assert len(keys) == 5 and all(re.fullmatch(r"[a-z0-9-]+", key) for key in keys)


def test_a_long_campaign_draws_its_newest_iterations_within_what_mermaid_draws(tmp_path):
    """Mermaid draws no diagram of more than 50,000 characters: the diagram keeps the newest iterations, says which it
    left out, and stays under that for a campaign of 100 iterations."""
    initialize = write_output(tmp_path, "initialize", 0, upstream={})
    outputs, policy = [initialize], initialize
    for iteration in range(100):
        rollout = write_output(tmp_path, "rollout", iteration, upstream={"policy": policy.digest})
        update = write_output(
            tmp_path, "ppo_update", iteration, upstream={"policy": policy.digest, "scored": rollout.digest}
        )
        evaluation = write_output(tmp_path, "evaluate", iteration, upstream={"policy": update.digest})
        outputs += [rollout, update, evaluation]
        policy = update
    lineage = Lineage(tuple(outputs), wrote=frozenset(), reused=frozenset())
    text = mermaid("demo", lineage)
    assert len(text) < 50_000
    assert (
        f"evaluate · {100 - DRAWN_ITERATIONS}<br/>" in text and f"evaluate · {99 - DRAWN_ITERATIONS}<br/>" not in text
    )
    assert f"The diagram starts at iteration {100 - DRAWN_ITERATIONS}" in lineage_markdown("demo", lineage, title="x")
