"""User code reached by name, ``module:attribute``: a gold judge (``demo.gold:JUDGE``) or a reward function
(``reward.function``), so no stage imports one.

A reference is identified by its name and the fingerprint of its module's code (:func:`runtime.code.code_fingerprint`):
as a stage setting it is keyed by both, so editing the rubric re-runs what it judged or scored. Each kind checks at
:meth:`CodeReference.of` that the object it names can be used as such, so a bad name is refused before any stage runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from rlhf_core.errors import UserError
from runtime.code import code_fingerprint

if TYPE_CHECKING:
    from rlhf_core.evaluation import Judge

RewardFunction = Callable[..., float]
REWARD_FUNCTION_SETTING = "`reward.function`"


class RewardFunctionError(UserError, ValueError):
    """A reward function that cannot be used: it does not load, does not take the prompt's columns, raises, or
    returns something other than a finite number. The message (one line) names it."""


def load_object(reference: str) -> object:
    """The attribute ``module:attribute`` names (``a.b:c.d`` is ``getattr(getattr(import a.b, c), d)``).

    Raises:
        ValueError: ``reference`` is not ``module:attribute``, or names nothing importable.
    """
    module_name, separator, attribute = reference.partition(":")
    if not separator or not module_name or not attribute:
        raise ValueError(f"{reference!r} must look like `module:attribute`, e.g. `demo.gold:JUDGE`")
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import module {module_name!r} of {reference!r}: {error}") from error
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{reference!r}: {module_name} has no attribute {attribute!r}")
        target = getattr(target, part)
    return target


def load_judge(reference: str) -> Judge:
    """The :class:`rlhf_core.evaluation.Judge` that ``reference`` names: ``score(prompt, response)`` and
    ``prefers(prompt, first, second)``.

    Raises:
        ValueError: it cannot be loaded, or has no ``score`` and ``prefers`` methods.
    """
    judge = load_object(reference)
    if not all(callable(getattr(judge, method, None)) for method in ("score", "prefers")):
        raise ValueError(
            f"{reference!r} is not a judge: it needs `score(prompt, response)` and `prefers(prompt, a, b)`"
        )
    return judge  # type: ignore[return-value]


def load_reward_function(reference: str) -> RewardFunction:
    """The callable that ``reference`` names (the contract: :mod:`tasks.reward_function`).

    Raises:
        RewardFunctionError: it cannot be loaded, or is not callable.
    """
    try:
        function = load_object(reference)
    except ValueError as error:
        raise RewardFunctionError(
            f"{REWARD_FUNCTION_SETTING} {error} (modules are looked up in the config file's folder, the working "
            "directory and on PYTHONPATH)"
        ) from error
    if not callable(function):
        raise RewardFunctionError(
            f"{REWARD_FUNCTION_SETTING} {reference!r} is not a reward function: it must be callable as `(prompt, "
            "response, **columns) -> float`"
        )
    return function  # type: ignore[return-value]


@dataclass(frozen=True)
class CodeReference:
    """User code by name (``module:attribute``) and the fingerprint of its module's code."""

    name: str
    code: str
    loader: ClassVar[Callable[[str], Any]]

    @classmethod
    def of(cls, name: str):
        """The reference to ``name``, checked to load as this kind of code.

        Raises:
            ValueError: it cannot be loaded or used (:class:`RewardFunctionError` for a reward function).
        """
        cls.loader(name)
        return cls(name=name, code=code_fingerprint(name.partition(":")[0]))

    def load(self) -> Any:
        return type(self).loader(self.name)


@dataclass(frozen=True)
class JudgeReference(CodeReference):
    """A gold judge by name (:func:`load_judge`)."""

    loader: ClassVar[Callable[[str], Any]] = staticmethod(load_judge)


@dataclass(frozen=True)
class RewardFunctionReference(CodeReference):
    """A reward function by name (:func:`load_reward_function`)."""

    loader: ClassVar[Callable[[str], Any]] = staticmethod(load_reward_function)
