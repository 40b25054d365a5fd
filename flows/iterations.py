"""The flows' own steps around the stages: resolve the base inputs, open and close an iteration's
MLflow run, and rebuild a campaign's state from MLflow (to continue it or replay it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import polars as pl
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context

from campaign.config import PipelineConfig
from campaign.history import provenance
from campaign.identity import (
    base_inputs,
    demo_world_dir,
    fingerprint_cache,
    record_campaign_config,
    run_key,
    uses_demo_world,
)
from campaign.store import CONFIG_ARTIFACT, artifact_root, campaign_layout, stage_run, store_layout, tracking_uri
from flows.figures import FIGURE_FILE, overoptimisation_figure, png_bytes, png_data_uri
from flows.inputs import InputError, check_inputs
from flows.inspection import (
    ITERATION_RUN,
    TOP_PAIRS,
    TOP_RESPONSES,
    inspect_run,
    stage_outputs,
    summary_from_metrics,
)
from flows.lineage import artifact_key, create_lineage_artifact
from runtime.cluster import cluster_address
from runtime.context import BaseInputs, Execution, InputFile, StageContext, TrackingStore
from runtime.declaration import StageResult
from runtime.engine import engine_identity, ensure_engine
from runtime.records import optional_upstream_result, recorded_result, upstream_names, upstream_result
from runtime.threads import command_threads
from storage.diagnostics import describe_flag, drift_flags
from storage.mlflow_store import RunSummary
from storage.tracking import (
    KIND_ITERATION,
    KIND_REPLAY,
    KIND_STAGE,
    TAG_CAMPAIGN,
    TAG_FLOW_RUN_ID,
    TAG_INPUT_KEY,
    TAG_ITERATION,
    TAG_ITERATION_KEY,
    TAG_KIND,
    TAG_MANIFEST_DIGEST,
    TAG_OUTPUT_PREFIX,
    TAG_REPLAY_OF,
    TAG_SUPERSEDED_BY,
)
from tasks.ppo_update import prune_optimizer_states
from tasks.text import load_tokenizer, same_tokenizer


@dataclass(frozen=True)
class IterationState:
    """What one iteration hands the next: the policy (actor, and critic if any), the reward model and all
    pairs so far (none with a reward function), its scored experience (where the adaptive KL
    coefficient comes from), and with ``sampling.staleness`` N the N policies before ``policy`` (``earlier``, oldest
    first), one of which the next iteration's generation stages sample from."""

    policy: StageResult
    reward_model: StageResult | None = None
    preferences: tuple[StageResult, ...] = ()
    advantages: StageResult | None = None
    earlier: tuple[StageResult, ...] = ()

    def sampler(self, staleness: int) -> StageResult:
        """The policy ``staleness`` versions behind ``policy`` (the oldest kept, the campaign's initial one, when
        there are fewer): what the next iteration's generation stages sample from."""
        chain = (*self.earlier, self.policy)
        return chain[max(0, len(chain) - 1 - staleness)]

    def after(self, policy: StageResult, *, staleness: int, **handed: object) -> IterationState:
        """The state after an iteration that made ``policy`` from this one (and ``handed`` on the rest)."""
        chain = (*self.earlier, self.policy)
        earlier = chain[max(0, len(chain) - staleness) :] if staleness else ()
        return IterationState(policy, earlier=earlier, **handed)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Front:
    """An iteration's generation side (stages 1-4): its stage outputs in order, the reward model that scores it and
    every preference table so far (None and none with a reward function), and its rollout."""

    stages: tuple[StageResult, ...]
    reward_model: StageResult | None
    preferences: tuple[StageResult, ...]
    experience: StageResult


