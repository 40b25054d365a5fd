"""Issue 14 bad-input suite: everything a hostile but fair user can get wrong, refused cleanly.

Each case runs the ``rlhf`` command (in this process through ``flows.cli.main``, or as a subprocess
where it takes a signal, a mount or a second process) and asserts the same four things:

* exit code 2;
* stderr ends in one message of at most two lines, ``rlhf: ...``, naming the problem (the setting,
  file, row or field), with no traceback and no Prefect error record before it;
* nothing half-written: no file under the run root appeared or changed except the MLflow database
  and the lock file, and no hidden temporary or partial folder is left (a run interrupted mid-stage keeps
  its stage's finished shard pieces in ``.partial``, whole, for the next run to resume from);
* no MLflow run is left RUNNING.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from flows.cli import main
from flows.iterations import tracking_store
from tests.flows.campaigns import copy_campaign

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


@dataclass(frozen=True)
class Case:
    """``make(tmp_path, world) -> argv`` (after ``rlhf``); the message must contain every string of ``names``."""

    id: str
    make: Callable[[Path, dict[str, Path]], list[str]]
    names: tuple[str, ...]


def _run(tmp: Path, world: dict[str, Path], *overrides: str, command: str = "run") -> list[str]:
    """``rlhf <command> --config tiny.yaml`` on the test's checkpoint world, with ``overrides`` last."""
    sets = [
        f"run_root={tmp / 'runs'}",
        f"model.policy={world['policy']}",
        f"data.prompts={world['prompts']}",
        f"data.eval_prompts={world['eval_prompts']}",
        "iterations=1",
        *overrides,
    ]
    return [command, "--config", str(TINY), *(f"--set={item}" for item in sets)]


def _file(tmp: Path, name: str, content: str | bytes) -> Path:
    path = tmp / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def _with(tmp: Path, setting: str, name: str, content: str | bytes) -> str:
    """The override pointing ``setting`` at a new file ``name`` holding ``content``."""
    return f"{setting}={_file(tmp, name, content)}"


