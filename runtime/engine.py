"""The generation engine a command samples on with ``sampling.engine: vllm``: started once, kept for every
generation stage of every iteration the command runs, gone when the command is.

Choices:
1. It runs in a process of its own, from an environment of its own (``.venv-vllm``, made by
   ``bash scripts/setup-vllm.sh``; ``RLHF_VLLM_ENV`` names another): vLLM pins exact torch and transformers
   versions, the project's ``.venv`` keeps its own. The process is ``engine_server/server.py``.
2. It is started like the temporary Prefect server (:mod:`flows.prefect_server`): in a process group of its
   own, through a launcher that asks the kernel to end it when the command dies (``kill -9`` included), and
   stopped at exit. One engine per process: a second config that needs another one (another policy, dtype or
   adapter rank) stops the first.
3. The command starts it while checking its inputs (:func:`ensure_engine`) and waits until it has loaded the
   initial policy, so what the engine cannot do (not installed, a model it cannot serve, a port taken) is one
   line naming ``sampling.engine`` before any stage runs (:class:`EngineStartError`).
4. ``execution.engine_url`` names an engine someone already runs: nothing is started, and its health is checked.
5. Dask and Ray workers reach the engine at its URL (``Execution.engine_url``); it serves one request at a time.
6. One engine per machine: a started engine holds the machine's engine slot, a Prefect global concurrency limit
   (:func:`runtime.concurrency.engine_slot`), until it stops or the command ends; a second command waits for it, and
   says so.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

from rlhf_core.errors import UserError
from rlhf_core.precision import Precision
from runtime.children import free_port, launch_tied, stop
from runtime.concurrency import engine_slot
from runtime.declaration import StageSettings, setting_values
from runtime.execution import ExecutionConfig
from runtime.threads import command_threads

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "engine_server" / "server.py"
ENVIRONMENT = ".venv-vllm"
START_SECONDS = float(os.environ.get("RLHF_ENGINE_START_SECONDS", "900"))
_ADDRESS_IN_USE = 3  # engine_server/server.py's exit code when its port is taken
_STOP_SECONDS = 10.0
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class EngineStartError(UserError, RuntimeError):
    """The generation engine cannot be used: not installed, cannot serve the model, its port is taken."""


_running: tuple[tuple, subprocess.Popen, str, Path] | None = None
"""The engine this process started: its launch arguments, process, URL and log file."""
_slot = contextlib.ExitStack()
"""The machine's engine slot (:func:`runtime.concurrency.engine_slot`) while this process's engine runs."""


def engine_python() -> Path:
    """The engine environment's Python (``RLHF_VLLM_ENV`` or ``.venv-vllm`` beside the project)."""
    return Path(os.environ.get("RLHF_VLLM_ENV") or ROOT / ENVIRONMENT) / "bin" / "python"


def server_script() -> str:
    """The server the engine runs: ``engine_server/server.py``, or the script ``RLHF_ENGINE_SERVER`` names (the
    fault-injection tests' broken server, tests/flows/faulty_engine_server.py)."""
    return os.environ.get("RLHF_ENGINE_SERVER") or str(SERVER)


def engine_lora_mode(choice: str, *, precision: Precision, device: str) -> str:
    """How the engine serves a LoRA policy (``execution.engine_lora``): ``merge`` or ``request``.

    A merge sums in fp32 and writes the weights in the engine's dtype (``engine_server.server.merged_lora_weights``):
    exact in an fp32 engine, but a bf16 or fp16 weight cannot hold a LoRA update (it is far below half an ulp of the
    weight, and most of it would be lost). So ``auto`` merges only in an fp32 engine on a CPU, where vLLM's LoRA
    kernels halved SmolLM2's tokens/s, and sends requests elsewhere.

    Raises:
        EngineStartError: ``merge`` asked for in a bf16 or fp16 engine.
    """
    if choice == "merge" and precision != "fp32":
        raise EngineStartError(
            f"`sampling.engine` vllm: `execution.engine_lora` merge cannot serve a LoRA policy in a {precision} engine "
            f"(`precision` {precision}): the merged weights would round most of the update away; use request or auto"
        )
    if choice == "auto":
        return "merge" if device == "cpu" and precision == "fp32" else "request"
    return choice


