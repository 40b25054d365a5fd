"""Environments: the other side of an episode, a user's class named in the config, played out of the stage's process.

The contract an environment is written against (as OpenEnv's, SkyRL's and OpenRLHF's are)::

    class Guess:
        deterministic = True  # optional (default True); False: a seed and actions may give other replies

        def reset(self, *, seed: int, row: dict) -> str:
            ...  # the episode's first user message

        def step(self, action: str) -> tuple[str | None, float, bool]:
            ...  # the next user message (None when it has none), this turn's reward, whether the episode is over

* It is named ``module:Class`` (``environment.class: my_envs:Guess``) as a reward function is named, and keyed by its
  module's code (:class:`runtime.references.EnvironmentReference`). Its shape is checked when it is named, before any
  episode (:func:`runtime.references.load_environment`): a module that does not import, a missing class, a class that
  cannot be constructed with no arguments, or ``reset``/``step`` signatures that do not take the arguments below are
  each one line naming ``environment.class``.
* One instance per episode, constructed with no arguments; ``reset(seed=..., row=...)`` once, then ``step(action)``
  with each of the model's replies until it returns done, or until the caller stops at its ``max_turns``.
* ``seed`` derives from the campaign's seed, the iteration, the prompt's id and the sample's number
  (:func:`runtime.seeds.episode_seed`); ``row`` is the prompt's row, every column. An environment draws whatever it
  draws at random from ``seed``, so an episode is reproducible.
* ``deterministic``: the same seed and the same actions give the same replies. What rests on it: the episodes whose
  environments were lost with a replaced process are replayed in the new one (choice 3), and only a deterministic
  environment's episode can be resumed after a crash.

How it runs (:class:`EnvironmentRunner`):
1. Out of the stage's process: code a user's tool runs does not run there. One child process per runner
   (``python -m runtime.environments``) holds the environments of every live episode and answers reset and step
   requests one at a time over a pipe (pickled tuples). The user's ``print`` goes to the stage's stderr, never into
   the pipe. Only importing the class (the shape check) happens in the stage's process.
2. Failures are replies, not exceptions. Every call has ``step_timeout_s``. An environment that raises (constructed,
   reset or stepped), or returns other than the contract says, ends its episode with the stop reason
   ``error: <ExceptionType>: <the message's first line>`` (the traceback goes to stderr); one that exceeds the
   timeout ends it with ``timeout``, and its process is killed (its process group: a tool's own children too) and
   replaced; one whose process dies (``os._exit``, a crash) ends it with ``error: ChildProcessError: ...``. A failed
   call's reward is 0.0; the stage goes on.
3. A replaced process takes the other live episodes' environments with it. A deterministic environment's episodes
   are replayed in the new process (reset, then the actions so far), each reply checked against the recorded one; an
   episode whose replay differs or fails ends with an ``error: ChildProcessError`` stop reason, told at its next
   step. A non-deterministic environment's live episodes end that way at once.
4. The process ends with the stage's, ``kill -9`` included: it is started through
   :func:`runtime.children.launch_tied_in_thread` and sent SIGKILL when the stage's process ends (a tool's own
   children are then not followed: they end when their process group is killed, at a replacement or at
   :meth:`EnvironmentRunner.close`).
5. ``max_turns`` is the caller's: it stops stepping and calls :meth:`EnvironmentRunner.end`.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import reprlib
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

from runtime.children import launch_tied_in_thread
from runtime.references import EnvironmentClassError, EnvironmentReference, load_environment

ROOT = Path(__file__).resolve().parents[1]
DONE = "done"
"""The stop reason of an episode its environment ended."""
TIMEOUT = "timeout"
"""The stop reason of an episode whose environment exceeded ``step_timeout_s``."""
ERROR = "error"
"""The prefix of an episode's stop reason when its environment failed: ``error: <ExceptionType>: <message>``."""
STOP_SECONDS = 5.0
"""How long a killed process is waited for."""

EpisodeId = Hashable