@dataclass(frozen=True)
class ReplayInputs:
    """What a replay reuses from its source iteration: the experience, the policy its update started from (the one
    that sampled the experience, or with ``sampling.staleness`` a newer one), the reward model that scored it (None
    for a reward function), and the previous iteration's scored experience (None in iteration 0), whose adaptive KL
    coefficient the source started from, and the values its starting critic gave the experience where the rollout's
    came from an older policy's critic (a ``critic_values`` output; None elsewhere), which its stage 5 read. A DPO
    iteration's experience is its pairs with the reference's log-probs (a ``reference_logprobs`` output), and it has
    no reward model or scored experience."""

    experience: StageResult
    policy: StageResult
    reward_model: StageResult | None
    previous: StageResult | None
    critic_values: StageResult | None = None


def tracking_store(config: PipelineConfig) -> TrackingStore:
    """The MLflow store of ``config``: its tracking URI, or SQLite at ``run_root/mlflow.db``."""
    root = artifact_root(config)
    return TrackingStore(
        uri=tracking_uri(config), artifact_root=None if root is None else str(root), ui_url=config.tracking_ui_url
    )


def campaign_threads(config: PipelineConfig, policy: str, *, keep: bool = True) -> int:
    """The torch threads of ``config``'s stages (and of the engine it starts) for the initial ``policy``: chosen once
    per campaign and machine under ``auto``, and recorded with ``keep`` (:func:`runtime.threads.command_threads`)."""
    record = campaign_layout(config).threads_file()
    return command_threads(config.execution.torch_threads, policy, record=record, keep=keep)


def generation_engine(config: PipelineConfig, policy: str) -> str | None:
    """The URL of the generation engine ``config``'s stages sample on, started (serving ``policy`` first, on the
    campaign's threads) unless it runs already (:func:`runtime.engine.ensure_engine`); None with ``sampling.engine:
    hf``."""
    if config.sampling.engine != "vllm":
        return None
    lora = config.model.lora
    rank = None if lora is None else lora.r
    threads = campaign_threads(config, policy, keep=False)  # recorded by the stages', once the engine runs
    return ensure_engine(config.execution, precision=config.precision, lora_rank=rank, policy=policy, threads=threads)


def execution_of(config: PipelineConfig, base: BaseInputs) -> Execution:
    """How ``config``'s stages run: on the cluster a :func:`runtime.cluster.cluster` block started or
    ``execution.address`` names, with the generation engine (:func:`generation_engine`), and
    ``execution.torch_threads: auto`` chosen from the policy's size and this machine's idle cores once per campaign
    and machine (:mod:`runtime.threads`)."""
    execution = config.execution
    engine_url = generation_engine(config, base.policy.path)
    return Execution(
        device=execution.device,
        torch_threads=campaign_threads(config, base.policy.path),
        checkpoint_seconds=execution.checkpoint_seconds,
        gradient_checkpointing=execution.gradient_checkpointing,
        task_runner=execution.task_runner,
        address=cluster_address(execution),
        training_processes=execution.training_processes,
        accelerate_config=None if execution.accelerate_config is None else str(execution.accelerate_config),
        training_launcher=execution.training_launcher,
        rendezvous_timeout=execution.rendezvous_timeout,
        sharding=execution.sharding,
        frozen_model_bytes=int(execution.frozen_models_gb * 2**30),
        engine_url=engine_url,
        engine=None if engine_url is None else engine_identity(engine_url),
    )


@task(name="resolve_base", cache_policy=NO_CACHE)
def resolve_base(config: PipelineConfig, *, checked: bool = False) -> BaseInputs:
    """Locate (or build, for the embedded demo) the initial policy, tokenizer and prompts, identify each by
    its content (:func:`campaign.identity.base_inputs`), and refuse any the stages could not use, unless
    ``checked``: the command already ran :func:`flows.inputs.check_inputs`' two halves on the same inputs.

    Raises:
        FileNotFoundError: an input does not exist.
        InputError: an input cannot be used (see :func:`flows.inputs.check_inputs`).
    """
    world = None
    if uses_demo_world(config):
        from demo.build import build_default_world

        world = build_default_world(demo_world_dir(config), seed=0)
    cache = fingerprint_cache(config)
    base = base_inputs(config, cache, world)
    if not checked:  # the command checked these same inputs before it loaded anything (flows.cli)
        check_inputs(config, base)
    if config.model.critic_init == "reward_model" and not same_tokenizer(
        load_tokenizer(base.tokenizer.path), load_tokenizer(base.reward_tokenizer)
    ):
        raise InputError(
            f"`model.critic_init` reward_model needs a reward model that uses the policy's tokenizer (the critic reads "
            f"the policy's tokens); {config.model.reward_model} has a tokenizer of its own: use critic_init policy"
        )
    cache.save()  # only for inputs that pass: a refused command writes nothing
    return base