def _jsonl(rows: list[object]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def _sft_data(tmp: Path, second: dict) -> str:
    """The override pointing ``sft.data`` at a file of a good example, then ``second``."""
    return _with(tmp, "sft.data", "sft.jsonl", _jsonl([{"prompt": "the dog", "completion": " ran ."}, second]))


def _policy(tmp: Path, world: dict[str, Path], change: Callable[[Path], None]) -> str:
    """A copy of the test's policy folder with ``change`` applied."""
    copy = tmp / "policy"
    shutil.copytree(world["policy"], copy)
    change(copy)
    return f"model.policy={copy}"


def _config_file(tmp: Path, text: str) -> list[str]:
    return ["run", "--config", str(_file(tmp, "bad.yaml", text)), f"--set=run_root={tmp / 'runs'}"]


BAD_JSON_LINE = "{oops\n"
ARRAY_LINE = "[1, 2]\n"
NOT_UTF8 = b'{"prompt": "\xff\xfe"}\n'
RAGGED_CSV = "prompt\nok\nok,extra\n"
PAIR = {"prompt": "the sun", "chosen": "is warm", "rejected": "is cold"}
LONG = " ".join(["the sun is warm"] * 20)  # 80 words: more than the test model's 64 positions

CONFIG_CASES = [
    Case("config-missing", lambda t, w: ["run", "--config", str(t / "nope.yaml")], ("nope.yaml", "does not exist")),
    Case("config-not-yaml", lambda t, w: _config_file(t, "ppo: [1, 2\n"), ("bad.yaml", "not valid YAML", "line")),
    Case("config-not-a-mapping", lambda t, w: _config_file(t, "- 1\n- 2\n"), ("bad.yaml", "mapping")),
    Case("config-unknown-key", lambda t, w: _config_file(t, "ppo:\n  epoch: 2\n"), ("`ppo.epoch`", "ppo.epochs")),
    Case("config-bad-type", lambda t, w: _config_file(t, "sampling:\n  temperature: hot\n"), ("sampling.temperature",)),
    Case(
        "config-key-twice",
        lambda t, w: _config_file(t, "labeler: human\nppo:\n  epochs: 2\nlabeler: import\n"),
        ("bad.yaml", "`labeler` is given twice", "lines 1 and 4"),
    ),
    Case("set-malformed", lambda t, w: _run(t, w, "nonsense"), ("--set nonsense", "section.field=value")),
    Case("set-bad-yaml", lambda t, w: _run(t, w, "k=[1,"), ("--set k=[1,", "not valid YAML")),
    Case("set-not-a-section", lambda t, w: _run(t, w, "ppo.epochs.x=1"), ("`ppo.epochs` is not a section",)),
    Case("set-unknown-key", lambda t, w: _run(t, w, "sampling.max_new_token=3"), ("sampling.max_new_tokens",)),
    Case("set-nan", lambda t, w: _run(t, w, "ppo.clip_eps=.nan"), ("`ppo.clip_eps`", "finite", "--set")),
    Case("set-inf", lambda t, w: _run(t, w, "reward_model.learning_rate=.inf"), ("reward_model.learning_rate",)),
    Case("set-nan-lr", lambda t, w: _run(t, w, "ppo.actor_learning_rate=.nan"), ("ppo.actor_learning_rate",)),
    Case(
        "set-inf-seconds",
        lambda t, w: _run(t, w, "execution.checkpoint_seconds=.inf"),
        ("execution.checkpoint_seconds", "finite"),
    ),
    Case("set-gamma-range", lambda t, w: _run(t, w, "advantages.gamma=1.5"), ("`advantages.gamma`", "<= 1")),
    Case("set-top-p-zero", lambda t, w: _run(t, w, "sampling.top_p=0"), ("`sampling.top_p`", "> 0")),
    Case("set-negative-epochs", lambda t, w: _run(t, w, "ppo.epochs=-1"), ("`ppo.epochs`",)),
    Case("set-zero-prompts", lambda t, w: _run(t, w, "sizes.rollout_prompts=0"), ("sizes.rollout_prompts",)),
    Case("set-odd-candidates", lambda t, w: _run(t, w, "sizes.candidates_per_prompt=3"), ("candidates_per_prompt",)),
    Case("set-too-few-pairs", lambda t, w: _run(t, w, "sizes.preference_prompts=1"), ("preference pairs", "4")),
    Case("set-unknown-labeler", lambda t, w: _run(t, w, "labeler=nope"), ("`labeler`", "nope")),
    Case("set-import-without-file", lambda t, w: _run(t, w, "labeler=import"), ("data.preferences",)),
    Case("set-bad-campaign-name", lambda t, w: _run(t, w, "campaign=has space"), ("`campaign`",)),
    Case(
        "critic-from-the-reward-model-on-raw-scores",
        lambda t, w: _run(t, w, "model.critic_init=reward_model", "advantages.normalize_scores=false"),
        ("`model.critic_init` reward_model", "`advantages.normalize_scores` true"),
    ),
    Case(
        "serve-bad-cron",
        lambda t, w: ["serve", "--config", str(TINY), "--cron", "not a cron"],
        ("--cron", "not a cron"),
    ),
    Case(
        "serve-bad-interval",
        lambda t, w: ["serve", "--config", str(TINY), "--interval", "nan"],
        ("interval", "positive"),
    ),
    Case("fp16-on-cpu", lambda t, w: _run(t, w, "precision=fp16", "execution.device=cpu"), ("`precision` fp16",)),
    Case(
        "issue45-dpo-without-a-preference-source",
        lambda t, w: _run(t, w, "update=dpo", "labeler=null"),
        ("`update` dpo learns from labelled pairs", "`labeler`"),
    ),
    Case(
        "issue45-dpo-with-a-reward-function",
        lambda t, w: _run(
            t, w, "update=dpo", "reward.source=function", "reward.function=tests.flows.rewards:length_score"
        ),
        ("`reward.source`", "`update` dpo", "`labeler` function"),
    ),
    Case(
        "issue45-dpo-with-staleness",
        lambda t, w: _run(t, w, "update=dpo", "sampling.staleness=1"),
        ("`sampling.staleness`", "`update` dpo"),
    ),
    Case(
        "issue45-sft-settings-without-data", lambda t, w: _run(t, w, "sft.epochs=2"), ("`sft` settings", "`sft.data`")
    ),
    Case(
        "issue45-sft-on-the-vllm-engine",
        lambda t, w: _run(t, w, "sft.data=x.jsonl", "sampling.engine=vllm"),
        ("`sft.data`", "`sampling.engine` vllm"),
    ),
    Case(
        "issue45-sft-packed-length-without-packing",
        lambda t, w: _run(t, w, "sft.data=x.jsonl", "sft.packed_length=64"),
        ("`sft.packed_length`", "`packing`"),
    ),
    Case("issue45-dpo-settings-under-ppo", lambda t, w: _run(t, w, "dpo.beta=0.5"), ("`dpo` settings", "`update` dpo")),
    Case(
        "issue45-label-smoothing-off-the-sigmoid-loss",
        lambda t, w: _run(t, w, "update=dpo", "dpo.loss=ipo", "dpo.label_smoothing=0.1"),
        ("`dpo.label_smoothing`", "sigmoid"),
    ),
    Case("issue45-unknown-dpo-loss", lambda t, w: _run(t, w, "update=dpo", "dpo.loss=kto"), ("`dpo.loss`", "kto")),
    Case(
        "issue45-offline-dpo-file-under-another-labeler",
        lambda t, w: _run(t, w, "update=dpo", _with(t, "data.preferences", "p.jsonl", _jsonl([PAIR]))),
        ("`data.preferences`", "labeler import only", "`labeler` gold"),
    ),
]

FILE_CASES = [
    Case(
        "prompts-misspelt-column",
        lambda t, w: _run(
            t, w, _with(t, "data.prompts", "p.jsonl", _jsonl([{"mesages": [{"role": "user", "content": "a"}]}]))
        ),
        ("`data.prompts`", "row 1", "field 'mesages'", "did you mean 'messages'"),
    ),
    Case(
        "prompts-missing",
        lambda t, w: _run(t, w, f"data.prompts={t / 'missing.jsonl'}"),
        ("`data.prompts`", "does not exist"),
    ),
    Case(
        "prompts-empty",
        lambda t, w: _run(t, w, _with(t, "data.prompts", "p.jsonl", "")),
        ("`data.prompts`", "holds no prompts"),
    ),
    Case(
        "prompts-bad-json",
        lambda t, w: _run(t, w, _with(t, "data.prompts", "p.jsonl", _jsonl([{"prompt": "a"}]) + BAD_JSON_LINE)),
        ("`data.prompts`", "row 2", "invalid JSON"),
    ),
    Case(
        "prompts-not-an-object",
        lambda t, w: _run(t, w, _with(t, "data.prompts", "p.jsonl", ARRAY_LINE)),
        ("row 1", "JSON object"),
    ),
    Case(
        "prompts-missing-field",
        lambda t, w: _run(t, w, _with(t, "data.prompts", "p.jsonl", _jsonl([{"prompt": "a"}, {"text": "b"}]))),
        ("row 2", "field 'prompt'", "missing"),
    ),
    Case(
        "prompts-empty-prompt",
        lambda t, w: _run(t, w, _with(t, "data.prompts", "p.jsonl", _jsonl([{"prompt": "  "}]))),
        ("row 1", "field 'prompt'", "empty"),
    ),
    Case(
        "prompts-not-utf8",
        lambda t, w: _run(t, w, _with(t, "data.prompts", "p.jsonl", NOT_UTF8)),
        ("row 1", "not UTF-8"),
    ),
    Case(
        "prompts-10mb-line",
        lambda t, w: _run(t, w, _with(t, "data.prompts", "p.jsonl", _jsonl([{"prompt": "w " * 5_000_000}]))),
        ("`data.prompts`", "row 1", "4 MiB"),
    ),
    Case(
        "prompts-longer-than-the-context",
        lambda t, w: _run(t, w, _with(t, "data.prompts", "p.jsonl", _jsonl([{"prompt": "a"}, {"prompt": LONG}]))),
        ("`data.prompts`", "row 2", "`sampling.max_new_tokens`=8", "context length 64"),
    ),
    Case(
        "prompts-unsupported-type",
        lambda t, w: _run(t, w, _with(t, "data.prompts", "p.txt", "hello")),
        ("p.txt", "unsupported file type"),
    ),
    Case(
        "prompts-ragged-csv",
        lambda t, w: _run(t, w, _with(t, "data.prompts", "p.csv", RAGGED_CSV)),
        ("p.csv", "row 2", "more values"),
    ),
    Case(
        "prompts-corrupt-parquet",
        lambda t, w: _run(t, w, _with(t, "data.prompts", "p.parquet", "not parquet")),
        ("p.parquet", "not a readable Parquet file"),
    ),
    Case(
        "prompts-too-few-for-the-rounds",  # issue 43: 4 rounds of 16 fresh prompts, 48 in the file
        lambda t, w: _run(t, w, "sizes.decisive_pairs=8", "sizes.max_rounds=4"),
        ("`data.prompts`", "holds 48 prompts", "`sizes.max_rounds` 4 rounds of `sizes.preference_prompts` 16", "64"),
    ),
    Case(
        "eval-prompts-empty",
        lambda t, w: _run(t, w, _with(t, "data.eval_prompts", "e.jsonl", "")),
        ("`data.eval_prompts`", "holds no prompts"),
    ),
    Case(
        "eval-prompts-too-few",
        lambda t, w: _run(t, w, _with(t, "data.eval_prompts", "e.jsonl", _jsonl([{"prompt": "a"}] * 3))),
        ("`data.eval_prompts`", "holds 3 prompts", "`sizes.eval_prompts` asks for 8"),
    ),
    Case(
        "response-longer-than-the-context",
        lambda t, w: _run(t, w, "sampling.max_new_tokens=64"),
        ("`sampling.max_new_tokens`=64", "context length 64"),
    ),
    Case(
        "preferences-missing-field",
        lambda t, w: _run(
            t, w, "labeler=import", f"data.preferences={_file(t, 'p.jsonl', _jsonl([PAIR, {'prompt': 'x'}]))}"
        ),
        ("`data.preferences`", "row 2", "field 'chosen'", "missing"),
    ),
    Case(
        "preferences-too-few",
        lambda t, w: _run(t, w, "labeler=import", _with(t, "data.preferences", "p.jsonl", _jsonl([PAIR] * 2))),
        ("`data.preferences`", "2 preference pairs", "at least 4"),
    ),
    Case(
        "issue45-offline-dpo-on-no-pairs",
        lambda t, w: _run(t, w, "update=dpo", "labeler=import", _with(t, "data.preferences", "p.jsonl", "")),
        ("`data.preferences`", "no preference pairs", "the DPO update needs at least 1"),
    ),
    Case(
        "preferences-transcript-without-turn",
        lambda t, w: _run(
            t,
            w,
            "labeler=import",
            _with(t, "data.preferences", "p.jsonl", _jsonl([{"chosen": "a", "rejected": "b"}])),
        ),
        ("row 1", "field 'chosen'", "Assistant:"),
    ),
    Case(
        "preferences-nan-margin",
        lambda t, w: _run(
            t,
            w,
            "labeler=import",
            _with(t, "data.preferences", "p.jsonl", _jsonl([{**PAIR, "margin": float("nan")}])),
        ),
        ("row 1", "field 'margin'", "finite"),
    ),
    Case(
        "preferences-longer-than-the-context",
        lambda t, w: _run(
            t,
            w,
            "labeler=import",
            # 17 pairs: enough for the held-out split, so the long row is the one problem
            _with(t, "data.preferences", "p.jsonl", _jsonl([PAIR] * 16 + [{**PAIR, "chosen": LONG}])),
        ),
        ("`data.preferences`", "row 17", "field 'chosen'", "context length 64"),
    ),
    Case(
        "issue45-sft-data-without-an-assistant-turn",
        lambda t, w: _run(t, w, _sft_data(t, {"messages": [{"role": "user", "content": "the dog"}]})),
        ("`sft.data`", "row 2", "field 'messages'", "no assistant turn"),
    ),
    Case(
        "issue45-sft-example-longer-than-the-context",
        lambda t, w: _run(t, w, _sft_data(t, {"prompt": "the dog", "completion": LONG})),
        ("`sft.data`", "row 2", "context length 64"),
    ),
    Case(
        "issue45-sft-example-longer-than-a-packed-row",
        lambda t, w: _run(
            t, w, _sft_data(t, {"prompt": "the dog", "completion": " ran ."}), "sft.packing=true", "sft.packed_length=2"
        ),
        ("`sft.data`", "row 1", "`sft.packed_length` 2", "never split"),
    ),
]


def _truncate(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _shrink_vocabulary(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 5}))


