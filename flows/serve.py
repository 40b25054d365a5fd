"""Prefect deployments of the iteration, campaign and replay flows, served from one process (``rlhf serve``).

1. One deployment per flow and campaign, named ``rlhf-iteration/<campaign>``, ``rlhf-campaign/<campaign>``
   and ``rlhf-replay/<campaign>``. The served config is each deployment's default ``config``, so a
   run without parameters (a scheduled one, or "Quick run" in the UI) does what ``rlhf iterate``,
   ``rlhf run`` or ``rlhf replay`` would do with that config.
2. A cron or interval schedule goes on the iteration deployment only. Its runs pass no
   ``iteration``, so each one continues the campaign from its latest finished iteration in MLflow.
3. Each deployment runs one flow run at a time (``concurrency_limit=1``; later runs wait in
   ``AwaitingConcurrencySlot``). That alone cannot keep a campaign run, an iteration run and a
   command-line run apart, so the iteration flow also holds the campaign's file lock.
4. The UI's "Custom run" form is Prefect's rendering of the flows' type hints, and the server
   checks a run's parameters against the same JSON schema before it creates the run. The stage
   configs are plain dataclasses whose checks live in ``__post_init__``, which JSON schema cannot
   see; :func:`schema_bounds` states the bounds each field declares (``rlhf_core.config.bounded``,
   the one place they are written) as JSON-schema keywords, so that the server (and the form)
   refuses, say, ``ppo.clip_eps = -1``. Anything else (cross-field checks) is still refused when
   the flow validates its parameters, before its first task.
5. Stopping ``serve`` (Ctrl-C or SIGTERM) pauses the deployments, so no scheduled runs pile up while
   nothing serves them; serving again resumes them. Prefect 3.8.8's own SIGTERM handler exits without
   pausing or cancelling anything (it never awaits its stop coroutine), so :class:`_Runner` fixes it.
6. ``--replay-on-register SETTING=VALUE`` attaches a trigger to the replay deployment (:func:`replay_trigger`): when
   the campaign registers a policy (the event :data:`runtime.events.POLICY_REGISTERED`), Prefect's automation starts
   a replay of that policy's iteration with those settings. The replay waits for the campaign's lock, so it runs once
   the iteration that registered the policy has finished.
7. On a machine with GPUs, serving sets the ``gpu`` tag's concurrency limit to their number
   (:func:`runtime.concurrency.ensure_gpu_limit`): the GPU stages of every campaign served against the same Prefect
   server take turns, at most one per GPU at once.
8. A Prefect server that does not answer (never started, or gone while serving) is asked once, for a few seconds
   (:func:`server_answers`), not through the client's retries: serving refuses to start, and stopping says the
   deployments could not be paused and exits within seconds, instead of half a minute of connection-error
   tracebacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import math
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any, NoReturn

import httpx
import torch
from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.events import DeploymentEventTrigger
from prefect.logging import get_logger
from prefect.runner import Runner
from prefect.settings import get_current_settings
from pydantic import ValidationError

from campaign.config import ConfigError, PipelineConfig
from flows.replay import with_replay_changes
from flows.rlhf_pipeline import rlhf_campaign, rlhf_iteration, rlhf_replay
from rlhf_core.config import field_bounds
from runtime.concurrency import ensure_gpu_limit
from runtime.events import POLICY_REGISTERED, campaign_resource
from runtime.prefect_internals import parameter_schema, set_parameter_schema

logger = get_logger("rlhf.serve")  # under prefect's logger, so it shows at INFO in the console

_SCHEMA_KEYWORDS = {"gt": "exclusiveMinimum", "ge": "minimum", "lt": "exclusiveMaximum", "le": "maximum"}


def schema_bounds() -> dict[type, dict[str, dict[str, float]]]:
    """``stage config class -> {field: JSON-schema bounds}`` of every stage config in :class:`PipelineConfig`,
    from the bounds its fields declare. On an optional field they bound the number, not the null."""
    classes = [
        info.annotation for info in PipelineConfig.model_fields.values() if dataclasses.is_dataclass(info.annotation)
    ]
    return {
        config_class: {
            name: {
                _SCHEMA_KEYWORDS[limit]: value
                for limit, value in dataclasses.asdict(bounds).items()
                if value is not None
            }
            for name, bounds in field_bounds(config_class).items()
        }
        for config_class in classes
    }


HIDDEN_PARAMETERS = {
    "rlhf-iteration": ("state", "fresh", "base", "ahead"),
    "rlhf-campaign": ("base",),
    "rlhf-replay": ("base",),
}
"""Flow parameters left out of a deployment's form: what one command hands its flows in process (the hand-over
between the iterations of a campaign, a recompute asked with ``--from-iteration``, the base inputs it resolved,
whether the next iteration's generation runs ahead)."""