def supervised_base(config: PipelineConfig, base: BaseInputs, *, in_flow: bool = True) -> BaseInputs:
    """``base`` with the output of the SFT stage (``sft.data``; run, or reused when its inputs and code are unchanged)
    as the campaign's initial policy and reference (:meth:`runtime.context.BaseInputs.supervised`); ``base`` itself
    without SFT data, or once it is the SFT output. Before an iteration opens its run, whose key names the policy.
    ``in_flow``: the stage runs as a task of the calling flow; False: in this process with no task run (a command
    outside a flow, ``rlhf export``)."""
    if not base.awaits_sft:
        return base
    from tasks.sft import sft

    tracker = tracking_store(config).tracker()
    context = context_for(config, 0, base, tracker.experiment_id(config.campaign))
    tuned = _recorded_sft(context) or (sft(context, config) if in_flow else sft.run(context, config))
    return base.supervised(InputFile(path=str(tuned.directory / "actor"), sha256=tuned.digest))


def _recorded_sft(context: StageContext) -> StageResult | None:
    """The SFT output a campaign with a finished iteration started from (iteration 0's ``initialize`` names it), kept
    as it is whatever code computes an SFT now, as the finished iterations made from it are (a campaign is history);
    None before any iteration finished."""
    finished = context.tracker.finished_iterations(context.experiment_id)
    if not finished:
        return None
    first = finished[min(finished)].run_id
    start = recorded_result(context, stage_run(context.tracker, context.experiment_id, first, "initialize"))
    return optional_upstream_result(context, start, "sft")


def sft_output(context: StageContext) -> StageResult | None:
    """The SFT output that ``context``'s initial policy is (:func:`supervised_base`), found by its digest; None for a
    campaign without SFT."""
    if context.base.pretrained is None:
        return None
    digest = context.base.policy.sha256
    run_id = context.tracker.find_run(
        context.experiment_id, tags={TAG_MANIFEST_DIGEST: digest, TAG_KIND: KIND_STAGE}, status="FINISHED"
    )
    if run_id is None:
        raise LookupError(f"no finished sft run in MLflow holds the output {digest[:16]}")
    return recorded_result(context, run_id)


def _flow_run_id() -> str | None:
    try:
        return str(get_run_context().task_run.flow_run_id)
    except Exception:  # noqa: BLE001 - outside a Prefect run there is simply no id
        return None


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
        execution=execution_of(config, base),
        parent_run_id=parent_run_id,
        flow_run_id=flow_run_id,
        register_models=register_models,
        fingerprints=store_layout(config).fingerprint_cache(),
    )


