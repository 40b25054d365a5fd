"""PipelineConfig: validated once at the flow boundary; YAML diffs plus overrides."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from campaign.config import ConfigError, PipelineConfig, load_config
from rlhf_core.config import Sharding

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    "name",
    [
        "demo.yaml",
        "demo-verifiable.yaml",
        "demo-human.yaml",
        "demo-dpo.yaml",
        "tiny.yaml",
        "smollm2.yaml",
        "smollm2-rm.yaml",
        "smollm2-episodes.yaml",
        "smollm2-sft.yaml",
        "smollm2-dpo.yaml",
    ],
)
def test_shipped_configs_load(name):
    assert isinstance(load_config(CONFIGS / name), PipelineConfig)


def test_overrides_apply_on_top_of_the_file():
    config = load_config(CONFIGS / "tiny.yaml", ["ppo.epochs=3", "sampling.temperature=0.7", "iterations=5"])
    assert (config.ppo.epochs, config.sampling.temperature, config.iterations) == (3, 0.7, 5)
    assert config.sizes.rollout_prompts == 16  # from the file


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["ppo.epoch=2"], "ppo.epoch"),  # a mistyped nested key
        (["sampling.temperature=hot"], "sampling.temperature"),  # a bad type
        (["sampling.top_p=2"], "top_p"),  # a stage config's own __post_init__ check
        (["ppo.dual_clip=0.5"], "dual_clip"),
        (["labeler=import"], "data.preferences"),  # a cross-field check
        (["campaign=has space"], "campaign"),
        (["nonsense"], "section.field=value"),
        (["ppo.kl_loss_coef=0.1"], "advantages.kl_in"),
        (["reward.source=function"], "reward.function"),
        (["labeler=function"], "reward.function"),  # the rubric that labels must be named
        (["reward.source=model"], "reward.source"),
        # 16 rollouts per iteration in tiny.yaml: a horizon of 8 would move the coefficient by up to 40% at once
        (["advantages.kl_target=1", "advantages.kl_horizon=8"], "advantages.kl_horizon"),
        (["advantages.kl_target=1", "advantages.kl_coef=0"], "kl_coef"),  # 0 times any factor stays 0
        # issue 36 (R1): the engine's log-probs of a filtered sample are not the trainer's over the whole vocabulary
        (["ppo.tis_cap=2", "sampling.top_p=0.9"], "ppo.tis_cap"),
        (["ppo.tis_cap=2", "sampling.top_k=50"], "sampling.top_k"),
        # issue 43: rounds of candidates for a campaign that labels none
        (["sizes.decisive_pairs=8", "labeler=import", "data.preferences=p.jsonl"], "this campaign labels none"),
        (["sizes.decisive_pairs=8", "reward.source=function", "reward.function=m:f"], "`reward.source` not reward"),
        (["sizes.decisive_pairs=0"], "sizes.decisive_pairs"),
    ],
)
def test_bad_config_is_refused_with_a_message_naming_the_problem(overrides, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(CONFIGS / "demo.yaml", overrides)


def test_missing_or_malformed_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("ppo: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_run_root_is_made_absolute():
    assert load_config(CONFIGS / "demo.yaml", ["run_root=relative/dir"]).run_root.is_absolute()


def test_config_renders_as_a_json_schema_form():
    schema = PipelineConfig.model_json_schema()
    assert {"sampling", "ppo", "advantages", "reward_model", "labeler"} <= set(schema["properties"])
    labeler = schema["properties"]["labeler"]["anyOf"][0]
    assert labeler["enum"] == ["gold", "import", "reward_model", "human", "function"]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_a_group_estimator_without_groups_is_refused_naming_both_settings(estimator):
    with pytest.raises(ConfigError, match=r"`advantages\.estimator` .*`sizes\.samples_per_prompt` >= 2, got 1"):
        load_config(CONFIGS / "tiny.yaml", [f"advantages.estimator={estimator}"])
    config = load_config(CONFIGS / "tiny.yaml", [f"advantages.estimator={estimator}", "sizes.samples_per_prompt=2"])
    assert config.sizes.samples_per_prompt == 2
    # REINFORCE++ and GAE need no groups.
    load_config(CONFIGS / "tiny.yaml", ["advantages.estimator=reinforce_pp"])


USER_WORLD = ["model.policy=/models/qwen2", "data.prompts=p.jsonl", "data.eval_prompts=e.jsonl"]


def test_issue15_the_defaults_use_nothing_of_the_demo_and_say_what_to_set():
    # `rlhf run` with no config: nothing to train on, and nothing of the demo is guessed.
    with pytest.raises(ConfigError, match=r"set `model\.policy`, `data\.prompts`, `data\.eval_prompts`.*demo\.yaml"):
        load_config(None)
    # Your own model alone: the demo's prompts are not used for it.
    with pytest.raises(ConfigError, match=r"set `data\.prompts`, `data\.eval_prompts`"):
        load_config(None, ["model.policy=/models/qwen2"])
    # With model and prompts, who labels must be said (no silent `gold`).
    with pytest.raises(ConfigError, match=r"set `labeler`"):
        load_config(None, USER_WORLD)
    config = load_config(None, [*USER_WORLD, "labeler=human"])
    assert (config.campaign, config.demo) == ("default", False)
    # The built-in learning rates and lengths are a real model's (OpenRLHF / TRL), not the demo's.
    assert (config.ppo.actor_learning_rate, config.ppo.critic_learning_rate) == (1e-6, 9e-6)
    assert (config.reward_model.learning_rate, config.reward_model.epochs) == (9e-6, 1)
    assert config.sampling.max_new_tokens == 256
    demo = load_config(CONFIGS / "demo.yaml")
    assert (demo.ppo.actor_learning_rate, demo.sampling.max_new_tokens, demo.labeler) == (2e-4, 16, "gold")
    # issue 27: and `rlhf --help` says so
    from flows.cli import build_parser

    help_text = " ".join(build_parser().format_help().split())
    assert "model.policy, data.prompts, data.eval_prompts" in help_text and "configs/demo.yaml" in help_text
    assert "defaults run the embedded demo" not in help_text


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["labeler=gold"], "labeler gold is the embedded demo's hidden rubric"),
        (["reward.source=function", "reward.function=demo.gold:gold_score"], "`reward.function` demo.gold"),
    ],
)
def test_issue15_your_own_model_with_the_demo_rubric_is_refused(overrides, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, [*USER_WORLD, *overrides])
    # The demo itself may (its model, prompts and rubric are the demo's, or in its language: `demo`).
    load_config(None, ["demo=true", *overrides])


def test_issue15_rlhf_config_prints_each_description_as_a_comment_and_loads_back(tmp_path):
    from campaign.config import commented_yaml

    config = load_config(CONFIGS / "demo.yaml", ["ppo.clip_eps=0.1"])
    text = commented_yaml(config)
    assert "# Policy ratio clip epsilon (Schulman et al. 2017).\n  clip_eps: 0.1" in text
    (tmp_path / "printed.yaml").write_text(text)
    assert load_config(tmp_path / "printed.yaml") == config


def test_issue15_a_misspelt_key_gets_a_did_you_mean():
    with pytest.raises(ConfigError, match=r"`ppo\.epoch` is not a setting \(did you mean `ppo\.epochs`\?\)"):
        load_config(CONFIGS / "demo.yaml", ["ppo.epoch=3"])


def test_issue15_commands_that_read_the_store_import_neither_torch_nor_prefect(tmp_path):
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from flows.cli import main\n"
        f"code = main(['compare', 'demo:1', '--set', 'run_root={tmp_path}'])\n"
        "print(code, sorted(m for m in ('torch', 'transformers', 'prefect') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "2 []", result  # no store: a one-line error, and no heavy import


def test_issue15_a_finished_stage_is_one_summary_line():
    from flows.console import summary_line

    line = summary_line("train_reward_model", {"seconds": 2.04, "eval_accuracy": 0.875, "eval_pairs": 51.0})
    assert line == "  train_reward_model     2.0 s  RM accuracy 0.88, 51 held-out pairs"


def test_issue43_an_evaluation_whose_reward_rises_while_its_judge_falls_below_the_start_is_said():
    from flows.console import overoptimisation_notice

    exploited = {"reward_mean": 0.8, "reference_reward_mean": 0.2, "rubric_mean": 0.1, "reference_rubric_mean": 0.25}
    assert overoptimisation_notice(exploited) == (
        "over-optimising: the reward rates the policy above the initial policy (0.8 > 0.2), the rubric below it "
        "(0.1 < 0.25); see the campaign's over-optimisation figure"
    )
    learning = {**exploited, "rubric_mean": 0.3}
    gold_first = {**exploited, "gold_mean": 0.6, "reference_gold_mean": 0.5}  # the hidden judge, when there is one
    assert overoptimisation_notice(learning) is None and overoptimisation_notice(gold_first) is None
    assert overoptimisation_notice({"reward_mean": 0.8, "reference_reward_mean": 0.2}) is None  # no judge: no claim


def test_issue43_an_update_stopped_at_its_kl_budget_is_said():
    from flows.console import kl_budget_notice

    assert kl_budget_notice({"at_kl_budget": 1.0, "optimizer_steps": 2.0}) == (
        "at the KL budget (`ppo.kl_budget`): the update stopped after 2 optimizer step(s)"
    )
    assert kl_budget_notice({"at_kl_budget": 1.0, "optimizer_steps": 0.0}) == (
        "at the KL budget (`ppo.kl_budget`): the policy was past it before the update, which took no step"
    )
    assert kl_budget_notice({"at_kl_budget": 0.0, "optimizer_steps": 4.0}) is None
    assert kl_budget_notice({"optimizer_steps": 4.0}) is None  # no budget


def test_a_reward_model_eval_split_that_leaves_nothing_to_train_on_is_refused_before_anything_runs():
    load_config(CONFIGS / "tiny.yaml", ["reward_model.eval_fraction=0.1"])  # 2 of 16 held out: few, and run (issue 43)
    with pytest.raises(ConfigError, match=r"eval_fraction` 0.99 of 16 preference pairs holds out 16 and leaves 0"):
        load_config(CONFIGS / "tiny.yaml", ["reward_model.eval_fraction=0.99"])


def test_an_fsdp2_accelerate_config_is_read_and_a_data_parallel_one_accepted_issue_25(tmp_path):
    """FSDP2 configs give the stages' sharding; what the stages cannot run is refused (tests/flows/test_sharded_training.py)."""
    config = load_config(
        CONFIGS / "tiny.yaml",
        [f"execution.accelerate_config={CONFIGS / 'accelerate' / 'fsdp.yaml'}", "execution.training_processes=2"],
    )
    assert config.execution.sharding == Sharding(layer_classes=(), reshard_after_forward=True)
    layers = tmp_path / "layers.yaml"
    layers.write_text(
        "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: SHARD_GRAD_OP\n"
        "  fsdp_transformer_layer_cls_to_wrap: GPT2Block, LlamaDecoderLayer\n"
    )
    config = load_config(
        CONFIGS / "tiny.yaml", [f"execution.accelerate_config={layers}", "execution.training_processes=2"]
    )
    assert config.execution.sharding == Sharding(
        layer_classes=("GPT2Block", "LlamaDecoderLayer"), reshard_after_forward=False
    )
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(CONFIGS / "tiny.yaml", [f"execution.accelerate_config={tmp_path / 'missing.yaml'}"])
    data_parallel = tmp_path / "ddp.yaml"
    data_parallel.write_text("distributed_type: MULTI_GPU\nnum_processes: 8\ngpu_ids: all\n")
    config = load_config(CONFIGS / "tiny.yaml", [f"execution.accelerate_config={data_parallel}"])
    assert config.execution.accelerate_config == data_parallel


