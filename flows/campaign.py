"""The flows' own steps around the stages: resolve the base inputs, open and close an iteration's
MLflow run, and rebuild a campaign's state from MLflow (to continue it or replay it).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context

from flows.config import ConfigError, HumanLabelConfig, PipelineConfig
from flows.figures import FIGURE_FILE, overoptimisation_figure, png_data_uri
from flows.identity import (
    base_inputs,
    demo_world_dir,
    fields_without,
    fingerprint_cache,
    run_key,
    starting_point,
    uses_demo_world,
)
from flows.inputs import InputError, check_inputs
from flows.reuse import reuse_record
from flows.settings import EXECUTION, LOCATION, replayable_fields
from flows.store import artifact_root, campaign_layout, tracking_uri
from storage.tracking import (
    KIND_ITERATION,
    KIND_REPLAY,
    TAG_CAMPAIGN,
    TAG_CAMPAIGN_CONFIG,
    TAG_CONFIG_FINGERPRINT,
    TAG_FLOW_RUN_ID,
    TAG_INPUT_KEY,
    TAG_ITERATION,
    TAG_ITERATION_KEY,
    TAG_KIND,
    TAG_OUTPUT_PREFIX,
    TAG_PARENT_RUN_ID,
    TAG_REPLAY_OF,
    TAG_REUSE,
    TAG_STAGE,
    TAG_STARTING_POINT,
    Tracker,
)
from tasks.context import BaseInputs, Execution, StageContext, TrackingStore
from tasks.ppo_update import prune_optimizer_states
from tasks.records import optional_upstream_result, recorded_result, upstream_names, upstream_result
from tasks.stage import StageResult
from tasks.text import load_tokenizer, same_tokenizer

CONFIG_ARTIFACT = "config.json"


@dataclass(frozen=True)
class IterationState:
    """What one iteration hands the next: the policy (actor, and critic if any), the reward model and all
    pairs so far (none with a reward function), and its scored experience (where the adaptive KL
    coefficient comes from)."""

    policy: StageResult
    reward_model: StageResult | None = None
    preferences: tuple[StageResult, ...] = ()
    advantages: StageResult | None = None


@dataclass(frozen=True)
class ReplayInputs:
    """What a replay reuses from its source iteration: the experience, the policy it was rolled out with,
    the reward model that scored it (None for a reward function), and the previous iteration's scored
    experience (None in iteration 0), whose adaptive KL coefficient the source started from."""

    experience: StageResult
    policy: StageResult
    reward_model: StageResult | None
    previous: StageResult | None


def tracking_store(config: PipelineConfig) -> TrackingStore:
    """The MLflow store of ``config``: its tracking URI, or SQLite at ``run_root/mlflow.db``."""
    root = artifact_root(config)
    return TrackingStore(
        uri=tracking_uri(config), artifact_root=None if root is None else str(root), ui_url=config.tracking_ui_url
    )


def execution_of(config: PipelineConfig) -> Execution:
    return Execution(
        device=config.device,
        torch_threads=config.torch_threads,
        checkpoint_seconds=config.checkpoint_seconds,
        gradient_checkpointing=config.model.gradient_checkpointing,
        task_runner=config.execution.task_runner,
        address=config.execution.address,
        training_processes=config.execution.training_processes,
        accelerate_config=None
        if config.execution.accelerate_config is None
        else str(config.execution.accelerate_config),
        frozen_model_bytes=int(config.execution.frozen_models_gb * 2**30),
    )


@task(name="resolve_base", cache_policy=NO_CACHE)
def resolve_base(config: PipelineConfig) -> BaseInputs:
    """Locate (or build, for the embedded demo) the initial policy, tokenizer and prompts, identify each by
    its content (:func:`flows.identity.base_inputs`), and refuse any the stages could not use.

    Raises:
        FileNotFoundError: an input does not exist.
        InputError: an input cannot be used (see :func:`flows.inputs.check_inputs`).
    """
    world = None
    if uses_demo_world(config):
        from demo.build import build_default_world

        world = build_default_world(demo_world_dir(config), seed=0)
    check_inputs(config, base_inputs(config, None, world))  # before hashing the model: a refusal reads no weights
    cache = fingerprint_cache(config)
    base = base_inputs(config, cache, world)
    if config.model.critic_init == "reward_model" and not same_tokenizer(
        load_tokenizer(base.tokenizer.path), load_tokenizer(base.reward_tokenizer)
    ):
        raise InputError(
            f"`model.critic_init` reward_model needs a reward model that uses the policy's tokenizer (the critic reads "
            f"the policy's tokens); {config.model.reward_model} has a tokenizer of its own: use critic_init policy"
        )
    cache.save()  # only for inputs that pass: a refused command writes nothing
    return base


def _flow_run_id() -> str | None:
    try:
        return str(get_run_context().task_run.flow_run_id)
    except Exception:  # noqa: BLE001 - outside a Prefect run there is simply no id
        return None


CAMPAIGN_FREE = (
    *EXECUTION,
    *LOCATION,
    *replayable_fields(),
    "iterations",
    *(f"human.{name}" for name in HumanLabelConfig.model_fields),
)
"""Fields a campaign may be run with differently from one command to the next: where and how it runs, what a
replay may change (the advantage and PPO settings, as a schedule would), how many iterations, and how the
human-label forms are shown. Every other field (the model, data, labeler, reward, sampling, sizes) defines it."""


def campaign_fields(config: PipelineConfig) -> dict:
    """The fields that define ``config``'s campaign (all but :data:`CAMPAIGN_FREE`), as JSON values."""
    return fields_without(config, CAMPAIGN_FREE)