MODEL_CASES = [
    Case("policy-missing", lambda t, w: _run(t, w, f"model.policy={t / 'nowhere'}"), ("`model.policy`", "nowhere")),
    Case("policy-not-a-checkpoint", lambda t, w: _run(t, w, f"model.policy={t}"), ("`model.policy`", "config.json")),
    Case(
        "policy-corrupt-config",
        lambda t, w: _run(t, w, _policy(t, w, lambda f: (f / "config.json").write_text("{not json"))),
        ("`model.policy`", "config.json cannot be read"),
    ),
    Case(
        "policy-truncated-weights",
        lambda t, w: _run(t, w, _policy(t, w, _truncate)),
        ("model.safetensors", "not a readable safetensors file"),
    ),
    Case(
        "policy-without-weights",
        lambda t, w: _run(t, w, _policy(t, w, lambda f: (f / "model.safetensors").unlink())),
        ("`model.policy`", "holds no weights"),
    ),
    Case(
        "tokenizer-missing",
        lambda t, w: _run(t, w, f"model.tokenizer={t / 'no-tokenizer'}"),
        ("`model.tokenizer`", "does not exist"),
    ),
    Case(
        "tokenizer-folder-without-one",
        lambda t, w: _run(t, w, f"model.tokenizer={(t / 'empty').mkdir() or t / 'empty'}"),
        ("`model.tokenizer`", "no tokenizer loads"),
    ),
    Case(
        "tokenizer-larger-than-the-vocabulary",
        lambda t, w: _run(t, w, _policy(t, w, _shrink_vocabulary)),
        ("tokens, more than the model's vocabulary of 5",),
    ),
]


