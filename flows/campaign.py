"""Campaign bookkeeping tasks: resolve the base inputs, open and close an iteration's MLflow run.

These are the flow's own steps around the seven stages; the stages themselves live in ``tasks/``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context

from flows.config import PipelineConfig
from tasks.runtime import BaseInputs, IterationContext, StageResult, layout_for, tracker_for, tracking_uri_for


@dataclass(frozen=True)
class IterationState:
    """What one iteration hands the next: the policy (actor + critic), reward model and all pairs so far."""

    policy: StageResult
    reward_model: StageResult | None = None
    preferences: tuple[StageResult, ...] = ()


def _file_fingerprint(path: Path) -> str:
    """sha256 of a file, or of a folder's file names, sizes and small-file contents."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        size = file.stat().st_size
        digest.update(str(size).encode())
        if size < (64 << 20):
            digest.update(file.read_bytes())
    return digest.hexdigest()


@task(name="resolve_base", cache_policy=NO_CACHE)
def resolve_base(config: PipelineConfig) -> BaseInputs:
    """Locate (or build, for the embedded demo) the initial policy, tokenizer and prompts."""
    policy, prompts, eval_prompts = config.model.policy, config.data.prompts, config.data.eval_prompts
    if policy is None or prompts is None or eval_prompts is None:
        from demo.build import build_default_world

        world = build_default_world(config.run_root / "cache" / "demo-world", seed=0)
        policy = policy or str(world.model_dir)
        prompts = prompts or world.prompts_path
        eval_prompts = eval_prompts or world.eval_prompts_path
    for name, path in (("data.prompts", prompts), ("data.eval_prompts", eval_prompts)):
        if not Path(path).is_file():
            raise FileNotFoundError(f"`{name}` file {path} does not exist")
    if Path(policy).exists() and not (Path(policy) / "config.json").is_file():
        raise FileNotFoundError(f"`model.policy` folder {policy} has no config.json: not a Hugging Face checkpoint")
    parts = [_file_fingerprint(Path(p)) if Path(p).exists() else str(p) for p in (policy, prompts, eval_prompts)]
    return BaseInputs(
        policy_dir=str(policy),
        tokenizer_dir=str(config.model.tokenizer or policy),
        prompts_path=str(prompts),
        eval_prompts_path=str(eval_prompts),
        fingerprint=hashlib.sha256("/".join(parts).encode()).hexdigest(),
        gold_available=config.model.policy is None or config.labeler == "gold",
    )


def _flow_run_id() -> str | None:
    try:
        return str(get_run_context().task_run.flow_run_id)
    except Exception:  # noqa: BLE001 - outside a Prefect run there is simply no id
        return None


@task(name="open_iteration", cache_policy=NO_CACHE)
def open_iteration(
    config: PipelineConfig, iteration: int, base: BaseInputs, state: IterationState | None
) -> IterationContext:
    """The iteration's MLflow parent run: the finished one for these exact inputs, or a new one."""
    layout = layout_for(config)
    tracker = tracker_for(tracking_uri_for(config), str(layout.artifact_root()))
    experiment_id = tracker.experiment_id(config.campaign)
    previous = "" if state is None else state.policy.digest
    iteration_key = hashlib.sha256(
        json.dumps([config.model_dump(mode="json"), base.fingerprint, previous, iteration]).encode()
    ).hexdigest()
    tags = {
        "rlhf.campaign": config.campaign,
        "rlhf.iteration": str(iteration),
        "rlhf.kind": "iteration",
        "rlhf.iteration_key": iteration_key,
    }
    parent = tracker.find_run(experiment_id, tags={"rlhf.iteration_key": iteration_key})
    flow_run_id = _flow_run_id()
    if parent is None:
        parent = tracker.start_run(
            experiment_id, name=f"iteration-{iteration}", tags={**tags, "prefect.flow_run_id": flow_run_id or ""}
        )
        tracker.log_params(parent, config.model_dump(mode="json"))
    return IterationContext(
        config=config,
        iteration=iteration,
        base=base,
        experiment_id=experiment_id,
        parent_run_id=parent,
        flow_run_id=flow_run_id,
    )


@task(name="close_iteration", cache_policy=NO_CACHE)
def close_iteration(context: IterationContext, stages: list[StageResult], state: IterationState) -> IterationState:
    """Log every stage's metrics on the iteration run, finish it, and leave a Prefect summary artifact."""
    tracker = tracker_for(tracking_uri_for(context.config), str(context.layout.artifact_root()))
    metrics = {f"{result.stage}/{name}": value for result in stages for name, value in result.metrics.items()}
    tracker.log_metrics(context.parent_run_id, metrics, step=context.iteration)
    tracker.end_run(context.parent_run_id)
    create_markdown_artifact(
        key=f"{context.config.campaign.lower().replace('_', '-').replace('.', '-')}-iteration-{context.iteration}",
        markdown=iteration_summary(context, stages, tracker.run_url(context.parent_run_id)),
        description=f"RLHF iteration {context.iteration} of campaign {context.config.campaign}",
    )
    return state


def iteration_summary(context: IterationContext, stages: list[StageResult], run_url: str) -> str:
    """Markdown: one row per stage (ran or reused, headline metrics), and the MLflow link."""
    lines = [
        f"# Campaign `{context.config.campaign}`, iteration {context.iteration}",
        "",
        f"MLflow run: [{context.parent_run_id}]({run_url})",
        "",
        "| stage | status | metrics |",
        "| --- | --- | --- |",
    ]
    for result in stages:
        shown = ", ".join(f"{name} {value:.4g}" for name, value in sorted(result.metrics.items()))
        lines.append(f"| {result.stage} | {'reused' if result.reused else 'ran'} | {shown} |")
    return "\n".join(lines) + "\n"
