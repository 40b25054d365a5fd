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
from typing import Any, NamedTuple

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
        answer = engine_generate(self, prompts, seeds, config=config, eos_token_id=eos_token_id)
        return answer.tokens, answer.logprobs


class ProbeBatch(NamedTuple):
    """Token sequences to score: each a prompt followed by a response, as plain lists (what the server reads)."""

    sequences: list[list[int]]
    prompt_lengths: list[int]


class EngineAnswer(NamedTuple):
    """The engine's answer to a generation request.

    Args:
        tokens: each row's response tokens (EOS included when reached).
        logprobs: the engine's log-prob of each (after temperature).
        state: what the engine held for the request; it changes with every swap (``engine_server/server.py``,
            choice 8).
        swap_seconds: what the request's weight swap took (0 when none).
        probe_logprobs: the probe's log-probs (:func:`engine_score`'s) when the request carried a probe and ``state``
            was not the one given as verified, else None.
        probe_seconds: what scoring the probe took in the engine (0 when it was not scored).
    """

    tokens: list[list[int]]
    logprobs: list[list[float]]
    state: str
    swap_seconds: float
    probe_logprobs: list[list[float]] | None
    probe_seconds: float


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
    probe: ProbeBatch | None = None,
    verified: str | None = None,
    timeout: float = 24 * 3600.0,
) -> EngineAnswer:
    """One response per prompt from the engine, each sampled with its own seed.

    Args:
        probe: a batch the engine scores right after a swap, in the same request (:class:`EngineAnswer`), or None.
        verified: the engine state the caller last proved with ``probe``; the probe is scored unless the engine
            still holds it.

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
        "probe": None if probe is None else probe._asdict(),
        "verified": verified,
    }
    answer = _call(f"{policy.url}/generate", request, timeout=timeout)
    scored = answer.get("probe")
    return EngineAnswer(
        tokens=answer["tokens"],
        logprobs=answer["logprobs"],
        state=answer["state"],
        swap_seconds=answer["swap_seconds"],
        probe_logprobs=None if scored is None else scored["logprobs"],
        probe_seconds=0.0 if scored is None else scored["seconds"],
    )


class ScoreAnswer(NamedTuple):
    """The engine's answer to a scoring request: the log-prob of every response token of each sequence, what the
    request's weight swap took (0 when none) and what the scoring took, in seconds."""

    logprobs: list[list[float]]
    swap_seconds: float
    seconds: float


def engine_score(policy: ServedPolicy, batch: ProbeBatch, *, timeout: float = 3600.0) -> ScoreAnswer:
    """The engine's log-prob of every response token of ``batch`` under ``policy``: temperature 1, over the whole
    vocabulary (vLLM's prompt log-probs), swapping the policy in first if the engine does not hold it.

    Raises:
        EngineError: the engine is gone or failed the request.
    """
    request = {"weights": policy.weights, "adapter": policy.adapter, **batch._asdict()}
    answer = _call(f"{policy.url}/score", request, timeout=timeout)
    return ScoreAnswer(logprobs=answer["logprobs"], swap_seconds=answer["swap_seconds"], seconds=answer["seconds"])


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
