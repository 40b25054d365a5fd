"""Overlapped iterations (``sampling.staleness`` >= 1): an iteration's update beside the next iteration's generation.

Choices:
1. What is sampled and when it runs are separate. ``sampling.staleness`` N decides which policy an iteration's
   generation stages sample from: the one N versions behind the policy its update starts from
   (:meth:`flows.iterations.IterationState.sampler`); that policy is their ``policy`` input, so it is in their keys.
   Whether the next iteration's generation stages run beside this one's update changes no output: a campaign runs
   them beside it, an iteration run alone (a schedule's) after it, and both write the same outputs.
2. The next iteration's generation side (candidates, preferences, reward model, rollout: everything before its update,
   none of which needs a newer policy) runs in the flow's own process while this iteration's update trains in a
   process of its own: a Prefect task on the flow's task runner (:meth:`runtime.stage.Stage.submit`) whose work runs
   in a launched process (``Execution.own_process``, :mod:`runtime.launch`), each with its own torch threads. The
   side run ahead is computed, not recorded (``StageContext.records``): the next iteration calls its stages as every
   iteration does, finds their outputs, and records them under its own MLflow run, so lineage, resume and replay are
   those of any iteration.
3. Whenever the staleness is 1 or more, the two lanes (generation stages; advantages and the update) each run on half
   the command's threads (:func:`runtime.threads.lane_threads`), and the update in a process of its own, whether the
   other lane runs at that moment or not, so outputs do not depend on how the two happened to overlap. Evaluation and
   the campaign's initialisation run alone, on all of them.
4. A crash anywhere leaves what either lane published or checkpointed, and nothing else: the same command resumes the
   update from its last checkpoint, the generation side from its finished outputs and rollout shards, and the
   update's training process ends with the flow's (a parent-death signal). A person's labels never run ahead: with
   labeler ``human`` the next iteration waits (its forms are asked for when it runs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from prefect.futures import PrefectFuture, wait

from campaign.config import PipelineConfig
from runtime.concurrency import sharing_the_gpu
from runtime.context import StageContext
from runtime.declaration import StageResult
from runtime.threads import lane_threads

LANES = 2
"""The stages that run at once: an iteration's generation stages and the previous iteration's update."""


def lanes(context: StageContext, config: PipelineConfig) -> tuple[StageContext, StageContext]:
    """The contexts of the generation lane and of the training lane (advantages, update) of an iteration (choice 3):
    ``context`` itself for both with staleness 0."""
    if config.sampling.staleness == 0:
        return context, context
    execution = replace(context.execution, torch_threads=lane_threads(context.execution.torch_threads, lanes=LANES))
    sampling = replace(context, execution=execution)
    return sampling, replace(sampling, execution=replace(execution, own_process=True))


def runs_ahead(config: PipelineConfig) -> bool:
    """Whether a campaign runs each next iteration's generation stages beside the update (choices 1 and 4)."""
    return config.sampling.staleness > 0 and config.labeler != "human"


def ahead_of(context: StageContext) -> StageContext:
    """The context of the iteration after ``context``'s, for its generation stages run ahead: unrecorded (choice 2)."""
    return replace(context, iteration=context.iteration + 1, parent_run_id=None, records=False)


def beside(update: PrefectFuture, ahead: Callable[[], object]) -> StageResult:
    """Run ``ahead`` here while the submitted ``update`` runs; the update's result once both have ended. Either one's
    error is raised once both have ended: no lane is left running."""
    try:
        with sharing_the_gpu():  # on a GPU the update holds the campaign's slot of the gpu tag
            ahead()
    finally:
        wait([update])
    return update.result()