def _gguf(tmp: Path, setting: str, *, arch: str | None) -> str:
    """``setting`` pointing at a GGUF file: of the architecture ``arch``, or not a GGUF file at all (None)."""
    from tests.flows.test_model_sources import write_gguf

    path = tmp / "model.gguf"
    if arch is None:
        path.write_bytes(b"not a gguf file\n")
    else:
        write_gguf(path, arch=arch)
    return f"{setting}={path}"


MODEL_CASES += [
    Case(
        "policy-gguf-not-gguf",
        lambda t, w: _run(t, w, _gguf(t, "model.policy", arch=None)),
        ("`model.policy`", "model.gguf", "cannot be converted", "GGUF magic"),
    ),
    Case(
        "policy-gguf-unknown-architecture",
        lambda t, w: _run(t, w, _gguf(t, "model.policy", arch="rwkv6")),
        ("`model.policy`", "model.gguf", "architecture rwkv6 is not supported"),
    ),
    Case(
        "reward-model-gguf-not-gguf",
        lambda t, w: _run(t, w, _gguf(t, "model.reward_model", arch=None)),
        ("`model.reward_model`", "model.gguf", "cannot be converted"),
    ),
    Case(
        "policy-package-not-installed",
        lambda t, w: _run(t, w, "model.policy=pkg:no_such_package_here/m.gguf"),
        ("`model.policy`", "no_such_package_here", "installed"),
    ),
]


def _reward_beside_config(tmp: Path, world: dict[str, Path], source: str) -> list[str]:
    """``rlhf run`` of a config file whose reward function is in a module beside it (never on the Python path)."""
    module = f"beside_{uuid.uuid4().hex}"
    folder = tmp / "project"
    folder.mkdir()
    (folder / f"{module}.py").write_text(source)
    config = folder / "campaign.yaml"
    config.write_text(TINY.read_text() + f"reward:\n  source: function\n  function: {module}:reward\n")
    return _run(tmp, world)[:1] + ["--config", str(config)] + _run(tmp, world)[3:]


MODEL_CASES += [
    Case(
        "labeler-reward-model-without-one",
        lambda t, w: _run(t, w, "labeler=reward_model"),
        ("labeler reward_model needs `model.reward_model`",),
    ),
    Case(
        "labeler-reward-model-without-a-head",
        lambda t, w: _run(t, w, "labeler=reward_model", f"model.reward_model={w['policy']}"),
        ("`model.reward_model`", "has no reward head"),
    ),
    Case(
        "reward-function-unimportable",
        lambda t, w: _run(t, w, "reward.source=function", "reward.function=no_such_module_here:reward"),
        ("`reward.function`", "no_such_module_here", "looked up"),
    ),
    Case(
        "reward-function-missing-callable",
        lambda t, w: _run(t, w, "reward.source=function", "reward.function=demo.gold:no_such_function"),
        ("`reward.function`", "no_such_function"),
    ),
    Case(
        "reward-function-beside-the-config-with-a-wrong-signature",
        lambda t, w: _reward_beside_config(t, w, "def reward(prompt):\n    return 1.0\n"),
        ("`reward.function`", "cannot be called as (prompt, response, **columns)"),
    ),
    Case(
        "reward-function-beside-the-config-that-raises",
        lambda t, w: _reward_beside_config(t, w, "def reward(prompt, response):\n    return 1 / 0\n"),
        ("`reward.function`", "raised on prompt row 1 of `data.prompts`", "ZeroDivisionError"),
    ),
]
if not torch.cuda.is_available():
    MODEL_CASES.append(
        Case("cuda-without-a-gpu", lambda t, w: _run(t, w, "execution.device=cuda"), ("`execution.device`", "no CUDA"))
    )