def _leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    """``{dotted path: value}`` of every leaf of a nested dict."""
    leaves: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            leaves.update(_leaves(value, f"{prefix}{key}."))
        else:
            leaves[prefix + key] = value
    return leaves


def check_campaign_config(config: PipelineConfig, tracker: Tracker) -> str:
    """Refuse ``config`` if its campaign was started with a config that differs in a field defining it.

    Returns:
        The config's campaign fingerprint (what the campaign's experiment records as
        ``rlhf.config_fingerprint``).

    Raises:
        ConfigError: naming the first differing fields, their values there and here, and what to do.
    """
    fields = campaign_fields(config)
    fingerprint = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    tags = tracker.experiment_tags(config.campaign)
    recorded = tags.get(TAG_CONFIG_FINGERPRINT)
    if recorded is None or recorded == fingerprint:
        return fingerprint
    theirs, ours = _leaves(json.loads(tags.get(TAG_CAMPAIGN_CONFIG, "{}"))), _leaves(fields)
    differing = sorted(name for name in theirs.keys() | ours.keys() if theirs.get(name) != ours.get(name))
    shown = "; ".join(f"`{name}` {theirs.get(name)!r} there, {ours.get(name)!r} here" for name in differing[:3])
    more = f"; and {len(differing) - 3} more" if len(differing) > 3 else ""
    raise ConfigError(
        f"campaign `{config.campaign}` was started with another config ({shown or 'another version'}{more}): give "
        "this config a `campaign` of its own (--set campaign=NAME), or run the campaign with the config it was "
        "started with"
    )


def record_campaign_config(config: PipelineConfig, tracker: Tracker, experiment_id: str) -> None:
    """Check ``config`` against its campaign's (:func:`check_campaign_config`); the first one is remembered."""
    fingerprint = check_campaign_config(config, tracker)
    if TAG_CONFIG_FINGERPRINT not in tracker.experiment_tags(config.campaign):
        tracker.set_experiment_tags(
            experiment_id,
            {
                TAG_CAMPAIGN_CONFIG: json.dumps(campaign_fields(config), sort_keys=True),
                TAG_CONFIG_FINGERPRINT: fingerprint,
            },
        )


def context_for(
    config: PipelineConfig,
    iteration: int,
    base: BaseInputs,
    experiment_id: str,
    *,
    parent_run_id: str | None = None,
    flow_run_id: str | None = None,
    register_models: bool = True,
) -> StageContext:
    """The stage context of one iteration of ``config``'s campaign."""
    return StageContext(
        layout=campaign_layout(config),
        tracking=tracking_store(config),
        campaign=config.campaign,
        experiment_id=experiment_id,
        iteration=iteration,
        seed=config.seed,
        base=base,
        execution=execution_of(config),
        parent_run_id=parent_run_id,
        flow_run_id=flow_run_id,
        register_models=register_models,
    )


