"""A campaign's identity: what a run recorded before a setting moved still names the same campaign and runs.

``config_recorded_before_issue26.json`` is the ``config.json`` rlhf-pipeline recorded (commit cf9f86ce) beside an
iteration run of ``configs/tiny.yaml`` with ``--set run_root=/runs iterations=1 device=cpu torch_threads=2
checkpoint_seconds=5 model.gradient_checkpointing=true execution.frozen_models_gb=0.5``: the execution settings
still at the top level and in ``model``. The fingerprint, campaign fields and iteration key below are what that
version computed for it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from campaign.config import ConfigError, PipelineConfig, _tell_moved, load_config
from campaign.identity import campaign_fields, config_fingerprint, run_key
from campaign.store import CONFIG_ARTIFACT, source_config, store_tracker
from flows.cli import main
from runtime.context import BaseInputs, InputFile
from storage.tracking import (
    KIND_ITERATION,
    TAG_CAMPAIGN,
    TAG_CAMPAIGN_CONFIG,
    TAG_CONFIG_FINGERPRINT,
    TAG_ITERATION,
    TAG_ITERATION_KEY,
    TAG_KIND,
)

HERE = Path(__file__).parent
TINY = HERE.parents[1] / "configs" / "tiny.yaml"
RECORDED = (HERE / "config_recorded_before_issue26.json").read_text()

FINGERPRINT = "0121c676d26d71b1c44c687ed59e09907027c1acf68715ccfe978442555688ea"
ITERATION_KEY = "950990a07fc80d34bc03b8b66f5fe6656274b8404129c5163ea9c43d82b90d0f"
"""The iteration run key of ``RECORDED`` on ``BASE``; since issue 42 over every base input by content (it was
99883634... over the stages' base fingerprint, which no longer holds the held-out prompts)."""
CAMPAIGN_CONFIG = {  # the experiment tag `rlhf.campaign_config` that version wrote
    "campaign": "tiny",
    "data": {"eval_prompts": None, "preferences": None, "prompts": None},
    "demo": True,
    "human": {},
    "labeler": "gold",
    "model": {"critic_init": "policy", "lora": None, "policy": None, "reward_model": None, "tokenizer": None},
    "precision": "fp32",
    "reward": {"function": None, "source": "reward_model"},
    "reward_model": {
        "batch_size": 8,
        "epochs": 1,
        "eval_fraction": 0.25,
        "learning_rate": 0.0003,
        "max_grad_norm": 1.0,
        "train": True,
        "use_margin": True,
        "weight_decay": 0.0,
    },
    "sampling": {"batch_size": 16, "engine": "hf", "max_new_tokens": 8, "temperature": 1.0, "top_k": 0, "top_p": 1.0},
    "seed": 0,
    "sizes": {
        "candidates_per_prompt": 2,
        "preference_prompts": 16,
        "rollout_prompts": 16,
        "rows_per_shard": 4096,
        "samples_per_prompt": 1,
    },
}
BASE = BaseInputs(
    policy=InputFile(path="/inputs/policy", sha256="p" * 64),
    tokenizer=InputFile(path="/inputs/policy", sha256="p" * 64),
    prompts=InputFile(path="/inputs/prompts.jsonl", sha256="1" * 64),
    eval_prompts=InputFile(path="/inputs/eval_prompts.jsonl", sha256="2" * 64),
)
MOVED = ["device=cpu", "torch_threads=2", "checkpoint_seconds=5", "model.gradient_checkpointing=true"]
"""The overrides of the recorded run, by their old names."""


def test_issue26_a_config_recorded_before_the_execution_settings_moved_reads_as_the_same_campaign():
    recorded = PipelineConfig.model_validate_json(RECORDED)
    execution = recorded.execution
    assert (execution.device, execution.torch_threads, execution.checkpoint_seconds) == ("cpu", 2, 5.0)
    assert execution.gradient_checkpointing and execution.frozen_models_gb == 0.5
    now = load_config(TINY, ["run_root=/runs", "iterations=1", "execution.frozen_models_gb=0.5"] + MOVED)
    assert recorded == now
    assert config_fingerprint(recorded) == FINGERPRINT
    assert campaign_fields(recorded) == CAMPAIGN_CONFIG
    assert run_key(recorded, BASE, "", 0) == ITERATION_KEY


def test_issue26_a_campaign_finished_before_the_move_has_nothing_to_run_with_the_old_names_or_the_new(
    tmp_path, capsys, caplog
):
    run_id = _store_recorded_before(tmp_path, CAMPAIGN_CONFIG)  # the store as that version left it
    assert _fingerprint_of(CAMPAIGN_CONFIG) == FINGERPRINT
    _tell_moved.cache_clear()  # each notice is said once per process: this test counts them

    for names in (MOVED, ["execution.torch_threads=1", "execution.checkpoint_seconds=60"]):  # free to change
        overrides = [f"run_root={tmp_path}", "iterations=1", *names]
        assert main(["run", "--config", str(TINY), *(f"--set={text}" for text in overrides)]) == 0
        assert "all 1 iterations are finished; nothing to run" in capsys.readouterr().out
    notices = [record.getMessage() for record in caplog.records if record.name == "campaign.config"]
    assert notices == [
        f"--set {text}: `{text.partition('=')[0]}` is now `execution.{text.partition('=')[0].rpartition('.')[2]}`; "
        "the old name is read until the next release, which refuses it"
        for text in MOVED
    ]
    # What `rlhf replay`, `export` and `gc` read of the iteration.
    read = source_config(load_config(TINY, [f"run_root={tmp_path}"]), run_id)
    assert read == PipelineConfig.model_validate_json(RECORDED) and read.execution.torch_threads == 2


def _fingerprint_of(campaign_config: dict) -> str:
    """The fingerprint of recorded campaign fields, as every version computed it (``campaign.identity``)."""
    return hashlib.sha256(json.dumps(campaign_config, sort_keys=True).encode()).hexdigest()


def _store_recorded_before(tmp_path: Path, campaign_config: dict) -> str:
    """The store an earlier version left under ``tmp_path``: the campaign's tags (``campaign_config`` and its
    fingerprint) and one finished iteration run with the config that version recorded; returns that run."""
    tracker = store_tracker(load_config(TINY, [f"run_root={tmp_path}"]))
    experiment_id = tracker.experiment_id("tiny")
    tracker.set_experiment_tags(
        experiment_id,
        {
            TAG_CAMPAIGN_CONFIG: json.dumps(campaign_config, sort_keys=True),
            TAG_CONFIG_FINGERPRINT: _fingerprint_of(campaign_config),
        },
    )
    tags = {TAG_CAMPAIGN: "tiny", TAG_ITERATION: "0", TAG_KIND: KIND_ITERATION, TAG_ITERATION_KEY: ITERATION_KEY}
    run_id = tracker.start_run(experiment_id, name="iteration-0", tags=tags)
    tracker.log_text(run_id, RECORDED, CONFIG_ARTIFACT)
    tracker.end_run(run_id)
    return run_id


def test_issue32_a_field_added_since_a_campaign_started_counts_as_its_default(tmp_path, capsys):
    """R9: a campaign recorded before `sampling.engine` existed continues when this config leaves it at its default
    (which reproduces what ran), and is refused, naming the field, when this config sets another value."""
    older = json.loads(json.dumps(CAMPAIGN_CONFIG))
    del older["sampling"]["engine"]
    _store_recorded_before(tmp_path, older)
    assert config_fingerprint(load_config(TINY, [f"run_root={tmp_path}"])) != _fingerprint_of(older)

    overrides = [f"--set={text}" for text in (f"run_root={tmp_path}", "iterations=1")]
    assert main(["run", "--config", str(TINY), *overrides]) == 0
    assert "all 1 iterations are finished; nothing to run" in capsys.readouterr().out

    assert main(["run", "--config", str(TINY), *overrides, "--set=sampling.engine=vllm"]) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("rlhf: campaign `tiny` was started with another config (`sampling.engine` 'hf' there, ")
    assert "'vllm' here" in message and len(message.splitlines()) == 1


def test_issue35_fields_added_since_keep_every_identity_at_their_old_value_and_are_part_of_it_at_another():
    recorded = PipelineConfig.model_validate_json(RECORDED)
    assert recorded.pairing == "consecutive" and recorded.advantages.score_statistics == "held_out"
    assert config_fingerprint(recorded) == FINGERPRINT and run_key(recorded, BASE, "", 0) == ITERATION_KEY
    paired = recorded.model_copy(update={"pairing": "best_vs_worse"})
    assert config_fingerprint(paired) != FINGERPRINT and run_key(paired, BASE, "", 0) != ITERATION_KEY
    assert campaign_fields(paired)["pairing"] == "best_vs_worse"
    running = recorded.model_copy(
        update={"advantages": dataclasses.replace(recorded.advantages, score_statistics="running")}
    )
    assert config_fingerprint(running) == FINGERPRINT  # a replayable setting: no part of the campaign's identity
    assert run_key(running, BASE, "", 0) != ITERATION_KEY
    held_out = dataclasses.replace(BASE, eval_prompts=InputFile(path="/inputs/eval_prompts.jsonl", sha256="3" * 64))
    assert run_key(recorded, held_out, "", 0) != ITERATION_KEY  # every base input's content, the held-out prompts too


def test_issue35_a_pairing_that_compares_every_pair_needs_a_labeler_that_scores_each_candidate():
    with pytest.raises(ConfigError, match="`pairing` best_vs_worse compares every pair .* not `labeler` human"):
        load_config(TINY, ["labeler=human", "pairing=best_vs_worse"])
    assert load_config(TINY, ["pairing=all_decisive"]).pairs_per_iteration == 16 * 1  # 16 prompts x 2 candidates


def test_issue43_asking_keeps_every_identity_at_all_and_needs_a_budget_and_a_labeler_of_candidates():
    recorded = PipelineConfig.model_validate_json(RECORDED)
    assert recorded.asking.select == "all" and recorded.asking.pairs is None
    assert config_fingerprint(recorded) == FINGERPRINT and run_key(recorded, BASE, "", 0) == ITERATION_KEY
    asked = recorded.model_copy(
        update={"asking": recorded.asking.model_copy(update={"select": "uncertain", "pairs": 8})}
    )
    # A campaign may start asking by margin once it has a reward model: not its identity, but its iterations' keys.
    assert config_fingerprint(asked) == FINGERPRINT and "asking" not in campaign_fields(asked)
    assert run_key(asked, BASE, "", 0) != ITERATION_KEY
    with pytest.raises(ConfigError, match="`asking.select` uncertain asks about a budget of pairs a round: set"):
        load_config(TINY, ["asking.select=uncertain"])
    with pytest.raises(ConfigError, match="best_vs_worse needs all of a prompt's"):
        load_config(TINY, ["asking.select=random", "asking.pairs=8", "pairing=best_vs_worse"])
    config = load_config(TINY, ["asking.select=uncertain", "asking.pairs=12", "pairing=all_decisive"])
    assert config.pairs_per_iteration == 12 and config.labeling_precision == config.precision


def test_issue33_a_field_added_since_keeps_every_identity_at_its_old_value_and_is_part_of_it_at_another():
    recorded = PipelineConfig.model_validate_json(RECORDED)
    assert recorded.sampling.staleness == 0 and recorded.ppo.off_policy == "decoupled"
    assert config_fingerprint(recorded) == FINGERPRINT and run_key(recorded, BASE, "", 0) == ITERATION_KEY
    overlapped = recorded.model_copy(update={"sampling": dataclasses.replace(recorded.sampling, staleness=1)})
    assert config_fingerprint(overlapped) != FINGERPRINT and run_key(overlapped, BASE, "", 0) != ITERATION_KEY
    assert campaign_fields(overlapped)["sampling"]["staleness"] == 1


def test_issue43_decisive_pairs_keep_every_identity_unset_and_are_part_of_it_set():
    recorded = PipelineConfig.model_validate_json(RECORDED)
    assert recorded.sizes.decisive_pairs is None and recorded.sizes.max_rounds == 4
    assert config_fingerprint(recorded) == FINGERPRINT and run_key(recorded, BASE, "", 0) == ITERATION_KEY
    for sizes in ({"decisive_pairs": 32}, {"max_rounds": 2}):
        changed = recorded.model_copy(update={"sizes": recorded.sizes.model_copy(update=sizes)})
        assert config_fingerprint(changed) != FINGERPRINT and run_key(changed, BASE, "", 0) != ITERATION_KEY
