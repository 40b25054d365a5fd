"""Environments by name (runtime/environments.py): the contract's refusals, one line each, before any episode; episodes
played in a child process; failures as stop reasons, the runner serving on; a hung process killed and replaced, the
other live episodes replayed; the process ending with its parent's ``kill -9``.

The scripted environments are in ``tests/environments.py``. ``Guess``'s secret for seed s is
``random.Random(s).randint(1, 4)``: 4 for seed 0, 2 for seed 1, 1 for seed 2.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runtime.environments import DONE, TIMEOUT, EnvironmentReply, EnvironmentRunner
from runtime.references import EnvironmentClassError, EnvironmentReference, load_environment
from tests.environments import Guess
from tests.processes import running

ROOT = Path(__file__).resolve().parents[2]
STEP_TIMEOUT_S = 1.0
ROW = {"prompt": "Let's play."}


@pytest.fixture(scope="module")
def runner():
    with EnvironmentRunner(EnvironmentReference.of("tests.environments:Faulty"), step_timeout_s=STEP_TIMEOUT_S) as one:
        yield one


def _play(runner: EnvironmentRunner, episode_id: object, seed: int, actions: list[str]) -> list[EnvironmentReply]:
    replies = [runner.reset(episode_id, seed=seed, row=ROW)]
    for action in actions:
        replies.append(runner.step(episode_id, action))
    return replies


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module:Guess", "cannot import module 'no_such_module'"),
        ("tests.environments:Nothing", "has no attribute 'Nothing'"),
        ("tests.environments:NOT_A_CLASS", "is not a class"),
        ("tests.environments:NeedsArguments", "cannot be constructed with no arguments"),
        ("tests.environments:NoStep", "has no method `step(self, action: str)"),
        ("tests.environments:PositionalReset", ".reset cannot be called as `reset(self, *, seed: int, row: dict)"),
        ("tests.environments:StepWithoutAction", ".step cannot be called as `step(self, action: str)"),
        ("tests.environments:SaysMaybe", ".deterministic is 'maybe': it must be True or False"),
    ],
)
def test_a_class_not_of_the_contracts_shape_is_refused_in_one_line_naming_the_setting(name, message):
    with pytest.raises(EnvironmentClassError) as refused:
        EnvironmentReference.of(name)
    text = str(refused.value)
    assert text.startswith(f"`environment.class` {name!r}") or text.startswith("`environment.class` cannot import")
    assert message in text and "\n" not in text


def test_a_module_that_fails_as_it_imports_is_not_importable_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_env.py").write_text("class Guess:\n    pass\n\nraise RuntimeError('no\\nmore')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvironmentClassError, match="cannot import module 'broken_env' .*: RuntimeError: no \\("):
        load_environment("broken_env:Guess")


def test_a_reference_is_keyed_by_its_modules_code_and_declares_determinism():
    reference = EnvironmentReference.of("tests.environments:Guess")
    assert reference.load() is Guess and len(reference.code) == 64
    assert not load_environment("tests.environments:Coin").deterministic


def test_an_episode_is_played_to_done_with_its_rewards_summed(runner):
    # seed 0's secret is 4: "x" has no number (-0.5), 1 is low, 3 is low, 4 ends it (1.0).
    replies = _play(runner, "played", 0, ["x", "1", "3", "4"])
    assert replies[0] == EnvironmentReply("Let's play. I am thinking of a number from 1 to 4.", 0.0, False, None)
    assert [reply.observation for reply in replies[1:]] == [
        "Answer with a number from 1 to 4.",
        "Higher.",
        "Higher.",
        None,
    ]
    assert [reply.done for reply in replies] == [False, False, False, False, True]
    assert replies[-1].stop_reason == DONE and sum(reply.reward for reply in replies) == 0.5
    with pytest.raises(KeyError, match="'played' is not live"):
        runner.step("played", "4")


def test_the_same_seed_and_actions_give_the_same_episode_and_seeds_draw_other_secrets(runner):
    actions = ["1", "3"]  # seed 1's secret is 2: higher, then lower
    assert _play(runner, "a", 1, actions) == _play(runner, "b", 1, actions)
    runner.end("a")
    runner.end("b")
    secrets = set()
    for seed in range(8):
        game = Guess()
        game.reset(seed=seed, row=ROW)
        secrets.add(game.secret)
    assert secrets == {1, 2, 3, 4}


def test_an_environment_that_raises_or_breaks_the_contract_ends_its_episode_and_the_runner_serves_on(runner):
    pid, replacements = runner.pid, runner.replacements
    raised = _play(runner, "raises", 1, ["1", "raise"])[-1]
    assert raised == EnvironmentReply(None, 0.0, True, "error: ValueError: the environment broke")
    shape = _play(runner, "shape", 1, ["shape"])[-1]
    assert shape.done and shape.stop_reason.startswith("error: TypeError: step returned ('Higher.', 0.0): it must")
    number = runner.reset("number", seed=1, row={"reset": "number"})
    assert number == EnvironmentReply(None, 0.0, True, "error: TypeError: reset returned 3: it must return the first user message, a str")  # fmt: skip
    printed = _play(runner, "prints", 1, ["print", "2"])  # a user's print goes to stderr, not into the pipe
    assert printed[1].observation == "Answer with a number from 1 to 4." and printed[2].stop_reason == DONE
    assert (runner.pid, runner.replacements) == (pid, replacements)


def test_a_step_past_the_timeout_is_killed_and_replaced_and_the_other_live_episodes_are_replayed(runner):
    _play(runner, "live", 0, ["1"])  # left live, one step in
    hung = runner.pid
    start = time.monotonic()
    assert _play(runner, "hangs", 1, ["hang"])[-1] == EnvironmentReply(None, 0.0, True, TIMEOUT)
    assert time.monotonic() - start < STEP_TIMEOUT_S + 1.0
    assert not running(hung) and runner.pid != hung and runner.replacements >= 1
    assert runner.step("live", "4").stop_reason == DONE  # its environment was reset and given "1" again


def test_a_process_that_dies_ends_its_episode_and_a_replay_that_answers_otherwise_ends_that_one(runner):
    drifting = runner.reset("drifting", seed=0, row={**ROW, "drift": True})  # its replies name the process
    assert str(runner.pid) in drifting.observation
    died = _play(runner, "dies", 1, ["exit"])[-1]
    assert died.stop_reason == "error: ChildProcessError: the environment's process ended (exit status 3)"
    lost = runner.step("drifting", "4")
    assert lost.done and lost.stop_reason.startswith("error: ChildProcessError: the environment's process was replaced")
    assert "this episode's replay answered otherwise: the environment is not deterministic" in lost.stop_reason
    assert _play(runner, "after", 2, ["1"])[-1].stop_reason == DONE


def test_a_non_deterministic_environments_live_episodes_end_when_its_process_is_replaced():
    with EnvironmentRunner(EnvironmentReference.of("tests.environments:Coin"), step_timeout_s=STEP_TIMEOUT_S) as runner:
        assert not runner.deterministic
        runner.reset("live", seed=0, row=ROW)
        runner.reset("killed", seed=0, row=ROW)
        os.kill(runner.pid, signal.SIGKILL)
        assert runner.step("killed", "1").stop_reason.startswith("error: ChildProcessError: the environment's process ended")  # fmt: skip
        lost = runner.step("live", "4")
        assert lost.done and lost.stop_reason.endswith("the environment is not deterministic, so this episode is not replayed")  # fmt: skip


def test_a_runner_started_by_a_thread_that_ends_keeps_its_process():
    """Linux sends the parent-death signal when the thread that started the child ends (a task runner's worker)."""
    started = []
    thread = threading.Thread(
        target=lambda: started.append(
            EnvironmentRunner(EnvironmentReference.of("tests.environments:Guess"), step_timeout_s=5)
        )
    )
    thread.start()
    thread.join()
    with started[0] as runner:
        time.sleep(0.2)
        assert running(runner.pid) and _play(runner, "after", 2, ["1"])[-1].stop_reason == DONE


COMMAND = """
import sys, time
from runtime.environments import EnvironmentRunner
from runtime.references import EnvironmentReference
runner = EnvironmentRunner(EnvironmentReference.of("tests.environments:Guess"), step_timeout_s=5)
print(runner.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_environments_process_ends_with_its_parents_kill_minus_nine():
    parent = subprocess.Popen(
        [sys.executable, "-c", COMMAND], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    child = int(parent.stdout.readline())
    assert running(child)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.monotonic() + 1.0
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child), "the environments' process outlived its parent"