def server_arguments(
    execution: ExecutionConfig, *, precision: Precision, lora_rank: int | None, policy: str, port: int
) -> list[str]:
    """The server's command-line options, serving ``policy`` first.

    Args:
        precision: the stages' precision: the engine's dtype.
        lora_rank: the rank of the policy's LoRA adapters (``model.lora.r``), or None for full fine-tuning.

    Raises:
        EngineStartError: see :func:`engine_lora_mode`.
    """
    from rlhf_core.precision import resolve_device

    device = resolve_device(execution.device).type
    arguments = ["--model", str(policy), "--port", str(port), "--dtype", _DTYPES[precision]]
    if lora_rank is not None:
        lora_mode = engine_lora_mode(execution.engine_lora, precision=precision, device=device)
        arguments += ["--lora-mode", lora_mode]
        if lora_mode == "request":
            arguments += ["--max-lora-rank", str(lora_rank)]
    if not execution.engine_compile:
        arguments.append("--enforce-eager")
    if device != "cpu":
        arguments += ["--gpu-memory-utilization", str(execution.engine_gpu_memory)]
    return arguments


def _environment(execution: ExecutionConfig, policy: str, threads: int | None) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # the engine core in the server's process: deterministic scheduling
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    # The CPU build's KV cache (GiB), and its threads: the stages' own thread count unless set.
    environment.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    environment.setdefault("OMP_NUM_THREADS", str(threads or command_threads(execution.torch_threads, policy)))
    environment.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return environment


def stop_engine() -> None:
    """Stop the engine this process started, if any."""
    global _running
    if _running is not None:
        stop(_running[1], timeout=_STOP_SECONDS)
        _running = None
    _slot.close()


def _wait(process: subprocess.Popen, url: str, log: Path, *, policy: str, port: int) -> None:
    """Wait until the engine has loaded ``policy``.

    Raises:
        EngineStartError: it exited, failed to load the model, or did not answer in time.
    """
    from runtime.engine_client import EngineError, engine_health

    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        code = process.poll()
        if code == _ADDRESS_IN_USE:
            raise EngineStartError(
                f"`sampling.engine` vllm: port {port} (`execution.engine_port`) is taken; free it or set another"
            )
        if code is not None:
            raise EngineStartError(f"`sampling.engine` vllm: the engine exited with code {code} ({_last_line(log)})")
        with contextlib.suppress(EngineError):
            health = engine_health(url, timeout=2.0)
            if health["state"] == "ready":
                return
            if health["state"] == "failed":
                stop(process, timeout=_STOP_SECONDS)
                raise EngineStartError(f"`sampling.engine` vllm cannot serve the model {policy}: {health['error']}")
        time.sleep(0.25)
    stop(process, timeout=_STOP_SECONDS)
    raise EngineStartError(
        f"`sampling.engine` vllm: the engine did not start within {START_SECONDS:.0f} s (RLHF_ENGINE_START_SECONDS); "
        f"its log: {log}"
    )


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else f"no output; log {log}"


