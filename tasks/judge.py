"""Judges reached by name: ``module:attribute`` (e.g. ``demo.gold:JUDGE``), so no task imports one.

A judge is a :class:`rlhf_core.evaluation.Judge`: ``score(prompt, response)`` and
``prefers(prompt, first, second)``. The embedded demo's hidden gold rubric is one; a user can
name their own.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tasks.code import code_fingerprint

if TYPE_CHECKING:
    from rlhf_core.evaluation import Judge


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
    """The :class:`Judge` that ``reference`` names.

    Raises:
        ValueError: it cannot be loaded, or has no ``score`` and ``prefers`` methods.
    """
    judge = load_object(reference)
    if not all(callable(getattr(judge, method, None)) for method in ("score", "prefers")):
        raise ValueError(
            f"{reference!r} is not a judge: it needs `score(prompt, response)` and `prefers(prompt, a, b)`"
        )
    return judge  # type: ignore[return-value]


@dataclass(frozen=True)
class JudgeReference:
    """A judge by name (``module:attribute``) and the fingerprint of its module's code.

    As a stage setting it is keyed by both, so editing the rubric re-runs what it judged.
    """

    name: str
    code: str

    @classmethod
    def of(cls, name: str) -> JudgeReference:
        """The reference to ``name``, checked to load as a judge.

        Raises:
            ValueError: see :func:`load_judge`.
        """
        load_judge(name)
        return cls(name=name, code=code_fingerprint(name.partition(":")[0]))

    def load(self) -> Judge:
        return load_judge(self.name)