def _open_run(
    config: PipelineConfig,
    iteration: int,
    base: BaseInputs,
    *,
    key: str,
    name: str,
    tags: dict[str, str],
    fresh: bool = False,
) -> StageContext:
    """The MLflow run for exactly these inputs (finished, or reopened if it failed or was killed), or a new one,
    as a stage context. With ``fresh``, a finished run is not taken: the run recomputes it (and supersedes it).

    Runs of the campaign left RUNNING by a process that died are marked KILLED first, so whatever
    this attempt does not reopen or finish is not left looking alive.
    """
    tracker = tracking_store(config).tracker()
    experiment_id = tracker.experiment_id(config.campaign)
    if tags[TAG_KIND] == KIND_ITERATION:  # a replay's config is its source's, changed where a replay may change it
        record_campaign_config(config, tracker, experiment_id)
    tracker.reconcile_runs(experiment_id)
    parent = next(
        (
            run.run_id
            for run in tracker.runs(experiment_id, tags={TAG_ITERATION_KEY: key})
            if TAG_SUPERSEDED_BY not in run.tags and not (fresh and run.status == "FINISHED")
        ),
        None,
    )
    flow_run_id = _flow_run_id()
    if parent is None:
        all_tags = {TAG_CAMPAIGN: config.campaign, TAG_ITERATION: str(iteration), TAG_ITERATION_KEY: key, **tags}
        parent = tracker.start_run(experiment_id, name=name, tags={**all_tags, TAG_FLOW_RUN_ID: flow_run_id or ""})
    elif tracker.run(parent).status != "FINISHED":
        tracker.reopen_run(parent)
        tracker.set_tags(parent, {TAG_FLOW_RUN_ID: flow_run_id or ""})
    if tracker.run(parent).status != "FINISHED":
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
    config: PipelineConfig, iteration: int, base: BaseInputs, state: IterationState | None, *, fresh: bool = False
) -> StageContext:
    """The iteration's MLflow parent run: the one for these exact inputs if it exists (unless ``fresh``: an
    iteration recomputed on request), or a new one."""
    previous = "" if state is None else state.policy.digest
    return _open_run(
        config,
        iteration,
        base,
        key=run_key(config, base, previous, iteration),
        name=f"iteration-{iteration}",
        tags={TAG_KIND: KIND_ITERATION},
        fresh=fresh,
    )


@task(name="open_replay", cache_policy=NO_CACHE)
def open_replay(config: PipelineConfig, source_run_id: str, base: BaseInputs) -> StageContext:
    """A new run tagged with the iteration run it replays (the same one again for the same settings)."""
    iteration = int(tracking_store(config).tracker().run(source_run_id).tags[TAG_ITERATION])
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
    context: StageContext,
    stages: list[StageResult],
    state: IterationState,
    *,
    experience: StageResult | None = None,
    metrics: Mapping[str, float] | None = None,
) -> IterationState:
    """Log every stage's metrics, the iteration's own ``metrics`` (its rounds of candidates, :mod:`flows.rounds`) and
    the inspection of its experience (:mod:`flows.inspection`) on the iteration run, finish it, and leave a Prefect
    summary artifact.

    An iteration whose stages were all reused and whose run is already finished logs nothing new. An iteration
    run also records what produced it (:func:`campaign.history.provenance`) and, when it was not finished already,
    supersedes every other finished run of its iteration and the ones after it (:func:`_supersede`). A replay
    names the ``experience`` it replayed (its source's rollout).
    """
    tracker = context.tracker
    parent = tracker.run(context.parent_run_id)
    tags = parent.tags
    kind = tags.get(TAG_KIND, KIND_ITERATION)
    was_finished = parent.status == "FINISHED"
    own = dict(metrics or {})
    metrics = {f"{result.stage}/{name}": value for result in stages for name, value in result.metrics.items()} | own
    figure = png_bytes(_overoptimisation(context, metrics)) if kind == KIND_ITERATION else None
    inspection = None
    if not all(result.reused for result in stages) or not was_finished:
        outputs = [*filter(None, [experience]), *stages]
        if any(result.stage in ("rollout", "reference_logprobs") for result in outputs):  # rollouts, or DPO pairs
            inspected, responses = _log_inspection(context, outputs, kind=kind)
            inspection = _inspection_summary(context, inspected, responses, kind=kind)
            metrics |= inspected
        tracker.log_metrics(context.parent_run_id, metrics, step=context.iteration, skip_logged=True)
        tracker.set_tags(context.parent_run_id, {f"{TAG_OUTPUT_PREFIX}{r.stage}": r.run_id for r in stages})
        if figure is not None:
            tracker.log_bytes(context.parent_run_id, figure, FIGURE_FILE)
        tracker.end_run(context.parent_run_id)
    if kind == KIND_ITERATION:
        record = provenance(context.base, context.execution.engine_vllm)
        if any(tags.get(name) != value for name, value in record.items()):
            tracker.set_tags(context.parent_run_id, record)
        if not was_finished:
            _supersede(context)
    _prune_optimizer_states(context, stages, kind=kind)
    create_markdown_artifact(
        key=artifact_key(context.campaign, kind, context.iteration),
        markdown=iteration_summary(
            context,
            stages,
            tracker.run_url(context.parent_run_id),
            kind=kind,
            figure=None if figure is None else png_data_uri(figure),
            inspection=inspection,
            metrics=own,
        ),
        description=f"RLHF {kind} {context.iteration} of campaign {context.campaign}",
    )
    create_lineage_artifact(context, [*filter(None, [experience]), *stages], kind=kind)
    return state