def _open_run(
    config: PipelineConfig, iteration: int, base: BaseInputs, *, key: str, name: str, tags: dict[str, str]
) -> StageContext:
    """The MLflow run for exactly these inputs (finished, or reopened if it failed or was killed), or a new one,
    as a stage context.

    Runs of the campaign left RUNNING by a process that died are marked KILLED first, so whatever
    this attempt does not reopen or finish is not left looking alive.
    """
    tracker = tracking_store(config).tracker()
    experiment_id = tracker.experiment_id(config.campaign)
    if tags[TAG_KIND] == KIND_ITERATION:  # a replay's config is its source's, changed where a replay may change it
        record_campaign_config(config, tracker, experiment_id)
    tracker.reconcile_runs(experiment_id)
    parent = tracker.find_run(experiment_id, tags={TAG_ITERATION_KEY: key})
    flow_run_id = _flow_run_id()
    if parent is None:
        all_tags = {TAG_CAMPAIGN: config.campaign, TAG_ITERATION: str(iteration), TAG_ITERATION_KEY: key, **tags}
        parent = tracker.start_run(experiment_id, name=name, tags={**all_tags, TAG_FLOW_RUN_ID: flow_run_id or ""})
    elif tracker.run_status(parent) != "FINISHED":
        tracker.reopen_run(parent)
        tracker.set_tags(parent, {TAG_FLOW_RUN_ID: flow_run_id or ""})
    if tracker.run_status(parent) != "FINISHED":
        # Again on a reopened run: the attempt that created it may have died before logging these.
        # Params it has are kept (execution settings, which may differ, are params too).
        tracker.log_params(parent, config.model_dump(mode="json"), skip_logged=True)
        tracker.log_text(parent, config.model_dump_json(indent=2), CONFIG_ARTIFACT)
    return context_for(
        config,
        iteration,
        base,
        experiment_id,
        parent_run_id=parent,
        flow_run_id=flow_run_id,
        register_models=tags[TAG_KIND] == KIND_ITERATION,
    )


@task(name="open_iteration", cache_policy=NO_CACHE)
def open_iteration(
    config: PipelineConfig, iteration: int, base: BaseInputs, state: IterationState | None
) -> StageContext:
    """The iteration's MLflow parent run: the one for these exact inputs if it exists, or a new one."""
    previous = "" if state is None else state.policy.digest
    return _open_run(
        config,
        iteration,
        base,
        key=run_key(config, base, previous, iteration),
        name=f"iteration-{iteration}",
        tags={TAG_KIND: KIND_ITERATION, TAG_STARTING_POINT: starting_point(base, previous, iteration)},
    )


@task(name="open_replay", cache_policy=NO_CACHE)
def open_replay(config: PipelineConfig, source_run_id: str, base: BaseInputs) -> StageContext:
    """A new run tagged with the iteration run it replays (the same one again for the same settings)."""
    iteration = int(tracking_store(config).tracker().run_tags(source_run_id)[TAG_ITERATION])
    return _open_run(
        config,
        iteration,
        base,
        key=run_key(config, base, "replay", source_run_id),
        name=f"replay-of-iteration-{iteration}",
        tags={TAG_KIND: KIND_REPLAY, TAG_REPLAY_OF: source_run_id},
    )


@task(name="close_iteration", cache_policy=NO_CACHE)
def close_iteration(
    context: StageContext, stages: list[StageResult], state: IterationState, *, initialized: StageResult | None = None
) -> IterationState:
    """Log every stage's metrics on the iteration run, finish it, and leave a Prefect summary artifact.

    An iteration whose stages were all reused and whose run is already finished logs nothing new. An iteration
    run also gets its reuse record (:mod:`flows.reuse`): ``stages`` and, in the campaign's first iteration, the
    ``initialized`` policy it started from.
    """
    tracker = context.tracker
    tags = tracker.run_tags(context.parent_run_id)
    kind = tags.get(TAG_KIND, KIND_ITERATION)
    metrics = {f"{result.stage}/{name}": value for result in stages for name, value in result.metrics.items()}
    figure = _overoptimisation(context, metrics) if kind == KIND_ITERATION else None
    if not all(result.reused for result in stages) or tracker.run_status(context.parent_run_id) != "FINISHED":
        tracker.log_metrics(context.parent_run_id, metrics, step=context.iteration, skip_logged=True)
        tracker.set_tags(context.parent_run_id, {f"{TAG_OUTPUT_PREFIX}{r.stage}": r.run_id for r in stages})
        if figure is not None:
            tracker.log_figure(context.parent_run_id, figure, FIGURE_FILE)
        tracker.end_run(context.parent_run_id)
    if kind == KIND_ITERATION:
        if tags.get(TAG_REUSE) != (record := reuse_record(context.base, [*filter(None, [initialized]), *stages])):
            tracker.set_tags(context.parent_run_id, {TAG_REUSE: record})
    _prune_optimizer_states(context, stages, kind=kind)
    create_markdown_artifact(
        key=f"{context.campaign.lower().replace('_', '-').replace('.', '-')}-{kind}-{context.iteration}",
        markdown=iteration_summary(
            context,
            stages,
            tracker.run_url(context.parent_run_id),
            kind=kind,
            figure=None if figure is None else png_data_uri(figure),
        ),
        description=f"RLHF {kind} {context.iteration} of campaign {context.campaign}",
    )
    return state