def with_bounds(schema: dict[str, Any], *, hidden: tuple[str, ...] = ()) -> dict[str, Any]:
    """A flow's parameter schema with :func:`schema_bounds` added and ``hidden`` parameters removed.

    Raises:
        KeyError: a bounded config class or field is missing from the schema (renamed?).
    """
    schema = copy.deepcopy(schema)
    for name in hidden:
        schema["properties"].pop(name, None)
    definitions = schema.get("definitions", {})
    for config_class, fields in schema_bounds().items():
        properties = definitions[config_class.__name__]["properties"]
        for field, bounds in fields.items():
            prop = properties[field]
            numbers = [option for option in prop.get("anyOf", [prop]) if option.get("type") in ("integer", "number")]
            if not numbers:
                raise KeyError(f"{config_class.__name__}.{field} has no numeric type to bound")
            for option in numbers:
                option.update(bounds)
    return schema


def replay_trigger(config: PipelineConfig, overrides: list[str]) -> DeploymentEventTrigger:
    """The trigger that replays the iteration of each policy ``config``'s campaign registers, with ``overrides``
    (``advantages.kl_coef=0.1``, ...): :data:`runtime.events.POLICY_REGISTERED` about the campaign starts the replay
    deployment with the iteration's MLflow run as ``source_run_id``.

    Raises:
        ConfigError: an override a replay cannot honour (:func:`flows.replay.with_replay_changes`).
    """
    replay = with_replay_changes(config, overrides, location=config)
    changes = ", ".join(overrides)
    return DeploymentEventTrigger(
        name=f"replay each new policy of {config.campaign} with {changes}",
        description=f"When campaign {config.campaign} registers a policy, replay its iteration with {changes}",
        expect={POLICY_REGISTERED},
        match={"prefect.resource.id": campaign_resource(config.campaign)["prefect.resource.id"]},
        parameters={"config": replay.model_dump(mode="json"), "source_run_id": "{{ event.payload.iteration_run_id }}"},
    )