def _supersede(context: StageContext) -> None:
    """Tag every finished iteration run of ``context``'s iteration and later ones, other than its own, as
    superseded by it: a recomputed iteration replaces them, and what continued from them (``--from-iteration``)."""
    tracker = context.tracker
    for run in tracker.runs(context.experiment_id, tags={TAG_KIND: KIND_ITERATION}):
        replaced = run.status == "FINISHED" and int(run.tags[TAG_ITERATION]) >= context.iteration
        if replaced and run.run_id != context.parent_run_id and TAG_SUPERSEDED_BY not in run.tags:
            tracker.set_tags(run.run_id, {TAG_SUPERSEDED_BY: context.parent_run_id})


def _overoptimisation(context: StageContext, metrics: dict[str, float]):
    """The campaign's over-optimisation figure up to this iteration (:mod:`flows.figures`): the iterations before
    it as MLflow recorded them, and this one's ``metrics``."""
    earlier = [row for row in context.tracker.iteration_metrics(context.experiment_id) if row[0] < context.iteration]
    return overoptimisation_figure([*earlier, (context.iteration, metrics)], campaign=context.campaign)


def _log_inspection(
    context: StageContext, stages: list[StageResult], *, kind: str
) -> tuple[dict[str, float], pl.DataFrame]:
    """The run's ``inspect/*`` metrics and top responses (:func:`flows.inspection.inspect_run`); the responses go on the
    run as the table :data:`flows.inspection.TOP_RESPONSES` (a DPO run's pairs as :data:`flows.inspection.TOP_PAIRS`)."""
    run = ITERATION_RUN if kind == KIND_ITERATION else f"{KIND_REPLAY} {context.parent_run_id[:12]}"
    outputs = stage_outputs(
        {result.stage: result.directory for result in stages},
        iteration=context.iteration,
        run=run,
        run_id=context.parent_run_id,
    )
    metrics, responses = inspect_run(outputs)
    table = TOP_PAIRS if outputs.kind == "pairs" else TOP_RESPONSES
    context.tracker.log_table(context.parent_run_id, responses.to_dict(as_series=False), table)
    return metrics, responses


