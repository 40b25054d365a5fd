"""A campaign is history: what produced its finished iterations, and what differs now.

A finished iteration is never computed again because the code, a library or an input file changed: a
campaign continues from its first unfinished iteration with the code, libraries and inputs it has now, and
says in one line what differs from what produced the finished ones (:func:`what_differs`). Every iteration
run records what produced it (:func:`provenance`): the fingerprint of the code that computes its stages
(:func:`code_in_use`), this package's version, the versions of the libraries under it
(:func:`versions_in_use`) and the content of every input file. Recomputing is asked for: ``rlhf run
--from-iteration N`` (new runs from N on; the old ones stay, tagged superseded) or ``rlhf replay``.

Nothing here imports torch, transformers or Prefect, so ``rlhf run`` of a finished campaign answers in
seconds (:func:`campaign_finished`).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from campaign.config import ConfigError, PipelineConfig
from campaign.identity import INPUT_SETTINGS, base_inputs, demo_world_dir, fingerprint_cache, uses_demo_world
from campaign.model_sources import NotConverted
from campaign.store import existing_tracker
from demo.world import complete_world
from runtime.code import code_fingerprint
from runtime.versions import library_versions
from storage.manifest import package_version
from storage.mlflow_store import RunSummary
from storage.tracking import TAG_CODE, TAG_INPUTS, TAG_PACKAGE_VERSION, TAG_VERSIONS
from tasks.settings import STAGES

if TYPE_CHECKING:
    from runtime.context import BaseInputs

STAGE_MODULES = tuple(sorted(settings.module for settings in STAGES))
"""The module of every stage: what :func:`code_in_use` fingerprints."""


def code_in_use(base: BaseInputs) -> str:
    """The fingerprint of the code an iteration with ``base`` computes with: every stage's
    (:func:`runtime.code.code_fingerprint`, comments and docstrings left out) and the judge's and reward
    function's and environment's, which the stages load by name."""
    references = (base.judge, base.reward_function, base.environment)
    named = [reference.code for reference in references if reference is not None]
    stages = [code_fingerprint(module) for module in STAGE_MODULES]
    return hashlib.sha256(json.dumps([*stages, *named]).encode()).hexdigest()


def input_contents(base: BaseInputs) -> dict[str, str]:
    """``{setting: sha256}`` of every input file of ``base`` (``model.policy``, ``data.prompts``, ...)."""
    return {INPUT_SETTINGS[name]: sha256 for name, sha256 in base.contents.items()}


def versions_in_use(base: BaseInputs, vllm: str | None) -> dict[str, str]:
    """The versions of the libraries an iteration with ``base`` computes with
    (:func:`runtime.versions.library_versions`): gguf's when a base model was converted from a GGUF file, ``vllm``
    (the generation engine's version, :attr:`runtime.context.Execution.engine_vllm`) when its stages sample on it."""
    return library_versions(vllm=vllm, gguf=bool(base.sources))


def provenance(base: BaseInputs, vllm: str | None) -> dict[str, str]:
    """The tags that say what produced an iteration run: its code, this package's version, the libraries' versions
    (``vllm``: the version of the generation engine its stages sampled on, or None), its inputs' contents."""
    return {
        TAG_CODE: code_in_use(base),
        TAG_PACKAGE_VERSION: package_version(),
        TAG_VERSIONS: json.dumps(versions_in_use(base, vllm), sort_keys=True),
        TAG_INPUTS: json.dumps(input_contents(base), sort_keys=True),
    }


def _other_versions(finished: dict[int, RunSummary], versions: dict[str, str]) -> dict[str, list[str]]:
    """``{library: [versions the finished runs recorded]}`` of each library of ``versions`` some run recorded in
    another version. A library a run did not record (vLLM on a campaign sampling with hf, a run older than the
    versions tag) differs from nothing."""
    recorded = [json.loads(run.tags[TAG_VERSIONS]) for run in finished.values() if TAG_VERSIONS in run.tags]
    other = {name: sorted({r[name] for r in recorded if r.get(name, now) != now}) for name, now in versions.items()}
    return {name: found for name, found in other.items() if found}


def what_differs(finished: dict[int, RunSummary], base: BaseInputs, *, vllm: str | None) -> str | None:
    """One line saying what differs between what produced the ``finished`` iterations and ``base`` with this
    code and these libraries (``vllm``: the version of the generation engine the stages sample on now, or None), or None
    when nothing does (or nothing is finished). Runs recorded before the provenance tags say nothing of what
    they lack."""
    if not finished:
        return None
    code, inputs = code_in_use(base), input_contents(base)
    libraries = versions_in_use(base, vllm)
    other_libraries = _other_versions(finished, libraries)
    other_code = sorted({run.tags[TAG_CODE] for run in finished.values() if run.tags.get(TAG_CODE, code) != code})
    versions = sorted({run.tags[TAG_PACKAGE_VERSION] for run in finished.values() if TAG_PACKAGE_VERSION in run.tags})
    other_inputs = sorted(
        {
            setting
            for run in finished.values()
            for setting, sha256 in json.loads(run.tags.get(TAG_INPUTS, "{}")).items()
            if inputs.get(setting, sha256) != sha256
        }
    )
    differences = []
    if other_code:
        made_by = ", ".join(f"rlhf-pipeline {version}" for version in versions) or "an older version"
        differences.append(
            f"other code ({made_by}, code {', '.join(c[:12] for c in other_code)}; now {package_version()}, "
            f"code {code[:12]})"
        )
    if other_libraries:
        named = (f"{name} {', '.join(there)} there, {libraries[name]} here" for name, there in other_libraries.items())
        differences.append(f"other library versions ({'; '.join(named)})")
    if other_inputs:
        differences.append(f"another content of {', '.join(f'`{s}`' for s in other_inputs)}")
    if not differences:
        return None
    numbers = sorted(finished)
    span = f"iterations {numbers[0]}-{numbers[-1]} were" if len(numbers) > 1 else f"iteration {numbers[0]} was"
    return (
        f"{span} computed with {' and '.join(differences)}: they are kept as they are, and "
        f"iteration {numbers[-1] + 1} on use what is here now (`rlhf run --from-iteration N` recomputes from N)"
    )


def check_from_iteration(
    from_iteration: int | None, finished: dict[int, RunSummary], *, optimizer_states_present: bool
) -> None:
    """Refuse ``--from-iteration N`` when iterations before N are not finished, or when iteration N - 1, which
    N continues, has lost its optimizer states (only the newest finished iteration keeps them).

    Args:
        optimizer_states_present: whether the optimizer states of iteration N - 1's PPO output are there.

    Raises:
        ConfigError: naming the problem and what to do.
    """
    if from_iteration is None or from_iteration == 0:
        return
    missing = [number for number in range(from_iteration) if number not in finished]
    if missing:
        raise ConfigError(
            f"--from-iteration {from_iteration}: iteration {missing[0]} is not finished; recompute from an "
            f"iteration up to {missing[0]} (or leave --from-iteration out to continue the campaign)"
        )
    if not optimizer_states_present:
        raise ConfigError(
            f"--from-iteration {from_iteration} continues iteration {from_iteration - 1}, whose optimizer states "
            "were pruned (only the newest finished iteration keeps them): recompute from --from-iteration 0, or leave "
            "--from-iteration out to continue the campaign"
        )


def finished_iterations(config: PipelineConfig) -> dict[int, RunSummary]:
    """The campaign's finished iterations (:meth:`storage.tracking.Tracker.finished_iterations`); none when its
    store does not exist yet (none is created)."""
    tracker = existing_tracker(config)
    if tracker is None or not tracker.has_experiment(config.campaign):
        return {}
    return tracker.finished_iterations(tracker.experiment_id(config.campaign))


def campaign_finished(config: PipelineConfig, finished: dict[int, RunSummary]) -> bool:
    """Whether ``config``'s campaign, whose finished iterations are ``finished`` (:func:`finished_iterations`, read
    from MLflow alone: nothing is loaded, hashed or started), has finished every one of its ``config.iterations``."""
    return all(number in finished for number in range(config.iterations))


def difference_note(config: PipelineConfig, finished: dict[int, RunSummary]) -> str | None:
    """:func:`what_differs` for ``config``'s campaign, whose finished iterations are ``finished``
    (:func:`finished_iterations`), or None (also when the demo world it reads is not built yet, or a GGUF model it
    reads is not converted: nothing can have finished with them).

    Raises:
        FileNotFoundError: a base input does not exist (as any run refuses it).
    """
    if not finished:
        return None
    world = None
    if uses_demo_world(config) and (world := complete_world(demo_world_dir(config))) is None:
        return None
    try:
        base = base_inputs(config, fingerprint_cache(config), world, convert=False)
    except NotConverted:  # a GGUF model no run under this root converted: its content is not known without it
        return None
    return what_differs(finished, base, vllm=None)  # nothing runs: no engine is asked for its version
