"""Environments the tests name as ``environment.class`` (``tests.environments:...``): a scripted guessing game, one
that misbehaves on request, classes of the wrong shape, and TextArena's Tic Tac Toe with a scripted opponent (the contract:
:mod:`runtime.environments`)."""

from __future__ import annotations

import os
import random
import re
import sys
import time

from rlhf_envs.textarena import TextArena

NUMBER = re.compile(r"-?\d+")


class Guess:
    """Guess my number from 1 to ``row["high"]`` (default 4), drawn from the seed; "higher" or "lower" after a wrong
    guess. A right guess scores 1 and ends the episode; a wrong one scores 0, and a reply with no number -0.5."""

    def reset(self, *, seed: int, row: dict) -> str:
        self.high = int(row.get("high", 4))
        self.secret = random.Random(seed).randint(1, self.high)
        return f"{row['prompt']} I am thinking of a number from 1 to {self.high}."

    def step(self, action: str) -> tuple[str | None, float, bool]:
        found = NUMBER.search(action)
        if found is None:
            return f"Answer with a number from 1 to {self.high}.", -0.5, False
        guess = int(found.group())
        if guess == self.secret:
            return None, 1.0, True
        return ("Higher." if guess < self.secret else "Lower."), 0.0, False


class Faulty(Guess):
    """:class:`Guess`, misbehaving on request: the action ``raise``, ``hang``, ``exit``, ``print`` or ``shape``; the row
    ``{"reset": "number"}`` (reset returns a number), ``{"drift": True}`` (replies that change from one process to
    the next, though the class says it is deterministic) or ``{"raise_at": N}`` (step N, from 1, raises whatever the
    action)."""

    def reset(self, *, seed: int, row: dict) -> str:
        if row.get("reset") == "number":
            return 3  # type: ignore[return-value]
        self.drift = f" ({os.getpid()})" if row.get("drift") else ""
        self.raise_at, self.steps = row.get("raise_at"), 0
        return super().reset(seed=seed, row=row) + self.drift

    def step(self, action: str) -> tuple[str | None, float, bool]:
        self.steps += 1
        if action == "raise" or self.steps == self.raise_at:
            raise ValueError("the environment broke\nwith a second line")
        if action == "hang":
            time.sleep(600)
        if action == "exit":
            os._exit(3)
        if action == "print":
            print("a user's print, on stdout", flush=True)
            sys.stdout.write("x" * 70_000 + "\n")  # more than a pipe holds
            sys.stdout.flush()
        if action == "shape":
            return "Higher.", 0.0  # type: ignore[return-value]
        observation, reward, done = super().step(action)
        return (observation + self.drift if observation else observation), reward, done


class Coin(Guess):
    """:class:`Guess` declared non-deterministic: its episodes are not replayed in a new process."""

    deterministic = False


NOT_A_CLASS = 3


class NeedsArguments(Guess):
    def __init__(self, level: int) -> None:
        self.level = level


class NoStep:
    def reset(self, *, seed: int, row: dict) -> str:
        return ""


class PositionalReset(Guess):
    def reset(self, seed: int) -> str:  # type: ignore[override]
        return ""


class StepWithoutAction(Guess):
    def step(self) -> tuple[str | None, float, bool]:  # type: ignore[override]
        return None, 0.0, True


class SaysMaybe(Guess):
    deterministic = "maybe"


class TicTacToe(TextArena):
    """TextArena's Tic Tac Toe (two players, the model player 0 unless the row says otherwise) against an opponent
    that takes the first free cell of the last board it was sent."""

    env_id = "TicTacToe-v0"
    num_players = 2

    def opponent(self, player: int, observation: str) -> str:
        *_, moves = observation.rpartition("Available Moves:")
        return re.findall(r"\[\d\]", moves)[0]
