"""The client of the generation engine server (``engine_server/server.py``): a long-lived vLLM engine in its own
process and environment, reached by URL. Standard library only (JSON over HTTP).

:func:`rlhf_core.generation.generate` samples through it when it is given a :class:`ServedPolicy` (an
:class:`rlhf_core.generation.ExternalSampler`) instead of a model; nothing else calls it but the health check of the
command that starts the engine.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_core.config import SamplingConfig
from rlhf_core.errors import UserError


class EngineError(UserError, RuntimeError):
    """The generation engine did not answer, or failed a request."""


@dataclass(frozen=True)
class ServedPolicy:
    """A policy as the generation engine serves it: full weights from a folder, plus an optional LoRA adapter.

    Args:
        url: the engine server, ``http://HOST:PORT``.
        weights: a Hugging Face folder of full weights (the base, under LoRA).
        adapter: a LoRA adapter folder (peft files) over ``weights``, or None.
    """

    url: str
    weights: str
    adapter: str | None = None

    def sample(
        self, prompts: list[list[int]], seeds: list[int], *, config: SamplingConfig, eos_token_id: int | None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One response per prompt from the engine (:func:`engine_generate`)."""
        return engine_generate(self, prompts, seeds, config=config, eos_token_id=eos_token_id)


def served_policy(source: str | Path, url: str | None, *, bases: dict[str, Path]) -> ServedPolicy:
    """The causal LM of the folder ``source`` as the engine at ``url`` serves it: the folder's own weights, or its
    base's (a folder that only refers to one, :class:`rlhf_core.loading.FolderMeta`), plus its LoRA adapter if it
    holds one.

    Args:
        bases: base-model name -> folder (:attr:`rlhf_core.loading.ModelLoader.bases`).

    Raises:
        ValueError: no engine URL (``sampling.engine: vllm`` needs one: the command starts the engine), or a folder
            that refers to a base this run does not have.
    """
    from rlhf_core.loading import FolderMeta

    if not url:
        raise ValueError("`sampling.engine` vllm needs a running engine: none was started or given (engine_url)")
    source = Path(source)
    meta = FolderMeta.read(source)
    weights = source
    if meta is not None and meta.base:
        if meta.base not in bases:
            raise ValueError(f"a model folder refers to the base {meta.base!r}, which this run does not have")
        weights = bases[meta.base]
    adapter = source if meta is not None and meta.adapter else None
    return ServedPolicy(url=url, weights=str(weights), adapter=None if adapter is None else str(adapter))


def engine_health(url: str, *, timeout: float = 5.0) -> dict[str, Any]:
    """The server's ``/health`` answer.

    Raises:
        EngineError: it did not answer.
    """
    return _call(f"{url}/health", None, timeout=timeout)


def engine_generate(
    policy: ServedPolicy,
    prompts: list[list[int]],
    seeds: list[int],
    *,
    config: SamplingConfig,
    eos_token_id: int | None,
    timeout: float = 24 * 3600.0,
) -> tuple[list[list[int]], list[list[float]]]:
    """One response per prompt from the engine, each sampled with its own seed.

    Returns:
        Each row's response tokens (EOS included when reached) and the engine's log-prob of each (after
        temperature).

    Raises:
        EngineError: the engine is gone or failed the request.
    """
    request = {
        "weights": policy.weights,
        "adapter": policy.adapter,
        "prompts": prompts,
        "seeds": seeds,
        "temperature": config.temperature,
        "top_k": config.top_k,
        "top_p": config.top_p,
        "max_tokens": config.max_new_tokens,
        "stop_token_id": eos_token_id,
    }
    answer = _call(f"{policy.url}/generate", request, timeout=timeout)
    return answer["tokens"], answer["logprobs"]


def _call(url: str, body: dict[str, Any] | None, *, timeout: float) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        try:
            problem = json.loads(error.read()).get("error", "")
        except (ValueError, OSError):
            problem = ""
        raise EngineError(f"the generation engine at {url} failed the request: {problem or error}") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise EngineError(f"the generation engine at {url} did not answer: {reason}") from None
