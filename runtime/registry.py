"""The models a stage writes, as MLflow 3 keeps models: a logged model per checkpoint, registered versions, the metrics
computed with each model on named data, the best policy's alias; and the Prefect events that say so.

Called once per recorded stage run (:func:`record_models`, from :func:`runtime.record.record_stage`, before the run
ends), so everything here is as idempotent as the recording is.

Choices:

1. Each checkpoint folder a stage declares (its ``register`` table: the PPO update's ``actor`` and ``critic``, the
   reward model) becomes a logged model, in replays too, named ``<folder>-iteration-<n>`` (``-replay`` for a
   replay's) so the *Models* tab tells them apart: tagged with its campaign, iteration, stage run, folder
   and lineage (the digest of every upstream output, and the logged model it was trained from, where that one is
   a logged model). Only iterations register versions (``<campaign>-<suffix>``), linked to the logged model.
2. Metrics are linked to the model that produced them and the data they were computed on: the evaluation's to the
   evaluated actor, on the held-out prompts (``eval_prompts[:N]``, the first N of the file, digest the file's
   sha256); the reward model's held-out accuracy and loss to it, on the held-out pairs (digest over the preference
   outputs they were split from). MLflow's *Models* tab then compares policies on the same held-out prompts.
3. The registry alias ``best`` moves only when an evaluation is recorded: to the registered actor with the highest
   :data:`BEST_METRICS` figure on that same dataset (the gold win rate where a judge exists; with a learned reward
   model every iteration's reward is on another scale, so the reward mean is only the last resort). A version
   registered before this release has no logged model and is not ranked.
4. Events (:mod:`runtime.events`): a registered actor, critic or reward model, and a recorded evaluation, each with
   the campaign, iteration, digests and MLflow ids in its payload.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.assets import manifest_asset, manifest_iteration
from runtime.events import ITERATION_EVALUATED, registered_event, send_campaign_event
from storage.tracking import (
    KIND_ITERATION,
    TAG_CAMPAIGN,
    TAG_ITERATION,
    TAG_KIND,
    TAG_MODEL,
    TAG_PARENT_MODEL,
    TAG_UPSTREAM_PREFIX,
    Tracker,
)

if TYPE_CHECKING:
    from runtime.context import StageContext
    from storage.manifest import Manifest

BEST_ALIAS = "best"
BEST_METRICS = ("evaluate/gold_win_rate", "evaluate/rubric_mean", "evaluate/reward_mean")
"""What ranks evaluated policies for :data:`BEST_ALIAS`: the first of these an evaluation holds."""
EVALUATIONS = {"evaluate": "policy"}
"""``stage -> the upstream it evaluates`` (a policy: its actor is the model the metrics belong to)."""
MODEL_FIGURES = {"train_reward_model": ("reward_model", ("eval_accuracy", "eval_loss"))}
"""``stage -> (the model it trains, the held-out figures that belong to that model)``."""
PARENTS = {"actor": "policy", "critic": "policy", "reward_model": "previous"}
"""``model name -> the upstream holding the model it was trained from``."""
HEADLINE = (*BEST_METRICS, "evaluate/gold_mean", "evaluate/kl_to_reference")
"""Logged first, so the *Models* tab shows them in its first columns (it keeps the order metrics were logged in)."""
RUNTIME = ("seconds", "peak_memory_mb")
"""Metrics of how a stage ran, not of what it measured: left off the model (:mod:`runtime.stage` records them)."""


def record_models(
    context: StageContext, run_id: str, manifest: Manifest, stage_dir: Path, register: Mapping[str, str] | None
) -> None:
    """Record what a finished stage run says about models (see the module docstring).

    Args:
        context: the iteration (or replay).
        run_id: the stage run, still RUNNING.
        manifest: the stage output's manifest.
        stage_dir: its folder.
        register: ``{registered model suffix: checkpoint sub-folder}`` the stage declares.
    """
    tracker = context.tracker
    for suffix, subfolder in (register or {}).items():
        if (stage_dir / subfolder).is_dir():  # a critic-free update writes no critic
            _record_checkpoint(context, tracker, run_id, manifest, stage_dir, suffix, subfolder)
    if manifest.stage in EVALUATIONS:
        _record_evaluation(context, tracker, run_id, manifest, EVALUATIONS[manifest.stage])
    if manifest.stage in MODEL_FIGURES:
        name, figures = MODEL_FIGURES[manifest.stage]
        model = tracker.checkpoint_model(context.experiment_id, name, manifest.digest)
        held_out = {f"{manifest.stage}/{key}": manifest.metrics[key] for key in figures if key in manifest.metrics}
        if model is not None and held_out:
            tracker.log_model_metrics(run_id, model.model_id, held_out, dataset=held_out_pairs(manifest))


def _record_checkpoint(
    context: StageContext,
    tracker: Tracker,
    run_id: str,
    manifest: Manifest,
    stage_dir: Path,
    suffix: str,
    subfolder: str,
) -> None:
    """One checkpoint as a logged model, registered as a new version in an iteration (not a replay)."""
    upstream, iteration = manifest.upstream, manifest_iteration(manifest)
    parent = upstream.get(PARENTS.get(subfolder, ""))
    parent_model = None if parent is None else tracker.checkpoint_model(context.experiment_id, subfolder, parent)
    tags = {
        TAG_CAMPAIGN: context.campaign,
        TAG_ITERATION: str(iteration),
        **{f"{TAG_UPSTREAM_PREFIX}{name}": digest for name, digest in upstream.items()},
        **({TAG_PARENT_MODEL: parent_model.model_id} if parent_model is not None else {}),
    }
    model_id = tracker.record_checkpoint(
        context.experiment_id,
        run_id,
        name=f"{subfolder}-iteration-{iteration}" + ("" if context.register_models else "-replay"),
        manifest=manifest,
        stage_dir=stage_dir,
        subfolder=subfolder,
        tags=tags,
    )
    if not context.register_models:
        return
    name = f"{context.campaign}-{suffix}"
    version = tracker.register_model(run_id, name=name, stage_dir=stage_dir, subfolder=subfolder, model_id=model_id)
    payload = {
        "iteration": iteration,
        "model": name,
        "version": version,
        "model_id": model_id,
        "digest": manifest.digest,
        "stage_run_id": run_id,
        "iteration_run_id": context.parent_run_id,
        "source": tracker.model_source(run_id, stage_dir, subfolder),
    }
    send_campaign_event(
        registered_event(suffix), context.campaign, payload, assets=[manifest_asset(context.campaign, manifest)]
    )


def eval_prompts(context: StageContext, manifest: Manifest) -> tuple[str, str]:
    """The dataset an evaluation's metrics were computed on: ``(eval_prompts[:N], the file's sha256)``."""
    count = manifest.config.get("stage", {}).get("prompts")
    return f"eval_prompts[:{count}]", context.base.eval_prompts.sha256


def held_out_pairs(manifest: Manifest) -> tuple[str, str]:
    """The dataset a reward model's held-out figures were computed on: the pairs split off the preference outputs
    it was trained on, named by a digest over theirs."""
    pairs = [digest for name, digest in sorted(manifest.upstream.items()) if name.startswith("preferences")]
    return "held_out_pairs", hashlib.sha256("/".join(pairs).encode()).hexdigest()


def _record_evaluation(
    context: StageContext, tracker: Tracker, run_id: str, manifest: Manifest, evaluated: str
) -> None:
    """An evaluation's metrics on the evaluated actor's logged model; the ``best`` alias; the event."""
    policy = manifest.upstream.get(evaluated)
    model = None if policy is None else tracker.checkpoint_model(context.experiment_id, "actor", policy)
    dataset = eval_prompts(context, manifest)
    figures = {
        f"{manifest.stage}/{name}": value for name, value in manifest.metrics.items() if not name.startswith(RUNTIME)
    }
    order = [name for name in HEADLINE if name in figures] + sorted(set(figures) - set(HEADLINE))
    metrics = {name: figures[name] for name in order}
    best = None
    if model is not None:
        tracker.log_model_metrics(run_id, model.model_id, metrics, dataset=dataset)
        best = move_best_alias(tracker, context.experiment_id, f"{context.campaign}-actor", metrics, dataset)
    kind = tracker.run(context.parent_run_id).tags.get(TAG_KIND, KIND_ITERATION) if context.parent_run_id else None
    payload: dict[str, Any] = {
        "iteration": manifest_iteration(manifest),
        "kind": kind,
        "digest": manifest.digest,
        "policy_digest": policy,
        "model_id": None if model is None else model.model_id,
        "best_version": best,  # what `best` points at after this evaluation (None: no registered policy ranks)
        "dataset": {"name": dataset[0], "digest": dataset[1]},
        "metrics": metrics,
        "stage_run_id": run_id,
        "iteration_run_id": context.parent_run_id,
    }
    send_campaign_event(
        ITERATION_EVALUATED, context.campaign, payload, assets=[manifest_asset(context.campaign, manifest)]
    )


def move_best_alias(
    tracker: Tracker, experiment_id: str, name: str, metrics: Mapping[str, float], dataset: tuple[str, str]
) -> str | None:
    """Point ``name@best`` at the registered version whose logged model has the highest :data:`BEST_METRICS` figure
    (the first ``metrics`` holds) on ``dataset``; the version, or None when no registered version was evaluated."""
    metric = next((key for key in BEST_METRICS if key in metrics), None)
    if metric is None:
        return None
    for model in tracker.logged_models(experiment_id, tags={TAG_MODEL: "actor"}, best_by=metric, dataset=dataset):
        versions = [version for registered, version in model.versions if registered == name]
        scored = any(m.key == metric and m.dataset_name == dataset[0] for m in model.metrics)
        if versions and scored:
            tracker.set_alias(name, BEST_ALIAS, versions[-1])
            return versions[-1]
    return None