def build_deployments(
    config: PipelineConfig,
    *,
    cron: str | None = None,
    interval: float | None = None,
    replay_on_register: list[str] | None = None,
) -> list[RunnerDeployment]:
    """The iteration, campaign and replay deployments of ``config``'s campaign, with ``config`` as default.

    Args:
        config: the served config; every run's ``config`` parameter defaults to it.
        cron: a cron expression (UTC) on which the iteration deployment runs one more iteration.
        interval: alternatively, seconds between scheduled iterations.
        replay_on_register: the replay deployment's trigger (:func:`replay_trigger`): each newly registered
            policy's iteration is replayed with these settings. None: no trigger.

    Raises:
        ConfigError: both ``cron`` and ``interval``, a non-positive ``interval``, a malformed ``cron``, or a replay
            setting a replay cannot change.
    """
    if cron is not None and interval is not None:
        raise ConfigError("give either a cron schedule or an interval, not both")
    if interval is not None and not (math.isfinite(interval) and interval > 0):
        raise ConfigError(f"the schedule interval must be a positive number of seconds, got {interval}")
    defaults = {"config": config.model_dump(mode="json")}
    common = dict(
        name=config.campaign,
        concurrency_limit=1,
        tags=["rlhf", f"campaign:{config.campaign}"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    try:
        iteration = rlhf_iteration.to_deployment(
            parameters=defaults,
            cron=cron,
            interval=None if interval is None else timedelta(seconds=interval),
            **common,
        )
    except ValueError as error:
        problem = error.errors()[0]["msg"] if isinstance(error, ValidationError) else str(error).splitlines()[0]
        raise ConfigError(
            f"--cron {cron!r} is not a valid cron schedule: {problem.removeprefix('Value error, ')}"
        ) from error
    deployments = [
        iteration,
        rlhf_campaign.to_deployment(parameters=defaults, **common),
        rlhf_replay.to_deployment(
            parameters=defaults,
            triggers=[replay_trigger(config, replay_on_register)] if replay_on_register else None,
            **common,
        ),
    ]
    for deployment in deployments:
        hidden = HIDDEN_PARAMETERS.get(deployment.flow_name, ())
        set_parameter_schema(deployment, with_bounds(parameter_schema(deployment), hidden=hidden))
    return deployments


class NoPrefectServer(LookupError):
    """``PREFECT_API_URL`` is unset: served deployments would live in a temporary server nobody can reach."""


class PrefectServerUnreachable(LookupError):
    """The Prefect server serving talks to does not answer."""


HEALTH_TIMEOUT_SECONDS = 3.0


def server_answers(api_url: str) -> bool:
    """Whether the Prefect API at ``api_url`` answers its health check within :data:`HEALTH_TIMEOUT_SECONDS`, asked
    once (the Prefect client retries a refused connection for half a minute)."""
    try:
        return httpx.get(f"{api_url.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_SECONDS).status_code == 200
    except httpx.HTTPError:
        return False


class _Runner(Runner):
    """Prefect's runner, stopping on SIGTERM the way its own ``stop`` would: cancel the flow runs it is
    running (they end Cancelled rather than stay Running), stop polling, pause the deployments.

    Where the server no longer answers (SIGTERM or Ctrl-C), nothing can be paused or marked: the runner says so,
    ends the flow runs it started and exits at once (:meth:`_abandon`), where Prefect's clients would retry
    every call (and its log and event workers their last batches) for half a minute and more.
    """

    async def start(self, *args: Any, **kwargs: Any) -> None:
        self._loop = asyncio.get_running_loop()
        signal.signal(signal.SIGINT, self._handle_sigint)
        await super().start(*args, **kwargs)  # installs handle_sigterm

    def handle_sigterm(self, *args: Any, **kwargs: Any) -> None:
        self._abandon_if_server_gone()
        self._logger.info("SIGTERM received: cancelling running flow runs and stopping")
        self._loop.call_soon_threadsafe(self._begin_stop)

    def _handle_sigint(self, *args: Any) -> None:
        self._abandon_if_server_gone()
        raise KeyboardInterrupt  # what Python's own handler does: asyncio.run stops the runner, which pauses

    def _begin_stop(self) -> None:
        self._stop_task = self._loop.create_task(self.astop())  # kept, so it is not garbage-collected

    def _abandon_if_server_gone(self) -> None:
        api_url = get_current_settings().api.url or ""
        if not server_answers(api_url):
            self._abandon(api_url)

    def _abandon(self, api_url: str) -> NoReturn:
        """End the flow runs this runner started (SIGTERM, then SIGKILL after 5 s), say why, exit with code 2."""
        pids = [entry["pid"] for entry in self._flow_run_process_map.values()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while pids and time.monotonic() < deadline:
            pids = [pid for pid in pids if _alive(pid)]
            time.sleep(0.1)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        sys.stderr.write(
            f"rlhf: the Prefect server at {api_url} does not answer: stopped serving without pausing the deployments "
            "(their schedule goes on once the server is back: serve again, or pause them in its UI)\n"
        )
        sys.stderr.flush()
        os._exit(2)  # not sys.exit: Prefect's exit handlers would retry sending logs and events to the server


def _alive(pid: int) -> bool:
    """Whether the child process ``pid`` still runs (reaping it if it has ended)."""
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:  # not our child (any more): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def serve_pipeline(
    config: PipelineConfig,
    *,
    cron: str | None = None,
    interval: float | None = None,
    replay_on_register: list[str] | None = None,
) -> None:
    """Serve :func:`build_deployments` until Ctrl-C or SIGTERM; flow runs execute in subprocesses of this one.

    What ``prefect.serve`` does, with a runner that also stops cleanly on SIGTERM (see :class:`_Runner`).

    Raises:
        NoPrefectServer: no Prefect server is configured.
        PrefectServerUnreachable: it does not answer.
        ConfigError: see :func:`build_deployments`.
    """
    deployments = build_deployments(  # a bad schedule or replay setting is named first
        config, cron=cron, interval=interval, replay_on_register=replay_on_register
    )
    settings = get_current_settings()
    if not settings.api.url:
        raise NoPrefectServer(
            "serving needs a Prefect server: start one with `prefect server start --host 127.0.0.1 --port 4200` "
            "and `export PREFECT_API_URL=http://127.0.0.1:4200/api`"
        )
    if not server_answers(settings.api.url):
        raise PrefectServerUnreachable(
            f"the Prefect server at PREFECT_API_URL={settings.api.url} does not answer: start it "
            "(`prefect server start`), or point PREFECT_API_URL at one that runs"
        )
    ensure_gpu_limit(torch.cuda.device_count())
    runner = _Runner(pause_on_shutdown=True)
    for deployment in deployments:
        runner.add_deployment(deployment)
    names = ", ".join(f"{d.flow_name}/{d.name}" for d in deployments)
    logger.info("serving %s; runs appear at %s/runs; Ctrl-C stops and pauses them", names, settings.ui_url)
    try:
        asyncio.run(runner.start())
    except KeyboardInterrupt:
        pass
    logger.info("stopped; the deployments are paused until served again")