class EnvironmentReply(NamedTuple):
    """The environment's answer to a reset or a step."""

    observation: str | None
    """Its next user message (the first, after a reset); None when it has none, or when the call failed."""
    reward: float
    """This turn's reward: 0.0 after a reset and for a failed call."""
    done: bool
    """Whether the episode is over: the environment ended it, or it failed."""
    stop_reason: str | None
    """None while the episode goes on; :data:`DONE`, :data:`TIMEOUT` or ``error: <ExceptionType>: <message>``."""


def error_reason(kind: str, message: str) -> str:
    """The stop reason of a failure: ``error: <kind>: <message's first line>``."""
    return f"{ERROR}: {kind}: {next(iter(message.splitlines()), '')}"


def _failed(reason: str) -> EnvironmentReply:
    return EnvironmentReply(None, 0.0, True, reason)


@dataclass
class _Episode:
    """What a live episode was given and answered, to replay it in a new process (choice 3)."""

    seed: int
    row: dict[str, Any]
    actions: list[str] = field(default_factory=list)
    replies: list[EnvironmentReply] = field(default_factory=list)
    """The reply to its reset, then to each of ``actions``."""


class EnvironmentRunner:
    """Plays the environment's side of episodes in a child process (module docstring). Calls are serialised.

    Example::

        with EnvironmentRunner(EnvironmentReference.of("my_envs:Guess"), step_timeout_s=10) as runner:
            reply = runner.reset(0, seed=episode_seed(seed, iteration, prompt_id, 0), row=row)
            while not reply.done:
                reply = runner.step(0, generate(reply.observation))

    Args:
        reference: the environment class.
        step_timeout_s: how long one reset or step may take, in seconds.
        start_timeout_s: how long a new process may take to import the class and be ready.

    Raises:
        EnvironmentClassError: the class does not load in the child process, or not within ``start_timeout_s``.
    """

    def __init__(
        self, reference: EnvironmentReference, *, step_timeout_s: float, start_timeout_s: float = 60.0
    ) -> None:
        if not step_timeout_s > 0:
            raise ValueError(f"`step_timeout_s` must be > 0, got {step_timeout_s}")
        self.reference = reference
        self.step_timeout_s = step_timeout_s
        self.start_timeout_s = start_timeout_s
        self.deterministic = True
        """Whether the class declares itself deterministic (its ``deterministic`` attribute, default True)."""
        self.replacements = 0
        """How many times the process was replaced (a timeout or a death)."""
        self._episodes: dict[EpisodeId, _Episode] = {}
        self._ended: dict[EpisodeId, EnvironmentReply] = {}
        """Episodes a replacement ended (choice 3): their reply, given at their next step."""
        self._lock = threading.RLock()  # reset ends the episode it restarts
        self._process: subprocess.Popen | None = None
        self._requests: Connection | None = None
        self._replies: Connection | None = None
        self._start()

    def __enter__(self) -> EnvironmentRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        """The process id of the environments' process; None once closed."""
        return self._process.pid if self._process is not None else None

    def reset(self, episode_id: EpisodeId, *, seed: int, row: Mapping[str, Any]) -> EnvironmentReply:
        """Construct episode ``episode_id``'s environment and reset it (an episode of that id still live is ended
        first); its reply holds the first user message, or says how it failed.

        Args:
            episode_id: any picklable, hashable name, unique among live episodes.
            seed: the episode's seed (:func:`runtime.seeds.episode_seed`).
            row: the prompt's row, every column (picklable).
        """
        with self._lock:
            self.end(episode_id)
            row = dict(row)
            reply = self._play(episode_id, ("reset", episode_id, seed, row))
            if not reply.done:
                self._episodes[episode_id] = _Episode(seed, row, replies=[reply])
            return reply

    def step(self, episode_id: EpisodeId, action: str) -> EnvironmentReply:
        """Give live episode ``episode_id``'s environment the model's reply ``action``; its reply.

        Raises:
            KeyError: no episode of that id is live (never reset, or it ended).
        """
        with self._lock:
            if episode_id in self._ended:
                return self._ended.pop(episode_id)
            episode = self._episodes.get(episode_id)
            if episode is None:
                raise KeyError(f"episode {episode_id!r} is not live: it was never reset, or it ended")
            reply = self._play(episode_id, ("step", episode_id, action))
            if reply.done:
                self._episodes.pop(episode_id, None)
            else:
                episode.actions.append(action)
                episode.replies.append(reply)
            return reply

    def end(self, episode_id: EpisodeId) -> None:
        """Drop episode ``episode_id``'s environment, live or not (the caller's ``max_turns`` was reached)."""
        with self._lock:
            self._ended.pop(episode_id, None)
            if self._episodes.pop(episode_id, None) is not None and self._requests is not None:
                with contextlib.suppress(OSError):  # a dead process holds no environment
                    self._requests.send(("end", episode_id))

    def close(self) -> None:
        """Kill the process (every live episode's environment goes with it)."""
        with self._lock:
            self._kill()
            self._episodes.clear()
            self._ended.clear()

    # How it runs (module docstring, choices 1 to 3).

    def _start(self) -> None:
        paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        process = launch_tied_in_thread(
            sys.executable,
            [sys.executable, "-m", "runtime.environments"],
            name="rlhf-environment",
            death_signal=signal.SIGKILL,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
        )
        assert process.stdin is not None and process.stdout is not None
        self._process = process
        self._requests = Connection(os.dup(process.stdin.fileno()), readable=False)
        self._replies = Connection(os.dup(process.stdout.fileno()), writable=False)
        process.stdin.close()
        process.stdout.close()
        named = f"`environment.class` {self.reference.name!r}"
        try:
            self._requests.send((self.reference.name, list(sys.path)))
            if not self._replies.poll(self.start_timeout_s):
                self._kill()
                raise EnvironmentClassError(f"{named} did not load within {self.start_timeout_s:g} s in its process")
            ready = self._replies.recv()
        except (EOFError, OSError):
            status = self._kill()
            raise EnvironmentClassError(
                f"{named}: its process ended while loading it (exit status {status}; its output is above)"
            ) from None
        if ready[0] != "ready":
            self._kill()
            raise EnvironmentClassError(ready[1])
        self.deterministic = ready[1]

    def _kill(self) -> int | None:
        """Kill the process and its group (a tool's own children); its exit status (None: there was none)."""
        process, self._process = self._process, None
        for connection in (self._requests, self._replies):
            if connection is not None:
                connection.close()
        self._requests = self._replies = None
        if process is None:
            return None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_SECONDS)
        return process.returncode

    def _call(self, request: tuple) -> tuple:
        """The process's answer to ``request``: ``("ok", observation, reward, done)`` or ``("error", type, message)``
        from it, or ``("timeout",)`` or ``("died",)``."""
        assert self._requests is not None and self._replies is not None
        try:
            self._requests.send(request)
            if not self._replies.poll(self.step_timeout_s):
                return (TIMEOUT,)
            return self._replies.recv()
        except (EOFError, OSError):
            return ("died",)

    def _lost(self, outcome: tuple) -> EnvironmentReply | None:
        """The reply to a call whose process timed out or died, the process killed; None for an answered call."""
        if outcome[0] == TIMEOUT:
            self._kill()
            return _failed(TIMEOUT)
        if outcome[0] == "died":
            status = self._kill()
            return _failed(error_reason("ChildProcessError", f"the environment's process ended (exit status {status})"))
        return None

    def _play(self, episode_id: EpisodeId, request: tuple) -> EnvironmentReply:
        outcome = self._call(request)
        lost = self._lost(outcome)
        if lost is None:
            return _answered(outcome)
        self._episodes.pop(episode_id, None)
        self._replace()
        return lost

    def _replace(self) -> None:
        """A new process, with every live episode's environment brought back (choice 3)."""
        self.replacements += 1
        self._start()
        while not self._replay_all():
            self.replacements += 1
            self._start()

    def _replay_all(self) -> bool:
        """Replay every live episode in the new process; False when a replay lost it (that episode is ended)."""
        for episode_id, episode in list(self._episodes.items()):
            if not self.deterministic:
                self._end_lost(episode_id, "the environment is not deterministic, so this episode is not replayed")
                continue
            requests = [("reset", episode_id, episode.seed, episode.row)]
            requests += [("step", episode_id, action) for action in episode.actions]
            for request, recorded in zip(requests, episode.replies, strict=True):
                outcome = self._call(request)
                lost = self._lost(outcome)
                if lost is not None:
                    self._episodes.pop(episode_id)
                    self._ended[episode_id] = lost
                    return False
                if _answered(outcome) != recorded:
                    self._end_lost(
                        episode_id, "this episode's replay answered otherwise: the environment is not deterministic"
                    )
                    assert self._requests is not None
                    with contextlib.suppress(OSError):  # a process that died meanwhile is found at the next call
                        self._requests.send(("end", episode_id))
                    break
        return True

    def _end_lost(self, episode_id: EpisodeId, why: str) -> None:
        self._episodes.pop(episode_id)
        self._ended[episode_id] = _failed(
            error_reason(
                "ChildProcessError", f"the environment's process was replaced (another episode's call failed); {why}"
            )
        )


