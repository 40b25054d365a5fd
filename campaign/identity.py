"""What identifies a campaign and its runs: the config fields that define it (its fingerprint, checked against the
one it was started with), its base inputs, located and identified by their content, and run keys.

Nothing here imports torch, transformers or Prefect, so a command that only has to recognise finished work
(``rlhf run`` of a finished campaign, :mod:`campaign.history`) starts in seconds. Checking that the stages can
use the inputs (:func:`flows.inputs.check_inputs`) and building the demo world are the flow's
(:func:`flows.iterations.resolve_base`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from campaign.config import ConfigError, HumanLabelConfig, PipelineConfig
from campaign.model_sources import PACKAGE_PREFIX, is_gguf, model_input
from campaign.settings import EXECUTION, LOCATION, replayable_fields
from campaign.store import store_layout
from demo.world import DemoWorld
from rlhf_core.config import DPOConfig, SFTConfig
from runtime.context import BaseInputs, InputFile
from runtime.references import EnvironmentReference, JudgeReference, RewardFunctionReference
from storage.fingerprints import FingerprintCache

if TYPE_CHECKING:  # MLflow only where a store is read: locating the inputs (base_inputs) needs none
    from storage.tracking import Tracker

INPUT_SETTINGS = {
    "policy": "model.policy",
    "tokenizer": "model.tokenizer",
    "prompts": "data.prompts",
    "eval_prompts": "data.eval_prompts",
    "preferences": "data.preferences",
    "reward_model": "model.reward_model",
    "sft_data": "sft.data",
    "sft": "sft",
}
"""The input files of :class:`runtime.context.BaseInputs`, by field: the setting naming each."""

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


def base_inputs(
    config: PipelineConfig, cache: FingerprintCache | None, world: DemoWorld | None, *, convert: bool = True
) -> BaseInputs:
    """``config``'s base inputs, each located and identified by its content; nothing is checked or built.

    Args:
        config: the settings naming the inputs.
        cache: fingerprints already computed (it learns new ones; saving it is the caller's choice); None locates
            the inputs without reading them (a folder's ``sha256`` empty; a GGUF model's converted folder, or the
            file itself when it is not converted yet: :func:`campaign.model_sources.model_input`), for the checks made
            before hashing a model.
        world: the demo world, when :func:`uses_demo_world`; its files fill the inputs ``config`` leaves unset.
        convert: convert a GGUF model file not converted yet (:mod:`campaign.model_sources`); False raises
            :class:`campaign.model_sources.NotConverted` instead.

    Raises:
        FileNotFoundError: an input does not exist, or the policy folder is not a Hugging Face checkpoint.
        ModelSourceError: a model setting names a package that is not installed, or a GGUF file that cannot be
            converted.
        ValueError: the demo's judge or the reward function cannot be loaded by its name.
    """
    policy, prompts, eval_prompts = config.model.policy, config.data.prompts, config.data.eval_prompts
    if world is not None:
        policy = policy or str(world.model_dir)
        prompts = prompts or world.prompts_path
        eval_prompts = eval_prompts or world.eval_prompts_path
    layout = store_layout(config)

    def model(setting: str, value: str) -> InputFile:
        return model_input(cache, layout, setting, value, convert=convert)

    policy_file = model("model.policy", _local_model_folder(policy))
    if not is_gguf(policy_file.path) and not (Path(policy_file.path) / "config.json").is_file():
        raise FileNotFoundError(f"`model.policy` folder {policy} has no config.json: not a Hugging Face checkpoint")
    return BaseInputs(
        policy=policy_file,
        tokenizer=model("model.tokenizer", config.model.tokenizer) if config.model.tokenizer else policy_file,
        prompts=_input_file(cache, "data.prompts", prompts),
        eval_prompts=_input_file(cache, "data.eval_prompts", eval_prompts),
        judge=JudgeReference.of(GOLD_JUDGE) if config.demo else None,
        preferences=_input_file(cache, "data.preferences", config.data.preferences)
        if config.labeler == "import" and config.data.preferences
        else None,
        reward_model=model("model.reward_model", config.model.reward_model) if config.model.reward_model else None,
        reward_function=RewardFunctionReference.of(config.reward.function)
        if config.reward.source == "function" and config.reward.function
        else None,
        rubric=RewardFunctionReference.of(config.reward.function)
        if config.labeler == "function" and config.reward.function
        else None,
        environment=EnvironmentReference.of(config.environment.class_) if config.environment.class_ else None,
        sft_data=_input_file(cache, "sft.data", config.sft.data) if config.sft.data else None,
    )


def _local_model_folder(policy: str) -> str:
    """``policy`` itself when it is a local path (or a ``pkg:`` reference, :mod:`campaign.model_sources`); a hub name
    (``org/name``) is fetched into (or found in) the Hugging Face cache, so its content can be fingerprinted like
    any folder."""
    if Path(policy).exists() or policy.startswith(PACKAGE_PREFIX):
        return policy
    if policy.startswith(("/", ".", "~")) or policy.count("/") != 1:
        raise FileNotFoundError(f"`model.policy` {policy} does not exist")
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


ADDED_FIELDS: dict[str, object] = {
    "pairing": "consecutive",
    "advantages.score_statistics": "held_out",
    "sampling.staleness": 0,
    "ppo.off_policy": "decoupled",
    "ppo.behaviour_weight_cap": 2.0,
    "reward_model.replay_ratio": None,
    "environment": {"class": None, "max_turns": 3, "max_tokens_per_turn": 32, "step_timeout_s": 30.0},
    "update": "ppo",
    "dpo": dataclasses.asdict(DPOConfig()),
    "sft": {**dataclasses.asdict(SFTConfig()), "data": None},
    "sft.packing": False,
    "sft.packed_length": None,
    "sizes.decisive_pairs": None,
    "sizes.max_rounds": 4,
    "asking": {"select": "all", "pairs": None},
    "ppo.kl_budget": None,
}
"""Fields added after campaigns were recorded, each with the value that computes what the code before it computed
(consecutive candidates paired, scores normalised by the reward model's held-out statistics; with staleness 0 every
row is on-policy, and the correction is none; the reward model trained on every pair so far; no environment; a PPO
update, whose campaigns read no `dpo` setting; no SFT stage, or one unpacked; one round of candidates an iteration, whatever its decisive
pairs; every compared pair asked about; no KL budget). At that value a field is left out of every identity (the campaign's
fingerprint, run keys), so campaigns and finished iterations recorded before it existed keep theirs; any other value
is part of them. A field added without an entry here changes the fingerprint but not the campaign:
:func:`with_defaults` reads the recorded config's missing fields at their defaults, so the check of the campaign's
config passes where this one leaves them there. An entry here also keeps run keys, hence finished iterations, as
they were."""


def fields_without(config: PipelineConfig, paths: tuple[str, ...]) -> dict:
    """The config as JSON values, less the fields at ``paths`` (dotted) and the :data:`ADDED_FIELDS` at their old
    value."""
    fields = config.model_dump(mode="json")
    added = tuple(path for path, value in ADDED_FIELDS.items() if _leaf(fields, path) == value)
    for path in paths + added:
        *parents, leaf = path.split(".")
        node = fields
        for parent in parents:
            node = node.get(parent, {})
        node.pop(leaf, None)
    return fields


def _leaf(tree: dict, path: str) -> object:
    """The value at a dotted ``path`` of a nested dict (None where there is none)."""
    node: object = tree
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def run_key(config: PipelineConfig, base: BaseInputs, *parts: object) -> str:
    """An iteration (or replay) run's identity: its config without execution and location settings,
    every base input by content (:attr:`runtime.context.BaseInputs.contents`) and ``parts`` (the policy it continues
    and its number, or the run it replays)."""
    fields = fields_without(config, EXECUTION + LOCATION)
    return hashlib.sha256(json.dumps([fields, base.contents, *parts], sort_keys=True).encode()).hexdigest()


CAMPAIGN_FREE = (
    *EXECUTION,
    *LOCATION,
    *replayable_fields(),
    "iterations",
    *(f"human.{name}" for name in HumanLabelConfig.model_fields),
    "asking",
)
"""Fields a campaign may be run with differently from one command to the next: where and how it runs, what a
replay may change (the advantage and PPO settings, as a schedule would), how many iterations, and how the
human-label forms are shown, and which of the compared pairs the labeler is asked about (`asking`: by margin only
once an iteration has a reward model to ask, and every output it changes is keyed by it). Every other field (the
model, data, labeler, reward, sampling, sizes) defines it."""


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


def config_fingerprint(config: PipelineConfig) -> str:
    """The fingerprint of the fields that define ``config``'s campaign (:func:`campaign_fields`)."""
    return hashlib.sha256(json.dumps(campaign_fields(config), sort_keys=True).encode()).hexdigest()


def with_defaults(recorded: dict) -> dict:
    """The campaign fields a campaign recorded (:func:`campaign_fields`), with every field they do not name at its
    default: a field added since, whose default reproduces what ran before, reads as what the campaign ran with. The
    fields as recorded where they are no longer a config (one since removed or renamed)."""
    try:
        return campaign_fields(PipelineConfig.model_validate(recorded, context={"store_only": True}))
    except ValueError:  # pydantic's ValidationError
        return recorded


def check_campaign_config(config: PipelineConfig, tracker: Tracker) -> str:
    """Refuse ``config`` if its campaign was started with a config that differs in a field defining it. A field
    the recorded config does not name counts as its default (:func:`with_defaults`).

    Returns:
        The config's campaign fingerprint (what the campaign's experiment records as
        ``rlhf.config_fingerprint``).

    Raises:
        ConfigError: naming the first differing fields, their values there and here, and what to do.
    """
    from storage.tracking import TAG_CAMPAIGN_CONFIG, TAG_CONFIG_FINGERPRINT

    fingerprint = config_fingerprint(config)
    tags = tracker.experiment_tags(config.campaign)
    recorded = tags.get(TAG_CONFIG_FINGERPRINT)
    if recorded is None or recorded == fingerprint:
        return fingerprint
    fields = tags.get(TAG_CAMPAIGN_CONFIG)
    theirs = _leaves(with_defaults(json.loads(fields))) if fields is not None else {}
    ours = _leaves(campaign_fields(config))
    differing = sorted(name for name in theirs.keys() | ours.keys() if theirs.get(name) != ours.get(name))
    if fields is not None and not differing:
        return fingerprint
    shown = "; ".join(f"`{name}` {theirs.get(name)!r} there, {ours.get(name)!r} here" for name in differing[:3])
    more = f"; and {len(differing) - 3} more" if len(differing) > 3 else ""
    raise ConfigError(
        f"campaign `{config.campaign}` was started with another config ({shown or 'another version'}{more}): give "
        "this config a `campaign` of its own (--set campaign=NAME), or run the campaign with the config it was "
        "started with"
    )


_RECORDED: dict[tuple[str, str], str] = {}
"""``(tracking URI, campaign) -> config fingerprint`` recorded by this process: checked once, not per iteration."""


def record_campaign_config(config: PipelineConfig, tracker: Tracker, experiment_id: str) -> None:
    """Check ``config`` against its campaign's (:func:`check_campaign_config`); the first one is remembered. Once
    per process and campaign: the iterations of a campaign flow after the first check nothing again."""
    from storage.tracking import TAG_CAMPAIGN_CONFIG, TAG_CONFIG_FINGERPRINT, TAG_GC_RECORDS

    if _RECORDED.get(key := (tracker.tracking_uri, config.campaign)) == config_fingerprint(config):
        return
    fingerprint = check_campaign_config(config, tracker)
    if TAG_CONFIG_FINGERPRINT not in tracker.experiment_tags(config.campaign):
        tracker.set_experiment_tags(
            experiment_id,
            {
                TAG_CAMPAIGN_CONFIG: json.dumps(campaign_fields(config), sort_keys=True),
                TAG_CONFIG_FINGERPRINT: fingerprint,
                TAG_GC_RECORDS: "1",  # a new campaign: every output its gc removes is recorded as removed
            },
        )
    _RECORDED[key] = fingerprint
