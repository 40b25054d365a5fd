"""The real-model benchmark: SmolLM2-135M-Instruct learning ``configs/smollm2.yaml`` (answer in one word).

``.venv/bin/python -m bench.real_model curve``  (the learning curve; about 30-60 minutes on 2 shared cores)

``curve`` runs ``rlhf run --config configs/smollm2.yaml`` (the real flow: Prefect, MLflow, Parquet) on a fresh
run root under ``bench/.scratch`` and reads back, per iteration, from its MLflow store: the held-out reward
of the initial policy (the reference, sampled with the same seeds) and of the iteration's policy, the KL to
the reference, each stage's seconds and the iteration's wall time. It prints the table and writes it as JSON
(``bench/.scratch/real-curve.json``), with the machine's load: the machine is shared, and the command's CPU
seconds are the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, SCRATCH, machine, thread_env
from bench.smollm2 import ensure_folder

CONFIG = REPO / "configs" / "smollm2.yaml"
STAGES = ("initialize", "rollout", "compute_advantages", "ppo_update", "evaluate")


def task_env(threads: int) -> dict[str, str]:
    """A quiet worker environment in which ``smollm2_task`` (the module beside the config) imports."""
    env = thread_env(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO / "configs"), str(REPO), env.get("PYTHONPATH"))))
    return env


def iteration_rows(run_root: Path, campaign: str) -> list[dict]:
    """Per finished iteration: held-out rewards, KL, stage seconds and wall seconds, from the MLflow store."""
    from mlflow import MlflowClient

    from storage.tracking import KIND_ITERATION, TAG_ITERATION, TAG_KIND

    client = MlflowClient(f"sqlite:///{run_root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(campaign)
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{TAG_KIND}` = '{KIND_ITERATION}'")
    rows = []
    for run in sorted(runs, key=lambda run: int(run.data.tags[TAG_ITERATION])):
        metrics = run.data.metrics
        rows.append(
            {
                "iteration": int(run.data.tags[TAG_ITERATION]),
                "initial_reward": metrics.get("evaluate/reference_reward_mean"),
                "reward": metrics.get("evaluate/reward_mean"),
                "kl_to_reference": metrics.get("evaluate/kl_to_reference"),
                "seconds": {stage: metrics.get(f"{stage}/seconds") for stage in STAGES},
                "wall_seconds": ((run.info.end_time or run.info.start_time) - run.info.start_time) / 1000,
            }
        )
    return rows


def curve(iterations: int | None, threads: int, out: Path) -> dict:
    folder = ensure_folder()
    run_root = SCRATCH / "real-curve"
    shutil.rmtree(run_root, ignore_errors=True)
    overrides = [f"model.policy={folder}", f"run_root={run_root}", f"torch_threads={threads}"]
    if iterations is not None:
        overrides.append(f"iterations={iterations}")
    command = [str(REPO / ".venv" / "bin" / "rlhf"), "run", "--config", str(CONFIG)]
    command += [part for override in overrides for part in ("--set", override)]
    facts = machine()
    print(" ".join(command), flush=True)
    started, load = time.perf_counter(), os.getloadavg()
    completed = subprocess.run(command, cwd=REPO, env=task_env(threads))
    wall = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode != 0:
        raise SystemExit(f"rlhf run failed (exit {completed.returncode})")
    result = {
        "machine": facts,
        "load_average_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "load_average_start": " ".join(f"{x:.2f}" for x in load),
        "threads": threads,
        "command_wall_seconds": wall,
        "command_cpu_seconds": usage.ru_utime + usage.ru_stime,
        "iterations": iteration_rows(run_root, "smollm2-one-word"),
    }
    out.write_text(json.dumps(result, indent=2))
    print_curve(result)
    return result


def print_curve(result: dict) -> None:
    print("| iteration | held-out reward | KL to reference | " + " | ".join(STAGES) + " | iteration s |")
    print("| --- " * (len(STAGES) + 4) + "|")
    first = result["iterations"][0]
    print(f"| initial | {first['initial_reward']:.3f} | 0 |" + " |" * len(STAGES) + " |")
    for row in result["iterations"]:
        seconds = " | ".join("" if row["seconds"][s] is None else f"{row['seconds'][s]:.0f}" for s in STAGES)
        print(
            f"| {row['iteration']} | {row['reward']:.3f} | {row['kl_to_reference']:.2f} | {seconds} "
            f"| {row['wall_seconds']:.0f} |"
        )
    print(
        f"whole command: {result['command_wall_seconds']:.0f} s wall, {result['command_cpu_seconds']:.0f} s CPU; "
        f"load average {result['load_average_start']} at start, {result['load_average_end']} at the end"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["curve"])
    parser.add_argument("--iterations", type=int, help="override the config's iterations")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=SCRATCH / "real-curve.json")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.part == "curve":
        curve(args.iterations, args.threads, args.out)


if __name__ == "__main__":
    sys.exit(main())