def ensure_engine(
    execution: ExecutionConfig,
    *,
    precision: Precision,
    lora_rank: int | None,
    policy: str,
    threads: int | None = None,
) -> str:
    """The URL of a generation engine (``sampling.engine: vllm``), starting one if needed.

    Args:
        execution: ``engine_url`` names a running engine, else one is started with the ``engine_*`` settings.
        precision, lora_rank: see :func:`server_arguments`.
        policy: the initial policy's folder, which the engine loads first.
        threads: the threads of an engine it starts (the command's, :mod:`runtime.threads`); None resolves
            ``execution.torch_threads`` for ``policy``.

    Raises:
        EngineStartError: see :class:`EngineStartError`.
    """
    global _running
    from runtime.engine_client import EngineError, engine_health

    if execution.engine_url:
        url = execution.engine_url.rstrip("/")
        try:
            health = engine_health(url)
        except EngineError as error:
            raise EngineStartError(f"`sampling.engine` vllm: `execution.engine_url` {error}") from None
        if health.get("state") != "ready":
            raise EngineStartError(
                f"`sampling.engine` vllm: the engine at `execution.engine_url` {url} is {health.get('state')}"
                + (f": {health['error']}" if health.get("error") else "")
            )
        return url
    python = engine_python()
    if not python.exists():
        raise EngineStartError(
            f"`sampling.engine` vllm needs the engine's environment ({python.parents[1]} is missing): run "
            "`bash scripts/setup-vllm.sh` (see docs/engines.md)"
        )
    options = {"precision": precision, "lora_rank": lora_rank, "policy": policy}
    key = (str(python), *server_arguments(execution, **options, port=execution.engine_port))
    if _running is not None and _running[0] == key and _running[1].poll() is None:
        return _running[2]
    stop_engine()
    _slot.enter_context(engine_slot())
    atexit.register(_slot.close)  # registered before the engine's stop below, so it runs after it (last in, first)
    try:
        port = execution.engine_port or free_port()
        url = f"http://127.0.0.1:{port}"
        log = Path(tempfile.mkstemp(prefix="rlhf-vllm-", suffix=".log")[1])
        with log.open("w") as output:
            process = launch_tied(
                str(python),
                [str(python), "-I", server_script(), *server_arguments(execution, **options, port=port)],
                env=_environment(execution, policy, threads),
                stdout=output,
                stderr=subprocess.STDOUT,
            )
        atexit.register(stop, process, timeout=_STOP_SECONDS)
        logger.info("starting the vLLM generation engine on %s (log: %s)", url, log)
        start = time.perf_counter()
        _wait(process, url, log, policy=policy, port=port)
    except BaseException:
        _slot.close()  # an engine that did not start holds no slot: a command run in a test process goes on
        raise
    _running = (key, process, url, log)
    logger.info(
        "the vLLM generation engine serves %s on %s (started in %.1f s)", policy, url, time.perf_counter() - start
    )
    return url


ENGINE_SETTINGS = (
    "vllm",
    "device",
    "dtype",
    "lora_mode",
    "eager",
    "tensor_parallel_size",
    "max_num_batched_tokens",
    "max_num_seqs",
)
"""What an engine's ``/health`` says it samples with, each a part of its identity: the vLLM version, device, dtype,
LoRA mode, whether it compiles, how many GPUs shard the model (a sum over shards is ordered otherwise) and the
scheduler's token and sequence budgets (they decide which requests share a batch, and so the kernels' shapes)."""


def engine_identity(url: str) -> dict[str, object]:
    """What the engine at ``url`` samples with, as the keys of the stages that sample on it name it: the code of the
    server the command runs (:func:`runtime.code.script_fingerprint` of :func:`server_script`: this project's
    ``engine_server/server.py``, or the script ``RLHF_ENGINE_SERVER`` names; an engine someone else runs is taken to
    be this project's server), and from its ``/health`` every one of :data:`ENGINE_SETTINGS`. Each of them can
    change the sampled tokens.

    Raises:
        EngineStartError: the engine does not answer.
    """
    from runtime.code import script_fingerprint
    from runtime.engine_client import EngineError, engine_health

    try:
        health = engine_health(url)
    except EngineError as error:
        raise EngineStartError(f"`sampling.engine` vllm: {error}") from None
    identity: dict[str, object] = {name: health.get(name) for name in ENGINE_SETTINGS}
    return {"server": script_fingerprint(server_script()), **identity}


def samples_on_engine(settings: StageSettings) -> bool:
    """Whether a stage with ``settings`` samples on the generation engine (a keyed ``sampling`` with engine vllm)."""
    from rlhf_core.config import SamplingConfig

    return any(
        isinstance(value, SamplingConfig) and value.engine == "vllm" for value in setting_values(settings).values()
    )