def _files(run_root: Path) -> dict[str, str]:
    """``path -> sha256`` of every file under the run root but the MLflow database, the lock and the record of the
    campaign's concurrency slot beside it (which a refused run may touch) and hidden temporary folders (checked
    apart: none may be left)."""
    if not run_root.exists():
        return {}
    return {
        str(path.relative_to(run_root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in run_root.rglob("*")
        if path.is_file()
        and not path.name.startswith("mlflow.db")
        and path.name not in (".lock", ".slot")
        and not any(".tmp-" in part for part in path.parts)
    }


def _assert_refused(
    code: int | None, stderr: str, run_root: Path, names: tuple[str, ...], before: dict, *, progress: bool = False
) -> None:
    lines = stderr.strip().splitlines()
    assert code == 2, f"exit code {code}; stderr:\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr[-3000:]
    assert not [line for line in lines if "| ERROR" in line], stderr[-3000:]
    starts = [index for index, line in enumerate(lines) if line.startswith("rlhf: ")]
    assert len(starts) == 1, f"one message expected:\n{stderr[-3000:]}"
    message = "\n".join(lines[starts[0] :])
    assert len(lines) - starts[0] <= 2, f"the message is more than two lines:\n{message}"
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"
    after = _files(run_root)
    assert after == before, f"written or changed: {sorted(set(after.items()) ^ set(before.items()))[:5]}"
    hidden = [
        p
        for p in run_root.rglob("*")
        if ".tmp-" in p.name or (p.name.endswith(".partial") and not progress) or ".download-" in p.name
    ]
    assert not hidden, f"half-written: {hidden}"
    for folder in run_root.rglob("*.partial"):  # progress only: whole shard pieces, published under their names
        pieces = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
        assert all(re.fullmatch(r"shards/shard-\d{5}\.parquet", piece) for piece in pieces), pieces
    database = run_root / "mlflow.db"
    if database.exists():
        client = MlflowClient(tracking_uri=f"sqlite:///{database}")
        experiments = [e.experiment_id for e in client.search_experiments()]
        running = [r.info.run_name for r in client.search_runs(experiments) if r.info.status == "RUNNING"]
        assert not running, f"left RUNNING: {running}"


def _main(argv: list[str], capfd) -> tuple[int, str]:
    capfd.readouterr()
    code = main(argv)
    return code, capfd.readouterr().err


@pytest.mark.parametrize("case", CONFIG_CASES + FILE_CASES + MODEL_CASES, ids=lambda case: case.id)
def test_issue14_refused_before_anything_runs(case: Case, checkpoint_world, tmp_path, capfd):
    argv = case.make(tmp_path, checkpoint_world)
    code, stderr = _main(argv, capfd)
    _assert_refused(code, stderr, tmp_path / "runs", case.names, {})
    assert not (tmp_path / "runs").exists(), "a refused command creates no run root"


# --- a finished campaign, then outputs edited, replays of what does not exist, locks ----------


@pytest.fixture(scope="module")
def finished(one_iteration_campaign) -> Path:
    """The run root of the shared finished one-iteration campaign ``tiny``, the one ``_run`` describes: each test
    changes a copy of it."""
    return one_iteration_campaign.run_root


def _copy_of(finished: Path, tmp_path: Path) -> Path:
    """A copy of the finished run root where ``_run(tmp_path, ...)`` runs, as if computed there."""
    return copy_campaign(finished, tmp_path / "runs")


def _output(run_root: Path, stage: str) -> Path:
    (folder,) = (run_root / "tiny" / stage).iterdir()
    return folder


def _alter_shard(run_root: Path) -> str:
    shard = next(_output(run_root, "sample_candidates").glob("candidates-*.parquet"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard.name


def _edit_manifest(run_root: Path) -> str:
    path = _output(run_root, "initialize") / "_manifest.json"
    manifest = json.loads(path.read_text())
    manifest["metrics"]["actor_parameters"] = 1.0
    path.write_text(json.dumps(manifest))
    return "_manifest.json"


def _add_a_file(run_root: Path) -> str:
    (_output(run_root, "rollout") / "notes.txt").write_text("mine")
    return "notes.txt"


def _old_schema(run_root: Path) -> str:
    path = _output(run_root, "initialize") / "_manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "schema_version": 1}))
    return "schema version 1"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (_alter_shard, "has been altered"),
        (_edit_manifest, "is corrupt"),
        (_add_a_file, "is not listed"),
        (_old_schema, "run the iteration again"),
    ],  # fmt: skip
    ids=["altered-shard", "edited-manifest", "unlisted-file", "older-schema"],
)
def test_issue14_an_edited_output_is_refused_naming_the_file(
    change, named, finished, checkpoint_world, tmp_path, capfd
):
    """A finished iteration is history (``rlhf run`` reads none of its outputs again); recomputing it from its first
    stage reuses each output, and an edited one is refused, naming the file."""
    # A copy by hand of a private copy, as this test had it before the campaign was shared: its store still names the
    # private copy's folders, and the new iteration-0 run that the refused command starts logs its config.json there,
    # outside the run root checked below (with the store's paths moved too, that file lands under the run root).
    run_root = tmp_path / "runs"
    shutil.copytree(copy_campaign(finished, tmp_path / "computed"), run_root, symlinks=True)
    what = change(run_root)
    before = _files(run_root)
    code, stderr = _main([*_run(tmp_path, checkpoint_world), "--from-iteration", "0"], capfd)
    _assert_refused(code, stderr, run_root, (what, named), before)


def _truncate_shard(run_root: Path) -> str:
    shard = next(_output(run_root, "rollout").glob("experience-*.parquet"))
    shard.write_bytes(shard.read_bytes()[:-100])
    return shard.name


def _alter_checkpoint(run_root: Path) -> str:
    weights = _output(run_root, "ppo_update") / "actor" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0x01
    weights.write_bytes(bytes(data))
    return "actor/model.safetensors"


def _re_sign_manifest(run_root: Path) -> str:
    """A manifest listing a file outside its folder, with its self-checksum computed again (anyone can)."""
    from storage.manifest import canonical_json

    path = _output(run_root, "compute_advantages") / "_manifest.json"
    body = json.loads(path.read_text())
    del body["manifest_sha256"]
    body["files"].append({"path": "../../../x", "sha256": "0" * 64, "bytes": 1, "rows": None, "prunable": True})
    body["manifest_sha256"] = hashlib.sha256(canonical_json(body).encode()).hexdigest()
    path.write_text(json.dumps(body))
    return "'../../../x'"


def _delete_folder(run_root: Path) -> str:
    folder = _output(run_root, "evaluate")
    shutil.rmtree(folder)
    return f"{folder} (the evaluate output of iteration 0) is missing"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (_truncate_shard, "bytes; the manifest says"),
        (_alter_shard, "has been altered"),
        (_alter_checkpoint, "has been altered"),
        (_edit_manifest, "is corrupt"),
        (_re_sign_manifest, "invalid path"),
        (_add_a_file, "is not listed"),
        (_delete_folder, "MLflow keeps no copy of it"),
    ],  # fmt: skip
    ids=[
        "truncated-shard",
        "altered-shard",
        "altered-checkpoint",
        "edited-manifest",
        "re-signed-manifest",
        "unlisted-file",
        "deleted-folder",
    ],  # fmt: skip
)
def test_issue32_a_finished_campaign_run_again_refuses_an_edited_or_missing_output(
    change, named, finished, checkpoint_world, tmp_path, capfd
):
    """What the README promises: running a finished campaign again checks every stage output against its recorded
    digest. Each change is refused in one line naming the file and what to do (a local store keeps no copy of the
    files to restore), before anything is written."""
    run_root = _copy_of(finished, tmp_path)
    what = change(run_root)
    before = _files(run_root)
    code, stderr = _main(_run(tmp_path, checkpoint_world), capfd)
    _assert_refused(code, stderr, run_root, (what, named, "rlhf run --from-iteration 0"), before)


