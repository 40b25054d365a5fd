"""TextArena's games as environments: ``environment.class: rlhf_envs.textarena:TextArena`` (docs/environments.md,
"Environments of an ecosystem: TextArena").

Which game each episode plays is a column of the prompt's row, as every environment's parameters are: ``env_id`` (a
TextArena id, ``GuessTheNumber-v0``), ``num_players`` (default 1) and ``player`` (which of them the model is, default
0). A subclass may set the same three as class attributes, the defaults of rows without them.

How TextArena's interface maps onto the contract (``textarena`` 0.7.4):

1. ``reset(seed=, row=)``: ``textarena.make(env_id)``, then the game's ``reset(num_players, seed)``; the other
   players move until it is the model's turn (choice 4); the messages the model's player has been sent so far are
   the episode's first user message.
2. ``step(action)``: the game's ``step(action)`` as the model's player (through the id's action wrappers: the plain
   ids wrap a reply with no ``[...]`` in brackets, ``-raw`` ids take it as it is); the other players move; while the
   game goes on, the reply is what the model's player was sent since its last move, with reward 0.0. When the game
   is over (``done``), the turn's reward is the model's player's reward from the game's ``close()`` (TextArena rewards
   a game at its end only: 1 a win, -1 a loss, 0 a draw; a fraction for the partial games of single-player ones), and
   the message is None: there is no turn after it.
3. Messages: TextArena gives each player a list of messages ``(sender, text, type)`` and its observation wrappers
   re-render the whole history as one string at every turn, for agents that keep none. An episode is a
   conversation that keeps its history, so the adapter renders only the new messages, each as TextArena's
   ``LLMObservationWrapper`` renders one (``[GAME] ...``, ``[Player 1] ...``), leaving out the model's own moves
   (already its turns): the delta, as the rollout appends only the template's delta (token in, token out).
4. Other players: a multi-player game needs their moves; the model plays one player and :meth:`TextArena.opponent`
   plays the others, in the same process, given what that player was sent since its last move (rendered as in 3).
   This class has no opponent of its own (TextArena's agents are LLM API clients): a subclass that plays a game of
   more than one player defines :meth:`TextArena.opponent`; without one, the episode ends at its reset with the
   stop reason ``error: NotImplementedError: ...`` naming the game.
5. Randomness: TextArena seeds and draws from Python's global ``random`` module; the environments' process holds
   many live episodes at once, whose calls interleave. Each game keeps its own state of ``random`` (seeded from
   the episode's seed), swapped in for its calls and out after them: an episode depends on its seed and its actions
   alone, so the class is ``deterministic`` (resumed and replayed, :mod:`runtime.environments` choice 3).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any, ClassVar


class TextArena:
    """One episode of a TextArena game, the model one of its players (module docstring)."""

    deterministic: ClassVar[bool] = True
    env_id: ClassVar[str | None] = None
    """The game of a row with no ``env_id`` column."""
    num_players: ClassVar[int] = 1
    """The number of players of a row with no ``num_players`` column."""
    player: ClassVar[int] = 0
    """The model's player of a row with no ``player`` column."""

    def opponent(self, player: int, observation: str) -> str:
        """The move of ``player`` (not the model's), given what it was sent since its last move (choice 4)."""
        raise NotImplementedError(
            f"{self.game_id} is played by {self.players} players and {type(self).__name__} has no opponent: define "
            "`opponent(self, player, observation) -> str` in a subclass (docs/environments.md)"
        )

    def reset(self, *, seed: int, row: dict) -> str:
        import textarena

        self.game_id = row.get("env_id") or self.env_id
        if not self.game_id:
            raise ValueError(
                "no TextArena game to play: the prompt's row has no `env_id` column (e.g. GuessTheNumber-v0)"
            )
        self.players = int(row.get("num_players", self.num_players))
        self.me = int(row.get("player", self.player))
        if self.players > 1 and type(self).opponent is TextArena.opponent:
            self.opponent((self.me + 1) % self.players, "")  # raises: no opponent (choice 4), before the game starts
        self._random = random.Random(seed).getstate()
        with self._own_random():
            self.game = textarena.make(self.game_id)
            self.game.reset(num_players=self.players, seed=seed)
            done = self._others_move()
        if done:
            raise RuntimeError(f"{self.game_id} ended before the model's first move")
        return self._observation()

    def step(self, action: str) -> tuple[str | None, float, bool]:
        with self._own_random():
            done, _ = self.game.step(action)
            done = done or self._others_move()
            if done:
                rewards, _ = self.game.close()
                return None, float((rewards or {}).get(self.me, 0.0)), True
            return self._observation(), 0.0, False

    def _others_move(self) -> bool:
        """Let the other players move until it is the model's turn (choice 4); whether the game ended meanwhile."""
        while (mover := _unwrapped(self.game).state.current_player_id) != self.me:
            _, messages = _unwrapped(self.game).get_observation()
            done, _ = self.game.step(self.opponent(mover, self._render(messages, mover)))
            if done:
                return True
        return False

    def _observation(self) -> str:
        """What the model's player was sent since its last move (choice 3)."""
        _, messages = _unwrapped(self.game).get_observation()
        return self._render(messages, self.me)

    def _render(self, messages: list[tuple[int, str, Any]], player: int) -> str:
        """``messages`` as TextArena's ``LLMObservationWrapper`` renders each, less ``player``'s own moves."""
        from textarena import GAME_ID, ObservationType

        roles = _unwrapped(self.game).state.role_mapping
        lines = [
            f"[{'GAME' if sender == GAME_ID else roles.get(sender, f'Player {sender}')}] {text}"
            for sender, text, kind in messages
            if not (sender == player and kind == ObservationType.PLAYER_ACTION)
        ]
        return "\n".join(lines).strip()

    @contextlib.contextmanager
    def _own_random(self) -> Iterator[None]:
        """Python's ``random`` in this game's own state for the calls inside (choice 5)."""
        outside = random.getstate()
        random.setstate(self._random)
        try:
            yield
        finally:
            self._random = random.getstate()
            random.setstate(outside)


def _unwrapped(game: Any) -> Any:
    """The game under its wrappers (whose observation wrappers re-render the whole history, choice 3)."""
    from textarena import Wrapper

    while isinstance(game, Wrapper):
        game = game.env
    return game