def test_issue27_relative_paths_in_a_file_follow_the_file_and_those_of_set_the_working_directory(tmp_path, monkeypatch):
    folder, elsewhere = tmp_path / "campaign", tmp_path / "elsewhere"
    (folder / "model").mkdir(parents=True)
    elsewhere.mkdir()
    (folder / "own.yaml").write_text(
        "model:\n  policy: model\n  tokenizer: org/name\ndata:\n  prompts: prompts.jsonl\n"
        "  eval_prompts: ../held-out/eval.jsonl\nrun_root: runs\nlabeler: human\n"
    )
    monkeypatch.chdir(elsewhere)
    config = load_config(folder / "own.yaml")
    assert config.model.policy == str(folder / "model")
    assert config.model.tokenizer == "org/name"  # a hub name: no such folder beside the file
    assert config.data.prompts == folder / "prompts.jsonl"
    assert config.data.eval_prompts == tmp_path / "held-out" / "eval.jsonl"
    assert config.run_root == folder / "runs"
    overridden = load_config(folder / "own.yaml", ["data.prompts=mine.jsonl", "model.policy=./model"])
    assert overridden.data.prompts == elsewhere / "mine.jsonl"
    assert overridden.model.policy == str(elsewhere / "model")


def test_issue27_a_run_from_another_folder_finds_the_files_beside_its_config_and_names_the_path_it_looked_at(
    tmp_path, checkpoint_world
):
    folder, elsewhere = tmp_path / "campaign", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    shutil.copy(checkpoint_world["prompts"], folder / "prompts.jsonl")
    (folder / "own.yaml").write_text(
        f"model:\n  policy: {checkpoint_world['policy']}\nlabeler: human\n"
        "data:\n  prompts: prompts.jsonl\n  eval_prompts: eval.jsonl\n"
    )
    command = [sys.executable, "-m", "flows", "run", "--config", str(folder / "own.yaml")]
    command += ["--set", f"run_root={tmp_path / 'runs'}"]
    root = Path(__file__).resolve().parents[2]
    finished = subprocess.run(
        command,
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert finished.returncode == 2, finished.stderr[-3000:]
    assert finished.stderr.strip().splitlines() == [f"rlhf: `data.eval_prompts` {folder / 'eval.jsonl'} does not exist"]


def test_issue27_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("reward_model:\n  epochs: 2\nppo:\n  epochs: 1\nreward_model:\n  train: false\n")
    with pytest.raises(ConfigError, match=r"`reward_model` is given twice, at lines 1 and 5"):
        load_config(twice)
    nested = tmp_path / "nested.yaml"
    nested.write_text("ppo:\n  epochs: 1\n  clip_eps: 0.1\n  epochs: 3\n")
    with pytest.raises(ConfigError, match=r"nested.yaml: `epochs` is given twice, at lines 2 and 4"):
        load_config(nested)


def test_issue26_an_execution_setting_under_its_old_name_is_read_in_its_new_place_with_a_notice(tmp_path, caplog):
    from campaign.config import MOVED_SETTINGS, _tell_moved, setting_names

    assert not set(MOVED_SETTINGS) & set(setting_names()) and set(MOVED_SETTINGS.values()) <= set(setting_names())
    _tell_moved.cache_clear()  # each notice is said once per process: this test counts them
    old = tmp_path / "old.yaml"
    old.write_text("demo: true\nlabeler: gold\ndevice: cpu\ntorch_threads: 2\nmodel:\n  gradient_checkpointing: true\n")
    new = tmp_path / "new.yaml"
    new.write_text(
        "demo: true\nlabeler: gold\nexecution:\n  device: cpu\n  torch_threads: 2\n  gradient_checkpointing: true\n"
    )
    overrides = ["checkpoint_seconds=5", "torch_threads=3"]  # --set wins over the file, as ever
    config = load_config(old, overrides)
    assert config == load_config(new, ["execution.checkpoint_seconds=5", "execution.torch_threads=3"])
    assert (config.execution.torch_threads, config.execution.checkpoint_seconds) == (3, 5.0)
    said = [record.getMessage() for record in caplog.records if record.name == "campaign.config"]
    assert len(said) == len(MOVED_SETTINGS) + 1  # the file's three, then each --set
    assert said[0] == (
        f"config file {old}: `device` is now `execution.device`; the old name is read until the next release, "
        "which refuses it"
    )
    assert said[-1].startswith("--set torch_threads=3: `torch_threads` is now `execution.torch_threads`;")


def test_issue26_a_setting_given_under_both_names_is_refused(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text("device: cpu\nexecution:\n  device: cuda\n")
    with pytest.raises(ConfigError, match=r"both.yaml: `device` is the old name of `execution\.device`, and both"):
        load_config(both)