def test_issue42_an_old_iterations_output_removed_by_hand_is_refused_unless_the_campaign_predates_gc_records(
    two_iteration_campaign, checkpoint_world, tmp_path, capfd
):
    """``rm -r`` of iteration 0's evaluation in a two-iteration campaign: no iteration reads it, but ``rlhf gc`` did
    not remove it (its stage run carries no ``rlhf.removed_by_gc``), so the rerun refuses it by name. A campaign
    made before gc recorded what it removes (no ``rlhf.gc_records`` on its experiment) takes it to be gc's, as it
    did then."""
    from campaign.verification import recorded_outputs
    from storage.tracking import TAG_GC_RECORDS

    run_root = _copy_of(two_iteration_campaign.run_root, tmp_path)
    config = two_iteration_campaign.model_copy(update={"run_root": run_root})
    tracker = tracking_store(config).tracker()
    experiment_id = tracker.experiment_id(config.campaign)
    finished = tracker.finished_iterations(experiment_id)
    (evaluation,) = [
        output.folder
        for output in recorded_outputs(config, tracker, experiment_id, finished)
        if output.folder.parent.name == "evaluate" and output.iterations == (0,)
    ]
    shutil.rmtree(evaluation)
    before = _files(run_root)
    argv = _run(tmp_path, checkpoint_world, "iterations=2")
    code, stderr = _main(argv, capfd)
    missing = f"{evaluation} (the evaluate output of iteration 0) is missing"
    _assert_refused(code, stderr, run_root, (missing, "rlhf run --from-iteration 0"), before)

    MlflowClient(tracker.tracking_uri).delete_experiment_tag(experiment_id, TAG_GC_RECORDS)
    code, stderr = _main(argv, capfd)
    assert code == 0, stderr[-3000:]


def test_issue42_rlhf_verify_reads_every_byte_and_names_a_flipped_one_whose_times_were_put_back(
    finished, tmp_path, capfd
):
    run_root = _copy_of(finished, tmp_path)
    verify = ["verify", "tiny", "--set", f"run_root={run_root}"]
    code, _ = _main(verify, capfd)
    assert code == 0
    weights = _output(run_root, "ppo_update") / "actor" / "model.safetensors"
    stat = weights.stat()
    with weights.open("r+b") as file:  # bit rot: one byte, in place, its times put back
        file.seek(stat.st_size - 10)
        byte = file.read(1)
        file.seek(stat.st_size - 10)
        file.write(bytes([byte[0] ^ 0x01]))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    before = _files(run_root)
    code, stderr = _main(verify, capfd)
    _assert_refused(code, stderr, run_root, ("actor/model.safetensors has been altered",), before)


def test_issue32_an_unchanged_finished_campaign_reads_no_output_twice(
    finished, checkpoint_world, tmp_path, capfd, monkeypatch
):
    """The outputs' sha256s are remembered by size and modification time in the run root's fingerprint cache: the
    first rerun of a copied run root hashes every output file, the next none."""
    import storage.fingerprints

    run_root = _copy_of(finished, tmp_path)
    hashed: list[Path] = []
    real = storage.fingerprints.file_sha256
    monkeypatch.setattr(
        storage.fingerprints, "file_sha256", lambda path, **options: hashed.append(Path(path)) or real(path, **options)
    )

    def stages_hashed_by_a_rerun() -> set[str]:
        hashed.clear()
        code, stderr = _main(_run(tmp_path, checkpoint_world), capfd)
        assert code == 0, stderr
        campaign = run_root / "tiny"
        return {path.relative_to(campaign).parts[0] for path in hashed if campaign in path.parents}

    assert stages_hashed_by_a_rerun() >= {"rollout", "ppo_update", "evaluate"}  # new paths to the cache: a copy
    assert stages_hashed_by_a_rerun() == set()


REPLAYS = [
    (lambda t, w: [*_run(t, w, command="replay"), "nosuch:0"], ("no campaign 'nosuch'",)),
    (lambda t, w: [*_run(t, w, command="replay"), "tiny:5"], ("no finished iteration 5",)),
    (lambda t, w: [*_run(t, w, command="replay"), "0123abcd"], ("'0123abcd'", "neither a campaign nor a run id")),
    (
        lambda t, w: [*_run(t, w, "sampling.temperature=0.5", command="replay"), "tiny:0"],
        ("cannot change `sampling.temperature`",),
    ),
    (lambda t, w: [*_run(t, w, command="compare"), "tiny", "--metrics", "nope/x"], ("nope/x",)),
]


@pytest.mark.parametrize(
    ("make", "names"), REPLAYS, ids=["unknown-campaign", "unknown-iteration", "unknown-run", "forbidden", "metric"]
)
def test_issue14_replays_and_comparisons_of_what_does_not_exist_are_refused(
    make, names, finished, checkpoint_world, tmp_path, capfd
):
    run_root = _copy_of(finished, tmp_path)
    before = _files(run_root)
    code, stderr = _main(make(tmp_path, checkpoint_world), capfd)
    _assert_refused(code, stderr, run_root, names, before)