def _answered(outcome: tuple) -> EnvironmentReply:
    """The reply to an answered call."""
    if outcome[0] == "ok":
        _, observation, reward, done = outcome
        return EnvironmentReply(observation, reward, done, DONE if done else None)
    _, kind, message = outcome
    return _failed(error_reason(kind, message))


# The environments' process (``python -m runtime.environments``).


def _checked_reset(observation: object) -> tuple:
    if not isinstance(observation, str):
        raise TypeError(f"reset returned {reprlib.repr(observation)}: it must return the first user message, a str")
    return ("ok", observation, 0.0, False)


def _checked_step(result: object) -> tuple:
    shape = "it must return (observation: str | None, reward: float, done: bool)"
    if not isinstance(result, tuple | list) or len(result) != 3:
        raise TypeError(f"step returned {reprlib.repr(result)}: {shape}")
    observation, reward, done = result
    if observation is not None and not isinstance(observation, str):
        raise TypeError(f"step returned the observation {reprlib.repr(observation)}: {shape}")
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise TypeError(f"step returned the reward {reprlib.repr(reward)}: {shape}, the reward finite")
    if not isinstance(done, bool):
        raise TypeError(f"step returned done={reprlib.repr(done)}: {shape}")
    return ("ok", observation, float(reward), done)


