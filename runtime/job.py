"""The job a training stage hands its workers (:mod:`runtime.launch`, :mod:`runtime.worker`): its arguments as
JSON, what a worker writes into, and where a failed worker leaves its traceback. Both sides import it, so neither
imports the other for it."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ERROR_PREFIX = "error-"
"""A failed worker writes its traceback to ``job/error-<rank>.txt``."""


@dataclass
class TrainingOutput:
    """What a training function writes into, in a worker: the folders of the stage's :class:`StageOutput`.

    Args:
        path: the output's temporary folder (the main process writes its files there).
        final_dir: the output's final folder (its ``.partial`` sibling holds the mid-epoch checkpoints).
        runtime: where the models ran, sent back to the stage with the metrics.
    """

    path: Path
    final_dir: Path
    runtime: dict[str, Any] = field(default_factory=dict)


def encode(value: Any) -> Any:
    """``value`` as JSON data that :func:`decode` turns back into an equal value: frozen dataclasses (by
    class name), paths, tuples, dicts and lists of them, and plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kind = type(value)
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return {"__dataclass__": f"{kind.__module__}:{kind.__qualname__}", "fields": fields}
    if isinstance(value, Path):
        return {"__path__": str(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(item) for item in value]}
    if isinstance(value, list):
        return [encode(item) for item in value]
    if isinstance(value, Mapping):
        return {"__dict__": {str(key): encode(item) for key, item in value.items()}}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise TypeError(f"a training job argument must be plain data, a path or a dataclass, got {value!r}")


def decode(value: Any) -> Any:
    """The value :func:`encode` encoded."""
    if isinstance(value, list):
        return [decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    if "__dataclass__" in value:
        kind = resolve(value["__dataclass__"])
        return kind(**{name: decode(item) for name, item in value["fields"].items()})
    if "__path__" in value:
        return Path(value["__path__"])
    if "__tuple__" in value:
        return tuple(decode(item) for item in value["__tuple__"])
    return {key: decode(item) for key, item in value["__dict__"].items()}


def resolve(name: str) -> Any:
    """The object named ``module:qualified.name``."""
    module, _, qualified = name.partition(":")
    target: Any = importlib.import_module(module)
    for part in qualified.split("."):
        target = getattr(target, part)
    return target
