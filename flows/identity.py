"""What identifies a campaign's runs: its base inputs, located and identified by their content, and run keys.

Nothing here imports torch, transformers or Prefect, so a command that only has to recognise finished work
(``rlhf run`` of a finished campaign, :mod:`flows.reuse`) starts in seconds. Checking that the stages can
use the inputs (:func:`flows.inputs.check_inputs`) and building the demo world are the flow's
(:func:`flows.campaign.resolve_base`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from demo.world import DemoWorld
from flows.config import PipelineConfig
from flows.settings import EXECUTION, LOCATION
from flows.store import store_layout
from storage.fingerprints import FingerprintCache
from tasks.context import BaseInputs, InputFile
from tasks.judge import JudgeReference
from tasks.reward_function import RewardFunctionReference

GOLD_JUDGE = "demo.gold:JUDGE"
"""The embedded demo's hidden gold rater: it judges evaluation in the demo world (`demo`), and labels with `gold`."""


def uses_demo_world(config: PipelineConfig) -> bool:
    """Whether the embedded demo world provides a base input (the policy or a prompt file ``config`` leaves unset)."""
    data = config.data
    return config.demo and (config.model.policy is None or data.prompts is None or data.eval_prompts is None)


def demo_world_dir(config: PipelineConfig) -> Path:
    """Where ``config``'s run root keeps the demo world (built once, then shared by its campaigns)."""
    return store_layout(config).cache_dir() / "demo-world"


def fingerprint_cache(config: PipelineConfig) -> FingerprintCache:
    """The run root's cache of input fingerprints (by path, size and modification time)."""
    return FingerprintCache(store_layout(config).fingerprint_cache())


def base_inputs(config: PipelineConfig, cache: FingerprintCache | None, world: DemoWorld | None) -> BaseInputs:
    """``config``'s base inputs, each located and identified by its content; nothing is checked or built.

    Args:
        config: the settings naming the inputs.
        cache: fingerprints already computed (it learns new ones; saving it is the caller's choice); None locates
            the inputs without reading them (every ``sha256`` empty), for checks made before hashing a model.
        world: the demo world, when :func:`uses_demo_world`; its files fill the inputs ``config`` leaves unset.

    Raises:
        FileNotFoundError: an input does not exist, or the policy folder is not a Hugging Face checkpoint.
        ValueError: the demo's judge or the reward function cannot be loaded by its name.
    """
    policy, prompts, eval_prompts = config.model.policy, config.data.prompts, config.data.eval_prompts
    if world is not None:
        policy = policy or str(world.model_dir)
        prompts = prompts or world.prompts_path
        eval_prompts = eval_prompts or world.eval_prompts_path
    policy = _local_model_folder(policy)
    if not (Path(policy) / "config.json").is_file():
        raise FileNotFoundError(f"`model.policy` folder {policy} has no config.json: not a Hugging Face checkpoint")
    policy_file = _input_file(cache, "model.policy", policy)
    return BaseInputs(
        policy=policy_file,
        tokenizer=_input_file(cache, "model.tokenizer", config.model.tokenizer)
        if config.model.tokenizer
        else policy_file,
        prompts=_input_file(cache, "data.prompts", prompts),
        eval_prompts=_input_file(cache, "data.eval_prompts", eval_prompts),
        judge=JudgeReference.of(GOLD_JUDGE) if config.demo else None,
        preferences=_input_file(cache, "data.preferences", config.data.preferences)
        if config.labeler == "import" and config.data.preferences
        else None,
        reward_model=_input_file(cache, "model.reward_model", config.model.reward_model)
        if config.model.reward_model
        else None,
        reward_function=RewardFunctionReference.of(config.reward.function)
        if config.reward.source == "function" and config.reward.function
        else None,
    )


def _local_model_folder(policy: str) -> str:
    """``policy`` itself when it is a folder; a hub name (``org/name``) is fetched into (or found in) the
    Hugging Face cache, so its content can be fingerprinted like any folder."""
    if Path(policy).exists():
        return policy
    if policy.startswith(("/", ".", "~")) or policy.count("/") != 1:
        raise FileNotFoundError(f"`model.policy` folder {policy} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(policy)
    except Exception as error:  # noqa: BLE001 - offline, unknown repo, no access: all mean the same here
        raise FileNotFoundError(
            f"`model.policy` {policy!r} is neither a folder nor a model the Hugging Face hub (or its local cache) "
            f"provides: {error}"
        ) from error


def _input_file(cache: FingerprintCache | None, setting: str, path: str | Path) -> InputFile:
    if not Path(path).exists():
        raise FileNotFoundError(f"`{setting}` {path} does not exist")
    return InputFile(path=str(Path(path).resolve()), sha256="" if cache is None else cache.fingerprint(Path(path)))


def fields_without(config: PipelineConfig, paths: tuple[str, ...]) -> dict:
    """The config as JSON values, less the fields at ``paths`` (dotted)."""
    fields = config.model_dump(mode="json")
    for path in paths:
        *parents, leaf = path.split(".")
        node = fields
        for parent in parents:
            node = node[parent]
        node.pop(leaf)
    return fields


def starting_point(base: BaseInputs, previous: str, iteration: int) -> str:
    """What an iteration starts from: its base inputs' contents, the digest of the policy it continues ("" for
    iteration 0) and its number; with its config, this makes its run key (:func:`run_key`)."""
    return hashlib.sha256(json.dumps([base.fingerprint, previous, iteration]).encode()).hexdigest()


def run_key(config: PipelineConfig, base: BaseInputs, *parts: object) -> str:
    """An iteration (or replay) run's identity: its config without execution and location settings,
    its base inputs and ``parts`` (its starting point)."""
    fields = fields_without(config, EXECUTION + LOCATION)
    return hashlib.sha256(json.dumps([fields, base.fingerprint, *parts], sort_keys=True).encode()).hexdigest()