def _inspection_summary(
    context: StageContext, inspected: dict[str, float], responses: pl.DataFrame, *, kind: str
) -> str:
    """Markdown: the run's highest-scoring responses (where gaming shows first), where the rest are, and the campaign's
    drift warnings up to this iteration (from the ``inspect/*`` metrics its iteration runs logged). Written into the
    artifact itself, so it shows without an MLflow server."""
    shown = responses.head(TOP_SHOWN)
    command = f"`rlhf inspect {context.campaign}:{context.iteration} --top 10` in a terminal"
    if "reward_margin" in responses.columns:  # a DPO run's pairs
        lines = [
            f"Pairs of the widest implicit reward margin ({shown.height} of the {responses.height} in the MLflow "
            f"run's `{TOP_PAIRS}` table; {command}):",
            "",
            "| margin | chosen reward | rejected reward | chosen | rejected |",
            "| ---: | ---: | ---: | --- | --- |",
        ]
        for row in shown.iter_rows(named=True):
            lines.append(
                f"| {row['reward_margin']:.3g} | {row['rewards_chosen']:.3g} | {row['rewards_rejected']:.3g} | "
                f"{_cell_text(row['chosen'])} | {_cell_text(row['rejected'])} |"
            )
    else:
        lines = [
            f"Highest-scoring responses ({shown.height} of the {responses.height} in the MLflow run's "
            f"`{TOP_RESPONSES}` table; {command}):",
            "",
            "| score | reward | KL | length | response |",
            "| ---: | ---: | ---: | ---: | --- |",
        ]
        for row in shown.iter_rows(named=True):
            text = _cell_text(row["response"])
            lines.append(f"| {row['score']:.3g} | {row['reward']:.3g} | {row['kl']:.3g} | {row['length']} | {text} |")
    if kind == KIND_ITERATION:
        earlier = [
            row for row in context.tracker.iteration_metrics(context.experiment_id) if row[0] < context.iteration
        ]
        flags = drift_flags(summary_from_metrics([*earlier, (context.iteration, inspected)]))
        lines += ["", "Drift warnings (`rlhf inspect`, docs/inspect.md):" if flags else "Drift warnings: none."]
        lines += [f"- {flag.kind}: {describe_flag(flag)}" for flag in flags]
    return "\n".join(lines)


TOP_SHOWN = 5
"""Responses the Prefect iteration artifact shows."""


def _cell_text(text: str | None) -> str:
    """A response as one Markdown table cell: one line, no column break, at most 160 characters."""
    text = " ".join((text or "").split()).replace("|", "\\|")
    return text if len(text) <= 160 else text[:159] + "…"


def _prune_optimizer_states(context: StageContext, stages: list[StageResult], *, kind: str) -> None:
    """Keep optimizer states only where continuing needs them: the newest finished iteration's PPO output.

    A replay's own PPO output is never continued, so a replay prunes just that one; an iteration
    (which holds the campaign lock) prunes every other PPO output of the campaign.
    """
    if kind == KIND_REPLAY:
        folders, keep = [result.directory for result in stages if result.stage == "ppo_update"], None
    else:
        tracker = context.tracker
        newest = list(tracker.finished_iterations(context.experiment_id).values())[-1]
        run_id = stage_run(context.tracker, context.experiment_id, newest.run_id, "ppo_update", required=False)
        if run_id is None:  # a DPO iteration keeps no optimizer states
            return
        folders = context.layout.stage_outputs("ppo_update")
        keep = context.layout.stage_dir("ppo_update", tracker.run(run_id).tags[TAG_INPUT_KEY])
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
    inspection: str | None = None,
    metrics: Mapping[str, float] | None = None,
) -> str:
    """Markdown: the MLflow link, one row per stage (ran or reused, seconds), the over-optimisation figure (``figure``:
    an image URL, a ``data:`` URI so it shows without any server), the inspection of the experience
    (``inspection``), then every metric on a row of its own (one cell per value, so the UI cuts none off): the
    iteration's own ``metrics`` (its rounds), then each stage's."""
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
    if inspection is not None:
        lines += ["", inspection]
    lines += ["", "| metric | value |", "| --- | ---: |"]
    lines += [f"| {name} | {value:.4g} |" for name, value in sorted((metrics or {}).items())]
    for result in stages:
        lines += [f"| {result.stage}/{name} | {value:.4g} |" for name, value in sorted(result.metrics.items())]
    return "\n".join(lines) + "\n"


