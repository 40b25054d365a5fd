"""The flows' own steps around the seven stages: resolve the base inputs, open and close an
iteration's MLflow run, and rebuild a campaign's state from MLflow (to continue it or replay it).
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
from storage.manifest import read_manifest
from tasks.runtime import BaseInputs, IterationContext, StageResult, recorded_result, tracker_of, upstream_result

CONFIG_ARTIFACT = "config.json"
OUTPUT_TAG_PREFIX = "rlhf.output."
"""An iteration run's tag ``rlhf.output.<stage>`` names the stage run holding the output it used,
which is another iteration's run when the stage was reused."""


@dataclass(frozen=True)
class IterationState:
    """What one iteration hands the next: the policy (actor + critic), reward model and all pairs so far."""

    policy: StageResult
    reward_model: StageResult | None = None
    preferences: tuple[StageResult, ...] = ()


def _file_fingerprint(path: Path) -> str:
    """sha256 of a file, or of a folder's file names, sizes and (for files under 64 MiB) contents."""
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
    looks_like_path = str(policy).startswith(("/", ".", "~")) or str(policy).count("/") > 1
    if looks_like_path and not Path(policy).exists():
        raise FileNotFoundError(f"`model.policy` folder {policy} does not exist")
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


def _open_run(
    config: PipelineConfig, iteration: int, base: BaseInputs, *, key_parts: list, name: str, tags: dict[str, str]
) -> IterationContext:
    """The finished-or-crashed MLflow run for exactly these inputs, or a new one, as a context."""
    tracker = tracker_of(config)
    experiment_id = tracker.experiment_id(config.campaign)
    run_key = hashlib.sha256(
        json.dumps([config.model_dump(mode="json"), base.fingerprint, *key_parts]).encode()
    ).hexdigest()
    parent = tracker.find_run(experiment_id, tags={"rlhf.iteration_key": run_key})
    flow_run_id = _flow_run_id()
    if parent is None:
        all_tags = {
            "rlhf.campaign": config.campaign,
            "rlhf.iteration": str(iteration),
            "rlhf.iteration_key": run_key,
            **tags,
        }
        parent = tracker.start_run(
            experiment_id, name=name, tags={**all_tags, "prefect.flow_run_id": flow_run_id or ""}
        )
        tracker.log_params(parent, config.model_dump(mode="json"))
        tracker.log_text(parent, config.model_dump_json(indent=2), CONFIG_ARTIFACT)
    return IterationContext(
        config=config,
        iteration=iteration,
        base=base,
        experiment_id=experiment_id,
        parent_run_id=parent,
        flow_run_id=flow_run_id,
        register_models=tags["rlhf.kind"] == "iteration",
    )


@task(name="open_iteration", cache_policy=NO_CACHE)
def open_iteration(
    config: PipelineConfig, iteration: int, base: BaseInputs, state: IterationState | None
) -> IterationContext:
    """The iteration's MLflow parent run: the one for these exact inputs if it exists, or a new one."""
    previous = "" if state is None else state.policy.digest
    return _open_run(
        config,
        iteration,
        base,
        key_parts=[previous, iteration],
        name=f"iteration-{iteration}",
        tags={"rlhf.kind": "iteration"},
    )


@task(name="open_replay", cache_policy=NO_CACHE)
def open_replay(config: PipelineConfig, source_run_id: str, base: BaseInputs) -> IterationContext:
    """A new run tagged with the iteration run it replays (the same one again for the same settings)."""
    iteration = int(tracker_of(config).run_tags(source_run_id)["rlhf.iteration"])
    tags = {"rlhf.kind": "replay", "rlhf.replay_of": source_run_id}
    return _open_run(
        config, iteration, base, key_parts=["replay", source_run_id], name=f"replay-of-iteration-{iteration}", tags=tags
    )


