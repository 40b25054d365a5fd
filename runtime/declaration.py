"""What a stage is given, declared once: a frozen dataclass of its *settings* and its *inputs*.

Each stage's ``Settings`` class (all of them in :mod:`tasks.settings`) has two kinds of fields:

* a **setting**, ``field = setting("config.path")``: read from the config (a field, a section such as
  ``sampling``, or a property such as ``advantages.uses_critic``) or from the campaign's base inputs
  (``base.<field>``). Its value enters the stage's input key (:func:`setting_values`) and its MLflow params;
  the campaign's settings table and the replay rules are derived from these paths (:mod:`campaign.settings`);
* an **input**, ``field = upstream()``: another stage's output (a :class:`StageResult`, a tuple of them, or
  None), or anything else with a ``digest``; it enters the key by that digest (:func:`input_digests`).

So a new stage setting is one edit: a field here. The flows hand a stage only its inputs; its settings come from
the config by their paths (:func:`settings_from`), so a stage can be given nothing it does not declare.

Nothing here imports torch or Prefect: the campaign model reads these declarations to answer "which settings
may a replay change" without loading a model library.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from storage.manifest import Manifest

BASE = "base."
"""The prefix of a setting read from the campaign's base inputs (``base.judge``) rather than from the config."""
_PATH = "rlhf_config_path"
_INPUT = "rlhf_input"
_UNKEYED = "rlhf_unkeyed"


def setting(path: str, *, keyed: bool = True) -> Any:
    """A settings field read from the config at the dotted ``path`` (or ``base.<field>``).

    Args:
        keyed: it can change the output, so it enters the key and the MLflow params; False for how a stage shows or
            paces its work, never what it computes (the forms a person answers, say).
    """
    return field(metadata={_PATH: path, _UNKEYED: not keyed})


def upstream() -> Any:
    """A settings field that is another stage's output (or anything with a ``digest``), keyed by its digest."""
    return field(metadata={_INPUT: True})


@dataclass(frozen=True)
class StageSettings:
    """The base of every stage's settings: ``stage`` names the stage (its folder, task, MLflow run and metrics), and
    ``module`` the module that declares it (``tasks.<stage>`` unless a subclass says otherwise)."""

    stage: ClassVar[str]
    module: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "module" not in cls.__dict__:
            cls.module = f"tasks.{cls.stage}"


@dataclass(frozen=True)
class StageResult:
    """A small reference to a finished stage output: what stages pass each other (never tensors)."""

    stage: str
    path: str
    input_key: str
    digest: str
    reused: bool
    run_id: str | None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def directory(self) -> Path:
        return Path(self.path)

    @classmethod
    def of(cls, stage_dir: Path, manifest: Manifest, *, reused: bool, run_id: str | None) -> StageResult:
        """The reference to the verified output in ``stage_dir`` that ``manifest`` describes."""
        return cls(
            stage=manifest.stage,
            path=str(stage_dir),
            input_key=manifest.input_key,
            digest=manifest.digest,
            reused=reused,
            run_id=run_id,
            metrics=dict(manifest.metrics),
        )


def setting_paths(settings: type[StageSettings]) -> dict[str, str]:
    """``{field: config path}`` of the settings of ``settings`` (its inputs left out), in declaration order."""
    return {f.name: f.metadata[_PATH] for f in dataclasses.fields(settings) if _PATH in f.metadata}


def input_names(settings: type[StageSettings]) -> tuple[str, ...]:
    """The fields of ``settings`` that are inputs, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(settings) if f.metadata.get(_INPUT))


def config_value(config: Any, path: str) -> Any:
    """The value at a dotted path of the config (``sizes.eval_prompts``)."""
    value = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def settings_from(settings: type[StageSettings], config: Any, base: Any, inputs: Mapping[str, Any]) -> StageSettings:
    """The settings of a stage: each setting read from ``config`` or ``base`` by its path, each input from
    ``inputs``.

    Raises:
        TypeError: ``inputs`` names something the stage does not take, or leaves one of its inputs out.
    """
    names = input_names(settings)
    if unknown := sorted(set(inputs) - set(names)):
        raise TypeError(f"stage {settings.stage} takes the inputs {', '.join(names)}; not {', '.join(unknown)}")
    if missing := [name for name in names if name not in inputs]:
        raise TypeError(f"stage {settings.stage} needs the inputs {', '.join(missing)}")
    values = {
        name: config_value(base, path[len(BASE) :]) if path.startswith(BASE) else config_value(config, path)
        for name, path in setting_paths(settings).items()
    }
    return settings(**values, **inputs)


def setting_values(settings: StageSettings) -> dict[str, Any]:
    """The keyed settings of ``settings`` (not its inputs) by name, as they are: what enters the key."""
    keyed = [f.name for f in dataclasses.fields(settings) if _PATH in f.metadata and not f.metadata[_UNKEYED]]
    return {name: getattr(settings, name) for name in keyed}


def input_digests(settings: StageSettings) -> dict[str, str]:
    """``name -> digest`` of every input of ``settings`` that is given; a tuple ``name`` gives ``name_0``, ...."""
    digests: dict[str, str] = {}
    for name in input_names(type(settings)):
        value = getattr(settings, name)
        if isinstance(value, tuple | list):
            digests.update({f"{name}_{index}": result.digest for index, result in enumerate(value)})
        elif value is not None:
            digests[name] = value.digest
    return digests