def serve() -> None:
    """Answer the runner's requests until it closes the pipe (module docstring, choice 1): first the class's name and
    the runner's ``sys.path`` (answered ``("ready", deterministic)`` or ``("failed", message)``), then
    ``("reset", episode, seed, row)``, ``("step", episode, action)`` (both answered) and ``("end", episode)``."""
    requests = Connection(os.dup(0), writable=False)
    replies = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # the user's prints go to stderr, never into the replies
    nothing = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nothing, 0)
    os.close(nothing)
    name, path = requests.recv()
    sys.path[:] = [*path, *(entry for entry in sys.path if entry not in path)]  # modules found as the runner finds them
    try:
        environment = load_environment(name)
    except EnvironmentClassError as error:
        replies.send(("failed", str(error)))
        return
    replies.send(("ready", getattr(environment, "deterministic", True)))
    live: dict[EpisodeId, Any] = {}
    while True:
        try:
            kind, episode_id, *arguments = requests.recv()
        except EOFError:
            return
        if kind == "end":
            live.pop(episode_id, None)
            continue
        try:
            if kind == "reset":
                live.pop(episode_id, None)
                live[episode_id] = environment()
                seed, row = arguments
                reply = _checked_reset(live[episode_id].reset(seed=seed, row=row))
            else:
                (action,) = arguments
                reply = _checked_step(live[episode_id].step(action))
        except (Exception, SystemExit) as error:  # the user's code failed: a stop reason, not the end of this process
            sys.stderr.write(f"{name}: episode {episode_id!r} failed in {kind}:\n")
            traceback.print_exc()
            live.pop(episode_id, None)
            replies.send(("error", type(error).__name__, str(error)))
            continue
        if reply[3]:
            live.pop(episode_id)
        replies.send(reply)


if __name__ == "__main__":
    serve()