@task(name="close_iteration", cache_policy=NO_CACHE)
def close_iteration(context: IterationContext, stages: list[StageResult], state: IterationState) -> IterationState:
    """Log every stage's metrics on the iteration run, finish it, and leave a Prefect summary artifact.

    An iteration whose stages were all reused and whose run is already finished logs nothing new.
    """
    tracker = tracker_of(context.config)
    if not all(result.reused for result in stages) or tracker.run_status(context.parent_run_id) != "FINISHED":
        metrics = {f"{result.stage}/{name}": value for result in stages for name, value in result.metrics.items()}
        tracker.log_metrics(context.parent_run_id, metrics, step=context.iteration)
        tracker.set_tags(context.parent_run_id, {f"{OUTPUT_TAG_PREFIX}{r.stage}": r.run_id for r in stages})
        tracker.end_run(context.parent_run_id)
    kind = tracker.run_tags(context.parent_run_id).get("rlhf.kind", "iteration")
    create_markdown_artifact(
        key=f"{context.config.campaign.lower().replace('_', '-').replace('.', '-')}-{kind}-{context.iteration}",
        markdown=iteration_summary(context, stages, tracker.run_url(context.parent_run_id), kind=kind),
        description=f"RLHF {kind} {context.iteration} of campaign {context.config.campaign}",
    )
    return state


def iteration_summary(
    context: IterationContext, stages: list[StageResult], run_url: str, *, kind: str = "iteration"
) -> str:
    """Markdown: one row per stage (ran or reused, headline metrics), and the MLflow link."""
    lines = [
        f"# Campaign `{context.config.campaign}`, {kind} {context.iteration}",
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


def _stage_run(context: IterationContext, parent_run_id: str, stage: str) -> str:
    """The stage run whose output an iteration (or replay) run used: its own, or a reused one."""
    tracker = tracker_of(context.config)
    run_id = tracker.run_tags(parent_run_id).get(f"{OUTPUT_TAG_PREFIX}{stage}") or tracker.find_run(
        context.experiment_id, tags={"mlflow.parentRunId": parent_run_id, "rlhf.stage": stage}, status="FINISHED"
    )  # runs recorded before the output tags existed: their own nested stage run
    if run_id is None:
        raise LookupError(f"run {parent_run_id} records no finished {stage!r} output")
    return run_id


@task(name="load_replay_inputs", cache_policy=NO_CACHE)
def load_replay_inputs(context: IterationContext, source_run_id: str) -> tuple[StageResult, StageResult, StageResult]:
    """The source iteration's experience, the policy it was rolled out with, and its reward model."""
    experience = recorded_result(context, _stage_run(context, source_run_id, "rollout"))
    return (
        experience,
        upstream_result(context, experience, "policy"),
        upstream_result(context, experience, "reward_model"),
    )


def source_config(config: PipelineConfig, source_run_id: str) -> PipelineConfig:
    """The config an iteration run was made with (stored beside it as ``config.json``)."""
    return PipelineConfig.model_validate_json(tracker_of(config).load_text(source_run_id, CONFIG_ARTIFACT))


@task(name="load_latest_state", cache_policy=NO_CACHE)
def load_latest_state(config: PipelineConfig, base: BaseInputs) -> tuple[int, IterationState | None]:
    """Where a campaign stands in MLflow: the next iteration to run and the state to run it from.

    The state comes from the newest finished iteration run: its PPO output (actor and critic), its
    reward model, and every preference table that reward model was trained on.
    """
    tracker = tracker_of(config)
    experiment_id = tracker.experiment_id(config.campaign)
    latest = tracker.latest_iteration(experiment_id)
    if latest is None:
        return 0, None
    context = IterationContext(
        config=config, iteration=latest, base=base, experiment_id=experiment_id, parent_run_id=None, flow_run_id=None
    )
    parent = tracker.find_run(
        experiment_id, tags={"rlhf.kind": "iteration", "rlhf.iteration": str(latest)}, status="FINISHED"
    )
    policy = recorded_result(context, _stage_run(context, parent, "ppo_update"))
    reward_model = recorded_result(context, _stage_run(context, parent, "train_reward_model"))
    names = sorted(read_upstream_names(reward_model, prefix="preferences_"), key=lambda name: int(name.split("_")[1]))
    preferences = tuple(upstream_result(context, reward_model, name) for name in names)
    return latest + 1, IterationState(policy=policy, reward_model=reward_model, preferences=preferences)


def read_upstream_names(result: StageResult, *, prefix: str) -> list[str]:
    return [name for name in read_manifest(result.directory, verify=False).upstream if name.startswith(prefix)]