@task(name="load_replay_inputs", cache_policy=NO_CACHE)
def load_replay_inputs(config: PipelineConfig, source_run_id: str, base: BaseInputs) -> ReplayInputs:
    """What the source iteration's stages 5-7 started from (see :class:`ReplayInputs`), found through MLflow.

    Opens no run, so a replay can check these before it records anything.
    """
    tracker = tracking_store(config).tracker()
    iteration = int(tracker.run(source_run_id).tags[TAG_ITERATION])
    context = context_for(config, iteration, base, tracker.experiment_id(config.campaign))
    if config.update == "dpo":  # the pairs with the reference's log-probs stand where a rollout's experience would
        pairs = recorded_result(
            context, stage_run(context.tracker, context.experiment_id, source_run_id, "reference_logprobs")
        )
        update = recorded_result(
            context, stage_run(context.tracker, context.experiment_id, source_run_id, "dpo_update")
        )
        return ReplayInputs(pairs, upstream_result(context, update, "policy"), reward_model=None, previous=None)
    experience = recorded_result(context, stage_run(context.tracker, context.experiment_id, source_run_id, "rollout"))
    scored = recorded_result(
        context, stage_run(context.tracker, context.experiment_id, source_run_id, "compute_advantages")
    )
    update = recorded_result(context, stage_run(context.tracker, context.experiment_id, source_run_id, "ppo_update"))
    return ReplayInputs(
        experience=experience,
        policy=upstream_result(context, update, "policy"),
        reward_model=optional_upstream_result(context, experience, "reward_model"),
        previous=optional_upstream_result(context, scored, "previous"),
        critic_values=optional_upstream_result(context, scored, "critic_values"),
    )


@task(name="load_latest_state", cache_policy=NO_CACHE)
def load_latest_state(config: PipelineConfig, base: BaseInputs) -> tuple[int, IterationState | None]:
    """Where a campaign stands in MLflow: the next iteration to run and the state to run it from (the state
    after its newest finished iteration, :func:`_state_after`)."""
    tracker = tracking_store(config).tracker()
    finished = tracker.finished_iterations(tracker.experiment_id(config.campaign))
    if not finished:
        return 0, None
    latest, run = list(finished.items())[-1]
    return latest + 1, _state_after(config, base, latest, run.run_id)


def finished_state(config: PipelineConfig, base: BaseInputs, finished: RunSummary | None) -> IterationState | None:
    """The state after the ``finished`` run of an iteration (None for None): a finished iteration is history, kept
    as it is whatever code, input contents or settings that may change between commands (``advantages.*``,
    ``ppo.*``, ``iterations``) a later command brings; they apply from the first unfinished iteration on, and
    ``rlhf run --from-iteration`` or ``rlhf replay`` recompute a finished one with them."""
    if finished is None:
        return None
    return _state_after(config, base, int(finished.tags[TAG_ITERATION]), finished.run_id)


def _state_after(config: PipelineConfig, base: BaseInputs, iteration: int, parent: str) -> IterationState:
    """The state after the finished iteration run ``parent``: its PPO output (actor, and critic if any), its
    scored experience, its reward model and every preference table that reward model was trained on (none
    when a reward function scored that iteration), and the ``sampling.staleness`` policies before its PPO output (each
    update's input policy, back to the campaign's initial one)."""
    tracker = tracking_store(config).tracker()
    context = context_for(config, iteration, base, tracker.experiment_id(config.campaign))
    update = "dpo_update" if config.update == "dpo" else "ppo_update"
    policy = recorded_result(context, stage_run(context.tracker, context.experiment_id, parent, update))
    advantages_run = stage_run(context.tracker, context.experiment_id, parent, "compute_advantages", required=False)
    advantages = None if advantages_run is None else recorded_result(context, advantages_run)  # none with DPO
    reward_model_run = stage_run(context.tracker, context.experiment_id, parent, "train_reward_model", required=False)
    reward_model, preferences = None, ()
    if reward_model_run is not None:
        reward_model = recorded_result(context, reward_model_run)
        names = upstream_names(reward_model, prefix="preferences_")
        preferences = tuple(upstream_result(context, reward_model, name) for name in names)
    earlier: list[StageResult] = []
    while len(earlier) < config.sampling.staleness and (earlier or [policy])[0].stage == "ppo_update":
        earlier.insert(0, upstream_result(context, (earlier or [policy])[0], "policy"))
    return IterationState(policy, reward_model, preferences, advantages, earlier=tuple(earlier))