def test_issue14_a_replay_with_no_store_at_all_creates_none(checkpoint_world, tmp_path, capfd):
    code, stderr = _main([*_run(tmp_path, checkpoint_world, command="replay"), "tiny:0"], capfd)
    _assert_refused(code, stderr, tmp_path / "runs", ("no MLflow store",), {})
    assert not (tmp_path / "runs").exists()


def test_issue15_a_campaign_refuses_a_config_it_was_not_started_with(finished, checkpoint_world, tmp_path, capfd):
    """Two configs never share a campaign silently: the campaign remembers its config's fingerprint; where and how it
    runs, how many iterations and what a replay may change (advantage and PPO settings) may change; anything else is
    refused naming the fields, before anything runs."""
    run_root = _copy_of(finished, tmp_path)
    before = _files(run_root)
    code, stderr = _main(_run(tmp_path, checkpoint_world, "sampling.temperature=0.7"), capfd)
    _assert_refused(
        code,
        stderr,
        run_root,
        (
            "campaign `tiny` was started with another config",
            "`sampling.temperature` 1.0 there, 0.7 here",
            "--set campaign=",
        ),
        before,
    )
    experiment = MlflowClient(f"sqlite:///{run_root / 'mlflow.db'}").get_experiment_by_name("tiny")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the MLflow UI opens on runs
    # The same campaign with other execution settings and more iterations is the same campaign (it reuses stage 0 on).
    code, stderr = _main(
        _run(tmp_path, checkpoint_world, "execution.torch_threads=2", "execution.checkpoint_seconds=5", "iterations=1"),
        capfd,
    )
    assert code == 0, stderr


HOLD_LOCK = """
import sys, time
from pathlib import Path
from storage.locks import exclusive_lock
with exclusive_lock(Path(sys.argv[1])):
    Path(sys.argv[2]).write_text("held")
    time.sleep(600)
"""


def test_issue14_a_second_run_of_a_campaign_is_refused_naming_the_first(finished, checkpoint_world, tmp_path, capfd):
    run_root = _copy_of(finished, tmp_path)
    before = _files(run_root)
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_root / "tiny" / ".lock"), str(ready)], cwd=ROOT)
    try:
        while not ready.exists():
            assert holder.poll() is None
            time.sleep(0.05)
        code, stderr = _main(_run(tmp_path, checkpoint_world), capfd)
    finally:
        holder.kill()
        holder.wait()
    _assert_refused(code, stderr, run_root, ("campaign `tiny`", f"process {holder.pid}"), before)


def test_issue14_a_lock_that_is_a_symbolic_link_is_refused_and_its_target_kept(checkpoint_world, tmp_path, capfd):
    target = _file(tmp_path, "precious.txt", "keep me")
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    (tmp_path / "runs" / "tiny" / ".lock").symlink_to(target)
    code, stderr = _main(_run(tmp_path, checkpoint_world), capfd)
    _assert_refused(code, stderr, tmp_path / "runs", (".lock", "symbolic link"), {})
    assert target.read_text() == "keep me"


def test_issue14_a_run_root_that_is_a_file_is_refused(checkpoint_world, tmp_path, capfd):
    _file(tmp_path, "runs", "not a folder")
    code, stderr = _main(_run(tmp_path, checkpoint_world), capfd)
    _assert_refused(code, stderr, tmp_path / "runs", ("`run_root`", "not a folder"), {})
    assert (tmp_path / "runs").read_text() == "not a folder"


# --- as a subprocess: Ctrl-C, a read-only run root, a full disk ----------------------------------


def _sigint_as_at_a_terminal() -> None:
    """In the child, before exec: SIGINT at its default, as a command typed at a terminal has it, even where this
    test session ignores it (pytest started as a background job, whose SIGINT the shell ignores; Python then keeps
    ignoring it and Ctrl-C would do nothing)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def rlhf_process():
    """Starts ``python -m flows ARGV`` in a process group of its own, against the session's Prefect server; at the
    end of the test every group it started is killed, so a failed test leaves no command holding the campaign."""
    from prefect.settings import PREFECT_API_URL

    started: list[subprocess.Popen] = []

    def start(argv: list[str], *, prefix: list[str] = (), **environment: str) -> subprocess.Popen:
        env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), **environment}
        command = [*prefix, sys.executable, "-m", "flows", *argv]
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
            preexec_fn=_sigint_as_at_a_terminal,
        )
        started.append(process)
        return process

    yield start
    for process in started:  # the group too where its leader has exited: children it started may live on
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()


def test_issue14_ctrl_c_mid_stage_exits_2_and_leaves_nothing_running(
    prefect_server, checkpoint_world, tmp_path, rlhf_process
):
    held = tmp_path / "held"
    process = rlhf_process(
        _run(tmp_path, checkpoint_world), RLHF_HOLD_AT="sample_candidates:computing", RLHF_HOLD_FILE=str(held)
    )
    deadline = time.monotonic() + 300
    while not held.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
        time.sleep(0.05)
    before = _files(tmp_path / "runs")
    os.killpg(process.pid, signal.SIGINT)  # as Ctrl-C at a terminal does: to the whole process group
    _, stderr = process.communicate(timeout=120)
    _assert_refused(
        process.returncode, stderr, tmp_path / "runs", ("interrupted", "run the same command"), before, progress=True
    )
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert {run.info.run_name: run.info.status for run in runs} == {"iteration-0": "KILLED", "initialize": "FINISHED"}


def _private_mount(script: str) -> list[str]:
    """A command prefix running ``script`` (then the command) in a mount namespace of its own."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{script} && exec "$@"', "sh"]


def _can_mount(tmp_path: Path) -> bool:
    probe = subprocess.run(
        [*_private_mount(f"mount -t tmpfs -o size=1m tmpfs {tmp_path}"), "true"], capture_output=True, check=False
    )
    return probe.returncode == 0