def _overoptimisation(context: StageContext, metrics: dict[str, float]):
    """The campaign's over-optimisation figure up to this iteration (:mod:`flows.figures`): the iterations before
    it as MLflow recorded them, and this one's ``metrics``."""
    earlier = [row for row in context.tracker.iteration_metrics(context.experiment_id) if row[0] < context.iteration]
    return overoptimisation_figure([*earlier, (context.iteration, metrics)], campaign=context.campaign)


def _prune_optimizer_states(context: StageContext, stages: list[StageResult], *, kind: str) -> None:
    """Keep optimizer states only where continuing needs them: the newest finished iteration's PPO output.

    A replay's own PPO output is never continued, so a replay prunes just that one; an iteration
    (which holds the campaign lock) prunes every other PPO output of the campaign.
    """
    if kind == KIND_REPLAY:
        folders, keep = [result.directory for result in stages if result.stage == "ppo_update"], None
    else:
        tracker = context.tracker
        latest = tracker.latest_iteration(context.experiment_id)
        parent = tracker.find_run(
            context.experiment_id, tags={TAG_KIND: KIND_ITERATION, TAG_ITERATION: str(latest)}, status="FINISHED"
        )
        run_id = stage_run(context, parent, "ppo_update")
        folders = context.layout.stage_outputs("ppo_update")
        keep = context.layout.stage_dir("ppo_update", tracker.run_tags(run_id)[TAG_INPUT_KEY])
    freed = prune_optimizer_states(folders, keep=keep)
    if freed:
        get_run_logger().info("pruned %.1f MB of optimizer states no iteration continues from", freed / 2**20)


def iteration_summary(
    context: StageContext,
    stages: list[StageResult],
    run_url: str,
    *,
    kind: str = KIND_ITERATION,
    figure: str | None = None,
) -> str:
    """Markdown: the MLflow link, one row per stage (ran or reused, seconds), the over-optimisation figure (``figure``:
    an image URL, a ``data:`` URI so it shows without any server), then every metric on a row of its own (one cell
    per value, so the UI cuts none off)."""
    lines = [
        f"# Campaign `{context.campaign}`, {kind} {context.iteration}",
        "",
        f"MLflow run: [{context.parent_run_id}]({run_url})",
        "",
        "| stage | status | seconds |",
        "| --- | --- | ---: |",
    ]
    for result in stages:
        seconds = result.metrics.get("seconds")
        took = "" if result.reused or seconds is None else f"{seconds:.1f}"
        lines.append(f"| {result.stage} | {'reused' if result.reused else 'ran'} | {took} |")
    if figure is not None:
        lines += ["", f"![over-optimisation: reward and gold score against the KL to the reference]({figure})"]
    lines += ["", "| metric | value |", "| --- | ---: |"]
    for result in stages:
        lines += [f"| {result.stage}/{name} | {value:.4g} |" for name, value in sorted(result.metrics.items())]
    return "\n".join(lines) + "\n"


def stage_run(context: StageContext, parent_run_id: str, stage: str, *, required: bool = True) -> str | None:
    """The stage run whose output an iteration (or replay) run used: its own, or a reused one.

    Raises:
        LookupError: the run records none and ``required`` is set (else None is returned: an
            iteration with a reward function has no reward-model stage).
    """
    tracker = context.tracker
    run_id = tracker.run_tags(parent_run_id).get(f"{TAG_OUTPUT_PREFIX}{stage}") or tracker.find_run(
        context.experiment_id, tags={TAG_PARENT_RUN_ID: parent_run_id, TAG_STAGE: stage}, status="FINISHED"
    )  # runs recorded before the output tags existed: their own nested stage run
    if run_id is None and required:
        raise LookupError(f"run {parent_run_id} records no finished {stage!r} output")
    return run_id


