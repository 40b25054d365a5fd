"""Deciding that a campaign has nothing to run, before any Prefect server starts or any model loads.

Running a finished campaign again reuses every stage (:mod:`tasks.stage`), but getting there costs a
Prefect server, a task run per stage and a few MLflow queries each: about 4 s an iteration. This module
reaches the same answer from MLflow and the manifests alone.

An iteration run carries a *reuse record* (tag ``rlhf.reuse``, written by
:func:`flows.campaign.close_iteration`): the fingerprint of the code its stages ran (:func:`code_in_use`:
``flows.rlhf_pipeline``, whose import closure holds every stage, ``rlhf_core`` and ``storage`` module,
plus the judge and reward function it names, which no module imports) and the stage outputs the
iteration used, each by stage, input key and manifest digest. Every input key is a function of the
config, the base inputs, the iteration, the code and the digests of its upstream outputs; the run key
(:func:`flows.identity.run_key`) covers the first three plus the starting policy. So when a finished run's key and code fingerprint are this
invocation's and every recorded output is still there, verifies, has its recorded digest and its
finished MLflow stage run, running the iteration again would compute exactly the recorded keys, reuse
exactly those outputs and record nothing: it is a no-op, and so is the next iteration's check, which
starts from the recorded policy.

Anything else (a run without a record, edited code, a missing or altered output, a missing stage run)
answers "not reused", and the flow runs as usual, reusing what it can and reporting what is wrong.

The decision imports neither torch, transformers nor Prefect (a test holds it to that), and does not check
the base inputs: a finished run with the same run key proves the same contents passed those checks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from demo.world import complete_world
from flows.config import PipelineConfig
from flows.identity import base_inputs, demo_world_dir, fingerprint_cache, run_key, uses_demo_world
from flows.model_sources import NotConverted
from flows.store import campaign_layout, existing_tracker, store_tracker
from storage.manifest import CorruptOutputError, read_manifest
from storage.tracking import (
    KIND_ITERATION,
    KIND_STAGE,
    TAG_INPUT_KEY,
    TAG_ITERATION,
    TAG_ITERATION_KEY,
    TAG_KIND,
    TAG_REUSE,
    TAG_STAGE,
)
from tasks.code import code_fingerprint

if TYPE_CHECKING:
    from tasks.context import BaseInputs
    from tasks.stage import StageResult

PIPELINE_MODULE = "flows.rlhf_pipeline"
"""The module whose code fingerprint a reuse record holds: the flows' wiring and, through its imports,
every stage it runs."""


def code_in_use(base: BaseInputs) -> str:
    """The fingerprint of the code an iteration with ``base`` runs: the pipeline's modules (:data:`PIPELINE_MODULE`)
    and the judge's and reward function's, which the stages load by name."""
    named = [reference.code for reference in (base.judge, base.reward_function) if reference is not None]
    return hashlib.sha256(json.dumps([code_fingerprint(PIPELINE_MODULE), *named]).encode()).hexdigest()


def reuse_record(base: BaseInputs, stages: Sequence[StageResult]) -> str:
    """The reuse record of an iteration with ``base`` whose stages gave ``stages``: JSON for the tag ``rlhf.reuse``."""
    outputs = [[result.stage, result.input_key, result.digest] for result in stages]
    return json.dumps({"code": code_in_use(base), "outputs": outputs}, separators=(",", ":"))


def _reused_outputs(
    config: PipelineConfig, base: BaseInputs, record: str, stage_runs: set[tuple[str, str]]
) -> dict[str, str] | None:
    """``stage -> digest`` of the recorded outputs when running them again would reuse each; else None."""
    try:
        parsed = json.loads(record)
        code, outputs = parsed["code"], parsed["outputs"]
    except (ValueError, KeyError, TypeError):
        return None
    if code != code_in_use(base):
        return None
    layout = campaign_layout(config)
    digests = {}
    for stage, input_key, digest in outputs:
        if (stage, input_key) not in stage_runs:
            return None
        try:
            manifest = read_manifest(layout.stage_dir(stage, input_key), verify=True)
        except (CorruptOutputError, OSError):
            return None
        if manifest.input_key != input_key or manifest.digest != digest:
            return None
        digests[stage] = digest
    return digests


def reused_iterations(config: PipelineConfig, base: BaseInputs) -> int:
    """How many of the campaign's first iterations (0, 1, ...) running it again would reuse entirely.

    One MLflow query per iteration (its runs: the iteration run and its stage runs), plus verifying the
    recorded outputs (:func:`storage.manifest.read_manifest`). Reads only; runs nothing.
    """
    tracker = store_tracker(config)
    if not tracker.has_experiment(config.campaign):
        return 0
    experiment_id = tracker.experiment_id(config.campaign)
    previous = ""
    for iteration in range(config.iterations):
        key = run_key(config, base, previous, iteration)
        runs = tracker.runs(experiment_id, tags={TAG_ITERATION: str(iteration)})
        finished = [run for run in runs if run.status == "FINISHED"]
        stage_runs = {
            (run.tags.get(TAG_STAGE), run.tags.get(TAG_INPUT_KEY))
            for run in finished
            if run.tags.get(TAG_KIND) == KIND_STAGE
        }
        records = [
            run.tags[TAG_REUSE]
            for run in finished
            if run.tags.get(TAG_KIND) == KIND_ITERATION and run.tags.get(TAG_ITERATION_KEY) == key
            and TAG_REUSE in run.tags
        ]  # fmt: skip
        digests = next(
            (found for record in records if (found := _reused_outputs(config, base, record, stage_runs)) is not None),
            None,
        )
        if digests is None or "ppo_update" not in digests:
            return iteration
        previous = digests["ppo_update"]
    return config.iterations


def campaign_finished(config: PipelineConfig) -> bool:
    """Whether running ``config``'s campaign again would reuse every stage of its ``config.iterations``
    iterations (:func:`reused_iterations`); False at once when there is no MLflow store yet (none is created)
    or the demo world it reads is not built, or a GGUF model it reads is not converted.

    Raises:
        FileNotFoundError: a base input does not exist (as any run refuses it).
    """
    if existing_tracker(config) is None:
        return False
    world = None
    if uses_demo_world(config) and (world := complete_world(demo_world_dir(config))) is None:
        return False
    try:
        base = base_inputs(config, fingerprint_cache(config), world, convert=False)
    except NotConverted:  # a GGUF model no run under this root has converted: nothing can have finished with it
        return False
    return reused_iterations(config, base) == config.iterations