def test_issue14_a_read_only_run_root_is_refused(prefect_server, checkpoint_world, tmp_path, rlhf_process):
    run_root = tmp_path / "runs"
    run_root.mkdir()
    if os.geteuid() != 0:
        run_root.chmod(0o555)
        prefix = []
    elif _can_mount(tmp_path):
        prefix = _private_mount(f"mount --bind {run_root} {run_root} && mount -o remount,bind,ro {run_root}")
    else:
        pytest.skip("root without mount namespaces: a read-only folder cannot be made")
    process = rlhf_process(_run(tmp_path, checkpoint_world), prefix=prefix)
    _, stderr = process.communicate(timeout=300)
    _assert_refused(process.returncode, stderr, run_root, ("Read-only file system", str(run_root)), {})


def test_issue14_a_full_disk_is_reported_and_the_iteration_marked_failed(
    prefect_server, checkpoint_world, tmp_path, rlhf_process
):
    """The run root on a 1 MiB tmpfs (the MLflow store elsewhere, as on a tracking server): the first
    checkpoint that does not fit ends the command."""
    run_root, store = tmp_path / "runs", tmp_path / "store"
    run_root.mkdir()
    store.mkdir()
    if not _can_mount(tmp_path):
        pytest.skip("no mount namespaces here: a small disk cannot be made")
    argv = _run(tmp_path, checkpoint_world, f"tracking_uri=sqlite:///{store / 'mlflow.db'}")
    process = rlhf_process(argv, prefix=_private_mount(f"mount -t tmpfs -o size=1m tmpfs {run_root}"))
    _, stderr = process.communicate(timeout=300)
    _assert_refused(process.returncode, stderr, run_root, ("No space left on device", str(run_root)), {})
    client = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    statuses = {run.info.run_name: run.info.status for run in runs}
    assert statuses.pop("iteration-0") == "FAILED" and set(statuses.values()) == {"FINISHED"}


# --- what is not a user error, and --verbose ---------------------------------------------------------


def test_issue14_a_bug_keeps_its_traceback(monkeypatch):
    """A KeyError is a LookupError, as "no such run" is, but from a bug: it is raised, not reported as exit 2."""
    import flows.cli

    def broken(config, arguments):
        return {}["missing"]

    monkeypatch.setitem(flows.cli._COMMANDS, "config", broken)
    with pytest.raises(KeyError):
        main(["config"])


def test_issue14_verbose_adds_the_traceback_to_a_user_error(capfd):
    code, stderr = _main(["config", "--set", "ppo.clip_eps=-1", "--verbose"], capfd)
    assert code == 2 and "Traceback" in stderr and stderr.strip().splitlines()[-1].startswith("rlhf: `ppo.clip_eps`")


def _main_in_a_process(argv: list[str], heavy: tuple[str, ...]) -> subprocess.CompletedProcess:
    """``rlhf <argv>`` in a fresh process, which prints which of the ``heavy`` modules it had imported."""
    script = (
        "import sys\nfrom flows.cli import main\ncode = main(sys.argv[1:])\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\nsys.exit(code)"
    )
    return subprocess.run(
        [sys.executable, "-c", script, *argv],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_issue27_a_file_refusal_comes_before_torch_mlflow_or_prefect_is_imported(checkpoint_world, tmp_path):
    """What makes it answer in a second or two with a real model (flows.inputs.check_files): neither the heavy
    libraries nor a Prefect server are loaded for it."""
    prompts = _file(tmp_path, "p.jsonl", _jsonl([{"mesages": [{"role": "user", "content": "a"}]}]))
    argv = _run(tmp_path, checkpoint_world, f"data.prompts={prompts}")
    finished = _main_in_a_process(argv, ("torch", "transformers", "mlflow", "prefect"))
    assert finished.returncode == 2, finished.stderr[-3000:]
    assert "did you mean 'messages'" in finished.stderr
    assert finished.stdout.strip() == "[]", finished.stdout


RAISING_TEMPLATE = (  # as Gemma's and Mistral's templates refuse what they cannot render
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _too_long_prompt(tmp: Path, world: dict[str, Path]) -> list[str]:
    turn = {"role": "user", "content": " ".join(["the sun is warm"] * 40)}  # 160 words: the policy has 128 positions
    rows = [{"messages": [{"role": "user", "content": "a"}]}, {"messages": [turn]}]
    return [f"data.prompts={_file(tmp, 'p.jsonl', _jsonl(rows))}"]


def _a_row_the_template_refuses(tmp: Path, world: dict[str, Path]) -> list[str]:
    policy = tmp / "policy"
    shutil.copytree(world["policy"], policy)
    (policy / "chat_template.jinja").write_text(RAISING_TEMPLATE)
    system = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"}]}
    rows = [{"messages": [{"role": "user", "content": "a"}]}, system]
    return [f"model.policy={policy}", f"data.prompts={_file(tmp, 'p.jsonl', _jsonl(rows))}"]


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (_too_long_prompt, ("`data.prompts`", "row 2", "'messages'", "more than the model's context length 128")),
        (_a_row_the_template_refuses, ("`data.prompts`", "row 2", "chat template refuses it", "System role")),
    ],
    ids=["prompt-longer-than-the-context", "row-the-chat-template-refuses"],
)
def test_issue27_a_refusal_that_needs_the_tokenizer_comes_before_torch_mlflow_or_prefect_is_imported(
    overrides, names, chat_world, tmp_path
):
    """flows.inputs.check_tokens: the tokenizer-level checks (a chat policy with a generic fast tokenizer, whose
    config.json states its context) answer with the stages' own tokenisation before the heavy libraries load."""
    argv = _run(tmp_path, chat_world, *overrides(tmp_path, chat_world))
    finished = _main_in_a_process(argv, ("torch", "mlflow", "prefect"))
    _assert_refused(finished.returncode, finished.stderr, tmp_path / "runs", names, {})
    assert not (tmp_path / "runs").exists(), "a refused command creates no run root"
    assert finished.stdout.strip() == "[]", finished.stdout
