"""The versions of the libraries that compute a stage's output: recorded in every stage manifest (:mod:`runtime.stage`)
and on every iteration run (:func:`campaign.history.provenance`).

A stage's input key covers the project's own code (:mod:`runtime.code`), not the libraries under it: upgrading torch
or transformers changes no key. So what ran is recorded instead. A manifest then says which libraries produced its
output, and a campaign continued after an upgrade says so in one line (:func:`campaign.history.what_differs`).

Choices:
1. Versions come from the installed distributions' metadata (:mod:`importlib.metadata`), never from importing the
   library: recognising a finished campaign imports no torch.
2. vLLM runs in an environment of its own (:mod:`runtime.engine`), so its version is the engine's own: the one its
   identity names (:func:`runtime.engine.engine_identity`, read once per command from its ``/health``), which also
   keys the stages that sample on it.
3. gguf is recorded only where a model was converted from a GGUF file, and vLLM only where a stage samples on the
   engine: the version of a library that computed nothing would be noise in a comparison.
"""

from __future__ import annotations

import importlib.metadata
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.context import StageContext

LIBRARIES = ("torch", "transformers", "peft", "accelerate")
"""The distributions every stage computes with (through :mod:`rlhf_core`)."""


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (``transformers``, ``gguf``), or None where it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def library_versions(*, vllm: str | None = None, gguf: bool = False) -> dict[str, str]:
    """``{library: version}`` of Python and :data:`LIBRARIES` (those installed); gguf's with ``gguf`` (a model was
    converted from a GGUF file); ``vllm``, the generation engine's version, where one is given."""
    names = (*LIBRARIES, "gguf") if gguf else LIBRARIES
    versions = {"python": platform.python_version()}
    versions.update({name: version for name in names if (version := installed_version(name)) is not None})
    if vllm is not None:
        versions["vllm"] = vllm
    return versions


def stage_versions(context: StageContext, *, on_engine: bool) -> dict[str, str]:
    """:func:`library_versions` for one stage: vLLM's where it samples ``on_engine``
    (:func:`runtime.engine.samples_on_engine`), gguf's where a base model was converted from a GGUF file."""
    vllm = context.execution.engine_vllm if on_engine else None
    return library_versions(vllm=vllm, gguf=bool(context.base.sources))
