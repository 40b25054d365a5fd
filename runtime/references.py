"""User code reached by name, ``module:attribute``: a gold judge (``demo.gold:JUDGE``), a reward function
(``reward.function``) or an environment class (``environment.class``, :mod:`runtime.environments`), so no stage
imports one.

A reference is identified by its name and the fingerprint of its module's code (:func:`runtime.code.code_fingerprint`):
as a stage setting it is keyed by both, so editing the rubric re-runs what it judged or scored. Each kind checks at
:meth:`CodeReference.of` that the object it names can be used as such, so a bad name is refused before any stage runs.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from rlhf_core.errors import UserError
from runtime.code import code_fingerprint

if TYPE_CHECKING:
    from rlhf_core.evaluation import Judge

RewardFunction = Callable[..., float]
REWARD_FUNCTION_SETTING = "`reward.function`"
ENVIRONMENT_SETTING = "`environment.class`"
LOOKED_UP = "modules are looked up in the config file's folder, the working directory and on PYTHONPATH"


class RewardFunctionError(UserError, ValueError):
    """A reward function that cannot be used: it does not load, does not take the prompt's columns, raises, or
    returns something other than a finite number. The message (one line) names it."""


class EnvironmentClassError(UserError, ValueError):
    """An environment class that cannot be used: it does not load, is not a class, cannot be constructed with no
    arguments, or lacks ``reset``/``step`` methods of the contract's shape (:mod:`runtime.environments`). The message
    (one line) names it."""


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
    except Exception as error:  # the module itself fails (a SyntaxError, a NameError at its top level)
        raise ValueError(
            f"cannot import module {module_name!r} of {reference!r}: {type(error).__name__}: {_first_line(error)}"
        ) from error
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{reference!r}: {module_name} has no attribute {attribute!r}")
        target = getattr(target, part)
    return target


def _first_line(error: BaseException) -> str:
    return next(iter(str(error).splitlines()), "")


def load_user_object(reference: str, *, setting: str, error: type[ValueError]) -> object:
    """:func:`load_object` for a setting the user wrote: a failure is ``error``, one line naming ``setting``.

    Raises:
        ValueError: (of type ``error``) ``reference`` cannot be loaded.
    """
    try:
        return load_object(reference)
    except ValueError as failure:
        raise error(f"{setting} {failure} ({LOOKED_UP})") from failure


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
    function = load_user_object(reference, setting=REWARD_FUNCTION_SETTING, error=RewardFunctionError)
    if not callable(function):
        raise RewardFunctionError(
            f"{REWARD_FUNCTION_SETTING} {reference!r} is not a reward function: it must be callable as `(prompt, "
            "response, **columns) -> float`"
        )
    return function  # type: ignore[return-value]


ENVIRONMENT_METHODS = {
    "reset": ((), {"seed": 0, "row": {}}, "reset(self, *, seed: int, row: dict) -> str"),
    "step": (("",), {}, "step(self, action: str) -> tuple[str | None, float, bool]"),
}
"""Each method of the environment contract: the arguments it is called with (checked by binding its signature to
sample ones) and its shape, as the refusals quote it."""
_INSTANCE = object()
"""Stands for ``self`` when a method's signature is bound on the class."""


def load_environment(reference: str) -> type:
    """The environment class that ``reference`` names (the contract: :mod:`runtime.environments`), its shape checked
    before any episode: constructible with no arguments, ``reset`` and ``step`` methods whose signatures take the
    arguments they are called with, and, where declared, a boolean ``deterministic``. What they return is checked at
    each call, in the environment's process.

    Raises:
        EnvironmentClassError: it cannot be loaded or does not have the contract's shape.
    """
    environment = load_user_object(reference, setting=ENVIRONMENT_SETTING, error=EnvironmentClassError)
    named = f"{ENVIRONMENT_SETTING} {reference!r}"
    if not inspect.isclass(environment):
        raise EnvironmentClassError(
            f"{named} is not a class: an environment is a class with `reset` and `step` methods, constructed for "
            "each episode"
        )
    try:
        inspect.signature(environment).bind()
    except TypeError as error:
        raise EnvironmentClassError(f"{named} cannot be constructed with no arguments: {error}") from error
    except ValueError:  # no signature to read (a class built in C): the first episode says whether it constructs
        pass
    for method, (arguments, keywords, shape) in ENVIRONMENT_METHODS.items():
        function = getattr(environment, method, None)
        if not callable(function):
            raise EnvironmentClassError(f"{named} has no method `{shape}`")
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):  # no signature to read: the first episode says whether it takes them
            continue
        if not isinstance(inspect.getattr_static(environment, method), staticmethod | classmethod):
            arguments = (_INSTANCE, *arguments)  # a plain function, as the instance's method takes self first
        try:
            signature.bind(*arguments, **keywords)
        except TypeError as error:
            raise EnvironmentClassError(f"{named}.{method} cannot be called as `{shape}`: {error}") from error
    deterministic = getattr(environment, "deterministic", True)
    if not isinstance(deterministic, bool):
        raise EnvironmentClassError(f"{named}.deterministic is {deterministic!r}: it must be True or False")
    return environment


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
            ValueError: it cannot be loaded or used (:class:`RewardFunctionError` for a reward function,
                :class:`EnvironmentClassError` for an environment).
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


@dataclass(frozen=True)
class EnvironmentReference(CodeReference):
    """An environment class by name (:func:`load_environment`), keyed by its module's code as a reward function is."""

    loader: ClassVar[Callable[[str], Any]] = staticmethod(load_environment)
