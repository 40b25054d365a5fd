"""Reward functions reached by name (``reward.function: module:callable``): programmatic, "verifiable" rewards.

The contract a reward function is written against (as TRL's reward functions are)::

    def my_reward(prompt, response, **columns) -> float

* ``prompt`` is the prompt as the user wrote it: its text, or for a chat prompt its list of
  ``{"role", "content"}`` messages (TRL passes conversational prompts the same way);
* ``response`` is the generated text (special tokens dropped);
* every other column of the prompt's row in the prompts file arrives as a keyword argument of its
  name (a reference answer, a test case: what a verifiable reward checks against);
* a function that declares a ``prompt_text`` parameter also receives the prompt as the model saw it
  (a chat prompt through the tokenizer's chat template, :func:`tasks.text.prompt_text`).

It returns a finite number. E.g. the demo's hidden rubric ``demo.gold:gold_score``, an answer
checker or a unit-test runner. With ``reward.source: function`` it scores the rollouts in place of a
learned reward model.

Choices:
1. As a stage setting it is keyed by its name and the fingerprint of its module's code (:class:`runtime.references.RewardFunctionReference`), so editing the function re-runs what it scored.
2. It is imported, its signature bound to the prompt files' columns and it is called once (the first
   training prompt, an empty response) before anything runs (:func:`check_reward_function`): a module
   that does not import, a missing callable, a signature that does not take the columns, or a
   function that raises is one line naming ``reward.function``, not a failure after a generation pass.
3. A function that raises, or returns anything but a finite number, while scoring fails the stage with
   the prompt's id in the message: a silent 0 or NaN would train the policy on a broken reward.
4. Modules are looked up on the Python path, which the command extends with the config file's folder
   (:mod:`flows.cli`), so a module beside the config is found.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from runtime.references import REWARD_FUNCTION_SETTING as SETTING
from runtime.references import RewardFunction, RewardFunctionError, RewardFunctionReference

if TYPE_CHECKING:
    import torch

    from tasks.text import Prompt

PROMPT_TEXT = "prompt_text"
"""The parameter through which a reward function asks for the prompt as the model saw it."""


def wants_prompt_text(function: RewardFunction) -> bool:
    """Whether ``function`` declares the :data:`PROMPT_TEXT` parameter."""
    try:
        return PROMPT_TEXT in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature: it gets the contract's arguments only
        return False


def reward_arguments(function: RewardFunction, prompt: Prompt, prompt_text: str) -> dict[str, Any]:
    """The keyword arguments ``function`` is called with for ``prompt`` besides ``prompt`` and ``response``: the
    row's other columns, and the rendered prompt where it asks for it (module docstring)."""
    arguments = dict(prompt.columns)
    if wants_prompt_text(function):
        arguments[PROMPT_TEXT] = prompt_text
    return arguments


def user_prompt(prompt: Prompt) -> str | list[dict[str, str]]:
    """The prompt as the user wrote it: its text, or its chat messages (a list, as TRL passes them)."""
    return [dict(message) for message in prompt.messages] if prompt.messages else prompt.text


def check_reward_function(reference: RewardFunctionReference, samples: Sequence[tuple[str, Prompt, str]]) -> None:
    """Bind ``reference``'s signature to each sample prompt's arguments, and call it once, on the first with an empty
    response (module docstring, choice 2).

    Args:
        samples: ``(setting of the file it comes from, prompt, the prompt as the model sees it)``; the first is called.

    Raises:
        RewardFunctionError: it does not load, its signature does not take a sample's arguments, it raises on the
            first, or returns something other than a finite number.
    """
    function = reference.load()
    for setting, prompt, text in samples:
        arguments = reward_arguments(function, prompt, text)
        try:
            inspect.signature(function).bind(user_prompt(prompt), "", **arguments)
        except TypeError as error:
            columns = ", ".join(sorted(arguments)) or "none"
            raise RewardFunctionError(
                f"{SETTING} {reference.name} cannot be called as (prompt, response, **columns) with the columns of "
                f"`{setting}` ({columns}): {error}"
            ) from error
        except ValueError:  # no signature to bind (a builtin): the call below says whether it takes them
            pass
    setting, prompt, text = samples[0]
    score_texts(function, reference.name, [prompt], [""], [f"row 1 of `{setting}`"], prompt_texts=[text])


def score_texts(
    function: RewardFunction,
    name: str,
    prompts: Sequence[Prompt],
    responses: Sequence[str],
    prompt_ids: Sequence[int | str],
    *,
    prompt_texts: Sequence[str],
) -> torch.Tensor:
    """``function(prompt, response, **columns)`` for each row, as float32 scores (module docstring).

    Args:
        function: the reward function.
        name: its ``module:attribute`` name, for error messages.
        prompts, responses, prompt_ids, prompt_texts: one per row; ``prompt_ids`` name the rows in errors;
            ``prompt_texts`` are the prompts as the model saw them.

    Shapes:
        returns (B,).

    Raises:
        RewardFunctionError: the function raised, or returned a non-number or a non-finite value;
            the message names the prompt's id.
    """
    import torch  # here, not at the top: naming a reward function (a run key, a reuse check) needs no torch

    scores = []
    for prompt, response, prompt_id, text in zip(prompts, responses, prompt_ids, prompt_texts, strict=True):
        shown = user_prompt(prompt)
        try:
            value = function(shown, response, **reward_arguments(function, prompt, text))
        except Exception as error:
            raise RewardFunctionError(
                f"{SETTING} {name} raised on prompt {prompt_id} ({shown!r}, response {response!r}): {error!r}"
            ) from error
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise RewardFunctionError(
                f"{SETTING} {name} returned {value!r} for prompt {prompt_id} ({shown!r}, response "
                f"{response!r}): it must return a finite number"
            )
        scores.append(float(value))
    return torch.tensor(scores, dtype=torch.float32)
