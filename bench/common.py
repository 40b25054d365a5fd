"""What every benchmark script shares: the two model sizes, per-iteration timing, medians, machine facts.

Stdlib only at import time, so the TRL worker (another venv, without this project installed) can
import it too.

Choices:
1. Wall time and process CPU time are taken for every iteration; on this shared 2-core machine
   CPU time is the figure that holds up when another process takes a core.
2. The first iteration of every run is a warm-up (allocator, kernel selection) and is left out.
3. Medians, never means: a single iteration preempted by a neighbour should not move a figure.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / "bench"
TRL_VENV = BENCH_DIR / ".venv-trl"
SCRATCH = BENCH_DIR / ".scratch"
PROJECT_PYTHON = REPO / ".venv" / "bin" / "python"


@dataclass(frozen=True)
class Size:
    """One benchmark size: model shape and per-iteration work (identical on both sides)."""

    name: str
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    rollout_batch: int
    """B: sequences generated and trained on per iteration."""
    response_length: int
    """R: tokens generated per sequence."""
    ppo_epochs: int = 4
    """Optimizer steps per iteration (one minibatch of B per epoch)."""
    iterations: int = 6
    """Iterations per run, the first a warm-up."""
    n_positions: int = 256
    temperature: float = 0.7
    kl_coef: float = 0.05
    learning_rate: float = 1e-5
    seed: int = 0


SIZES = {
    # The sizes of ../shared/research/peer-bench-trl.md (S and M), so its TRL figures can be cross-checked.
    "S": Size("S", n_layer=2, n_embd=128, n_head=4, vocab_size=2048, rollout_batch=16, response_length=32),
    "M": Size(
        "M", n_layer=4, n_embd=256, n_head=4, vocab_size=4096, rollout_batch=64, response_length=64, iterations=4
    ),
}


def size_from_json(path: Path) -> Size:
    return Size(**json.loads(Path(path).read_text()))


def size_to_json(size: Size, path: Path) -> None:
    Path(path).write_text(json.dumps(asdict(size), indent=2))


@dataclass
class Clock:
    """Wall and CPU seconds of named phases, one list entry per iteration."""

    phases: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    @contextmanager
    def measure(self, name: str) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - wall, time.process_time() - cpu)

    def add(self, name: str, wall: float, cpu: float) -> None:
        self.phases.setdefault(name, []).append((wall, cpu))

    def to_json(self) -> dict[str, list[list[float]]]:
        return {name: [list(pair) for pair in pairs] for name, pairs in self.phases.items()}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def steady(pairs: list[list[float]], warmup: int = 1) -> tuple[float, float]:
    """Median wall and CPU seconds over the iterations after ``warmup``."""
    kept = pairs[warmup:] or pairs
    return median([p[0] for p in kept]), median([p[1] for p in kept])


def set_threads(threads: int) -> None:
    """Pin torch (and the BLAS/OpenMP pools it may start) to ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(threads)


def thread_env(threads: int) -> dict[str, str]:
    """Environment for a worker subprocess with a fixed thread count and quiet libraries."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        TQDM_DISABLE="1",
        PYTHONWARNINGS="ignore",
    )
    return env


def machine() -> dict[str, str]:
    """CPU model, core count, memory, load and library versions, for the results table."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        extras = [name for name in ("avx512f", "amx_bf16", "avx2") if f" {name}" in flags]
        cpu += f" ({', '.join(extras)})" if extras else ""
    except (OSError, StopIteration):
        pass
    memory = "unknown"
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        memory = f"{kib / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = "unknown"
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory": memory,
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "commit": commit,
    }