@task(name="load_replay_inputs", cache_policy=NO_CACHE)
def load_replay_inputs(config: PipelineConfig, source_run_id: str, base: BaseInputs) -> ReplayInputs:
    """What the source iteration's stages 5-7 started from (see :class:`ReplayInputs`), found through MLflow.

    Opens no run, so a replay can check these before it records anything.
    """
    tracker = tracking_store(config).tracker()
    iteration = int(tracker.run_tags(source_run_id)[TAG_ITERATION])
    context = context_for(config, iteration, base, tracker.experiment_id(config.campaign))
    experience = recorded_result(context, stage_run(context, source_run_id, "rollout"))
    scored = recorded_result(context, stage_run(context, source_run_id, "compute_advantages"))
    return ReplayInputs(
        experience=experience,
        policy=upstream_result(context, experience, "policy"),
        reward_model=optional_upstream_result(context, experience, "reward_model"),
        previous=optional_upstream_result(context, scored, "previous"),
    )


def source_config(config: PipelineConfig, source_run_id: str) -> PipelineConfig:
    """The config an iteration run was made with (stored beside it as ``config.json``)."""
    return PipelineConfig.model_validate_json(
        tracking_store(config).tracker().load_text(source_run_id, CONFIG_ARTIFACT)
    )


@task(name="load_latest_state", cache_policy=NO_CACHE)
def load_latest_state(config: PipelineConfig, base: BaseInputs) -> tuple[int, IterationState | None]:
    """Where a campaign stands in MLflow: the next iteration to run and the state to run it from (the state
    after its newest finished iteration run, :func:`_state_after`)."""
    tracker = tracking_store(config).tracker()
    experiment_id = tracker.experiment_id(config.campaign)
    latest = tracker.latest_iteration(experiment_id)
    if latest is None:
        return 0, None
    parent = tracker.find_run(
        experiment_id, tags={TAG_KIND: KIND_ITERATION, TAG_ITERATION: str(latest)}, status="FINISHED"
    )
    return latest + 1, _state_after(config, base, latest, parent)


def finished_otherwise(
    config: PipelineConfig, base: BaseInputs, iteration: int, state: IterationState | None
) -> IterationState | None:
    """The state after ``iteration`` as the campaign finished it with other settings from the same starting
    point (:func:`starting_point`); None when the campaign has not finished it, finished it with ``config``'s
    settings (running it again reuses and re-verifies its outputs) or from another starting point (base inputs
    edited in place, or a run older than the tag: it runs again, from what it starts from now).

    An iteration number names one finished iteration of a campaign: ``demo:3`` must mean one run. A campaign
    run with other settings that may change from one command to the next (``advantages.*``, ``ppo.*``, as a
    schedule changes them, and ``iterations``, which is part of the runs' key) therefore keeps the iterations it
    finished as they are, and the new settings apply from its first unfinished iteration on; ``rlhf replay``
    re-runs a finished one with them.
    """
    tracker = tracking_store(config).tracker()
    experiment_id = tracker.experiment_id(config.campaign)
    parent = tracker.find_run(
        experiment_id, tags={TAG_KIND: KIND_ITERATION, TAG_ITERATION: str(iteration)}, status="FINISHED"
    )
    if parent is None:
        return None
    previous = "" if state is None else state.policy.digest
    tags = tracker.run_tags(parent)
    if tags.get(TAG_ITERATION_KEY) == run_key(config, base, previous, iteration):
        return None
    if tags.get(TAG_STARTING_POINT) != starting_point(base, previous, iteration):
        return None
    return _state_after(config, base, iteration, parent)


def _state_after(config: PipelineConfig, base: BaseInputs, iteration: int, parent: str) -> IterationState:
    """The state after the finished iteration run ``parent``: its PPO output (actor, and critic if any), its
    scored experience, its reward model and every preference table that reward model was trained on (none
    when a reward function scored that iteration)."""
    tracker = tracking_store(config).tracker()
    context = context_for(config, iteration, base, tracker.experiment_id(config.campaign))
    policy = recorded_result(context, stage_run(context, parent, "ppo_update"))
    advantages = recorded_result(context, stage_run(context, parent, "compute_advantages"))
    reward_model_run = stage_run(context, parent, "train_reward_model", required=False)
    reward_model, preferences = None, ()
    if reward_model_run is not None:
        reward_model = recorded_result(context, reward_model_run)
        names = upstream_names(reward_model, prefix="preferences_")
        preferences = tuple(upstream_result(context, reward_model, name) for name in names)
    return IterationState(policy, reward_model, preferences, advantages)
