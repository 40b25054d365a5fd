"""The real-model benchmark: SmolLM2-135M-Instruct learning ``configs/smollm2.yaml`` (answer in one word).

``.venv/bin/python -m bench.real_model curve``  (the learning curve; about 30-60 minutes on 2 shared cores)
``.venv/bin/python -m bench.real_model compare``  (ours against TRL's GRPOTrainer at equal work)
``.venv/bin/python -m bench.real_model tax``  (the curve's stages as a plain loop)
``.venv/bin/python -m bench.real_model report``  (section 9 of bench/RESULTS.md from what the parts wrote)

``curve`` runs ``rlhf run --config configs/smollm2.yaml`` (the real flow: Prefect, MLflow, Parquet; the model
converted from the package's GGUF file into the run root's cache first) on a fresh run root under
``bench/.scratch`` and reads back, per iteration, from its MLflow store: the held-out reward
of the initial policy (the reference, sampled with the same seeds) and of the iteration's policy, the KL to
the reference, each stage's seconds and the iteration's wall time. It prints the table and writes it as JSON
(``bench/.scratch/real-curve.json``), with the machine's load: the machine is shared, and the command's CPU
seconds are the steadier figure.

``compare`` runs, one after the other, our GRPO iteration as a plain loop (:mod:`bench.real_ours_worker`) and
TRL's ``GRPOTrainer`` (:mod:`bench.real_trl_worker`, the newest TRL in ``bench/.venv-trl-grpo``, made here when
missing) at equal work, full fine-tuning on both sides. It prints rollouts per second of a whole step (rollout
and update), wall and CPU, and writes ``bench/.scratch/real-compare.json``.

``tax`` runs the plain loop of the curve's stages at the config's sizes (LoRA, evaluation included): the
pipeline tax's plain side; its flow side is the curve's iterations.

``report`` writes section 9 of ``bench/RESULTS.md`` from the three JSON files (each part writes its own).
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

from bench.common import REPO, SCRATCH, machine, median, thread_env
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
    finished = f"tags.`{TAG_KIND}` = '{KIND_ITERATION}' and attributes.status = 'FINISHED'"
    runs = client.search_runs([experiment.experiment_id], filter_string=finished)
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
                "peak_memory_mb": {stage: metrics.get(f"{stage}/peak_memory_mb") for stage in STAGES},
                "wall_seconds": ((run.info.end_time or run.info.start_time) - run.info.start_time) / 1000,
            }
        )
    return rows


def curve(iterations: int | None, threads: int, out: Path) -> dict:
    run_root = SCRATCH / "real-curve"
    shutil.rmtree(run_root, ignore_errors=True)
    # the folder bench.smollm2 converted once: the config's pkg: GGUF file would be converted again in each fresh
    # run root (about a minute, which is not the learning curve's)
    overrides = [f"model.policy={ensure_folder()}", f"run_root={run_root}", f"execution.torch_threads={threads}"]
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


def read_back(run_root: Path, threads: int, out: Path) -> dict:
    """The curve of a run stopped before its last iteration, from its MLflow store (no command figures)."""
    result = {
        "machine": machine(),
        "load_average_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "load_average_start": "unknown",
        "threads": threads,
        "command_wall_seconds": None,
        "command_cpu_seconds": None,
        "iterations": iteration_rows(run_root, "smollm2-one-word"),
    }
    out.write_text(json.dumps(result, indent=2))
    print_curve(result)
    return result


def _command_line(result: dict) -> str:
    if result["command_wall_seconds"] is None:
        return f"the run was stopped after iteration {result['iterations'][-1]['iteration']} and read back"
    return f"whole command: {result['command_wall_seconds']:.0f} s wall, {result['command_cpu_seconds']:.0f} s CPU"


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
        f"{_command_line(result)}; load average {result['load_average_start']} at start, "
        f"{result['load_average_end']} at the end"
    )


TRL_GRPO_VENV = REPO / "bench" / ".venv-trl-grpo"


def ensure_trl_grpo_venv() -> Path:
    """``bench/.venv-trl-grpo``: the local CPU torch 2.13.0, then the newest trl pip finds (1.16.0 here)."""
    python = TRL_GRPO_VENV / "bin" / "python"
    if python.is_file() and subprocess.run([str(python), "-c", "import trl"], capture_output=True).returncode == 0:
        return python
    print("making bench/.venv-trl-grpo (torch 2.13.0 CPU, the newest trl; a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_GRPO_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0"], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "trl"], check=True)
    return python


def worker(python: Path, module: str, *args: str, threads: int) -> dict:
    """Run ``python -m module args --out FILE`` from the repo root; return the JSON it wrote."""
    out = SCRATCH / f"{module.rpartition('.')[2]}.json"
    print(f"  {module} {' '.join(args)}", flush=True)
    completed = subprocess.run(
        [str(python), "-m", module, *args, "--threads", str(threads), "--out", str(out)],
        cwd=REPO,
        env=task_env(threads),
        capture_output=True,
        text=True,
    )
    if completed.returncode != 0:
        raise SystemExit(f"{module} failed:\n{completed.stderr[-4000:]}")
    return json.loads(out.read_text())


def steady_rate(result: dict) -> dict:
    """Rollouts per second of a whole step (median wall and CPU over the iterations after the first)."""
    iterations = result["phases"]["iteration"][1:] or result["phases"]["iteration"]
    rollouts = result["rollouts_per_iteration"][-1]
    wall, cpu = median([pair[0] for pair in iterations]), median([pair[1] for pair in iterations])
    return {
        "rollouts": rollouts,
        "wall_s": wall,
        "cpu_s": cpu,
        "per_s_wall": rollouts / wall,
        "per_s_cpu": rollouts / cpu,
    }


def compare(prompts: int, iterations: int, threads: int, out: Path) -> dict:
    folder = str(ensure_folder())
    trl_python = ensure_trl_grpo_venv()
    project_python = REPO / ".venv" / "bin" / "python"
    facts, load = machine(), os.getloadavg()
    common = ("--model", folder, "--prompts", str(prompts), "--iterations", str(iterations))
    common += ("--max-new-tokens", "16", "--learning-rate", "2e-5")  # full fine-tuning's rate, on both sides
    runs = {
        "ours": worker(project_python, "bench.real_ours_worker", *common, threads=threads),
        "trl": worker(trl_python, "bench.real_trl_worker", *common, threads=threads),
    }
    result = {
        "machine": facts,
        "load_average_start": " ".join(f"{x:.2f}" for x in load),
        "load_average_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "threads": threads,
        "runs": runs,
        "rates": {side: steady_rate(run) for side, run in runs.items()},
    }
    out.write_text(json.dumps(result, indent=2))
    rates = result["rates"]
    for side, rate in rates.items():
        print(
            f"{side}: {rate['rollouts']} rollouts per step in {rate['wall_s']:.1f} s wall ({rate['cpu_s']:.1f} s CPU): "
            f"{rate['per_s_wall']:.2f} rollouts/s wall, {rate['per_s_cpu']:.2f} per CPU s"
        )
    print(
        f"ours / TRL: {rates['ours']['per_s_wall'] / rates['trl']['per_s_wall']:.2f}x wall, "
        f"{rates['ours']['per_s_cpu'] / rates['trl']['per_s_cpu']:.2f}x CPU"
    )
    return result


def tax(iterations: int, threads: int, out: Path) -> dict:
    """The plain loop of the curve's stages at the config's sizes (LoRA, evaluation included)."""
    from campaign.config import load_config

    config = load_config(CONFIG)
    folder, load = str(ensure_folder()), os.getloadavg()
    plain = worker(
        REPO / ".venv" / "bin" / "python", "bench.real_ours_worker", "--model", folder,
        "--prompts", str(config.sizes.rollout_prompts), "--iterations", str(iterations),
        "--evaluate", str(config.sizes.eval_prompts), "--lora", threads=threads,
    )  # fmt: skip
    result = {
        "load_average_start": " ".join(f"{x:.2f}" for x in load),
        "load_average_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "threads": threads,
        "plain_loop": plain,
    }
    out.write_text(json.dumps(result, indent=2))
    for phase, pairs in plain["phases"].items():
        print(f"{phase}: " + ", ".join(f"{wall:.1f} s ({cpu:.1f} CPU)" for wall, cpu in pairs))
    return result


RESULTS = REPO / "bench" / "RESULTS.md"
SECTION = "## 9. A real model: SmolLM2-135M-Instruct"


def _read(part: str) -> dict | None:
    path = SCRATCH / f"real-{part}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _pair(pair: list[float] | tuple[float, float]) -> str:
    return f"{pair[0]:.1f} ({pair[1]:.1f})"


def goal_line(rows: list[dict]) -> str:
    """Whether the held-out reward at least doubled and reached 0.6 at a KL <= 5 within 30 minutes of iterations."""
    initial, elapsed, reached = rows[0]["initial_reward"], 0.0, None
    for row in rows:
        elapsed += row["wall_seconds"]
        if reached is None and row["reward"] >= max(0.6, 2 * initial) and row["kl_to_reference"] <= 5:
            reached = (row, elapsed)
    best = max(rows, key=lambda row: row["reward"])
    if reached is not None:
        row, seconds = reached
        return (
            f"Goal (held-out reward at least doubled and >= 0.6, KL <= 5, within 30 minutes): reached at iteration "
            f"{row['iteration']}, {initial:.3f} -> {row['reward']:.3f} at a KL of {row['kl_to_reference']:.2f}, after "
            f"{seconds / 60:.0f} minutes of iterations ({'within' if seconds <= 1800 else 'beyond'} 30)."
        )
    return (
        f"Goal (held-out reward at least doubled and >= 0.6, KL <= 5, within 30 minutes): not reached in "
        f"{len(rows)} iterations ({elapsed / 60:.0f} minutes); best {initial:.3f} -> {best['reward']:.3f} at "
        f"iteration {best['iteration']} (KL {best['kl_to_reference']:.2f})."
    )


def section_lines() -> list[str]:
    """Section 9 of the results file: the learning curve, ours against TRL, the pipeline tax."""
    curve_result, compare_result, tax_result = _read("curve"), _read("compare"), _read("tax")
    lines = [SECTION, ""]
    if curve_result:
        rows = curve_result["iterations"]
        lines += [
            "Learning curve: `.venv/bin/python -m bench.real_model curve`, the real flow (`rlhf run --config "
            "configs/smollm2.yaml`). Held-out reward: the mean of `smollm2_task:one_word` over 32 held-out prompts "
            "(topics no training prompt has), one sample each at temperature 1; the initial policy is the "
            "reference, sampled with the same seeds. KL: nats per response (summed k1). Seconds: wall, per stage "
            "(its own `produce`) and per iteration (the iteration's MLflow run).",
            "",
            f"Machine: {curve_result['machine']['cpu']}, {curve_result['machine']['cores']} cores, shared with "
            f"five other engineers' work: load average {curve_result['load_average_start']} at the start, "
            f"{curve_result['load_average_end']} at the end; {curve_result['threads']} torch threads; commit "
            f"{curve_result['machine']['commit']}; {_command_line(curve_result)}.",
            "",
            "| iteration | held-out reward | KL to reference | " + " | ".join(STAGES) + " | iteration s |",
            "| --- " * (len(STAGES) + 4) + "|",
            f"| initial policy | {rows[0]['initial_reward']:.3f} | 0 |" + " |" * len(STAGES) + " |",
        ]
        for row in rows:
            seconds = " | ".join("" if row["seconds"][s] is None else f"{row['seconds'][s]:.0f}" for s in STAGES)
            lines.append(
                f"| {row['iteration']} | {row['reward']:.3f} | {row['kl_to_reference']:.2f} | {seconds} "
                f"| {row['wall_seconds']:.0f} |"
            )
        lines += ["", goal_line(rows), ""]
    if compare_result:
        ours, trl = compare_result["runs"]["ours"], compare_result["runs"]["trl"]
        rates = compare_result["rates"]
        rollouts = rates["ours"]["rollouts"]
        lines += [
            "Ours against TRL's `GRPOTrainer` at equal work: `.venv/bin/python -m bench.real_model compare`. One "
            f"step: {rollouts // 4} chat prompts x 4 samples of at most 16 tokens at temperature 1, scored by the "
            "same function, the reference's log-probs (KL weight 0.05), group advantages, then "
            f"{ours['optimizer_steps_per_iteration']} optimizer steps of {rollouts // 4} rollouts (one epoch); full "
            "fine-tuning, fp32, lr 2e-5, the same threads; one process after the other. Medians over the steps "
            "after the first; wall (CPU) seconds.",
            "",
            f"Load average {compare_result['load_average_start']} at the start, "
            f"{compare_result['load_average_end']} at the end; commit {compare_result['machine']['commit']}.",
            "",
            "| side | version | step s | rollout s | rollouts/s (wall) | rollouts per CPU s | peak RSS MiB |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for side, run in (("ours", ours), ("TRL GRPOTrainer", trl)):
            rate = rates["ours" if side == "ours" else "trl"]
            rollout = run["phases"]["rollout"][1:] or run["phases"]["rollout"]
            rollout_pair = (median([p[0] for p in rollout]), median([p[1] for p in rollout]))
            version = f"trl {run['trl']}" if "trl" in run else f"torch {run['torch']}"
            lines.append(
                f"| {side} | {version} | {_pair((rate['wall_s'], rate['cpu_s']))} | {_pair(rollout_pair)} "
                f"| {rate['per_s_wall']:.2f} | {rate['per_s_cpu']:.2f} | {run['peak_rss_mib']:.0f} |"
            )
        lines += [
            "",
            f"Ratio ours / TRL: {rates['ours']['per_s_wall'] / rates['trl']['per_s_wall']:.2f}x wall, "
            f"{rates['ours']['per_s_cpu'] / rates['trl']['per_s_cpu']:.2f}x CPU.",
            "",
        ]
    if tax_result and curve_result:
        plain = tax_result["plain_loop"]["phases"]
        steady = curve_result["iterations"][1:] or curve_result["iterations"]
        flow_wall = median([row["wall_seconds"] for row in steady])
        plain_wall = median([pair[0] for pair in plain["iteration"][1:] or plain["iteration"]])
        lines += [
            "Pipeline tax: the curve's iterations (the flow) against the same stages as a plain loop with the "
            "models in memory (`.venv/bin/python -m bench.real_model tax`: LoRA, the config's sizes, evaluation "
            f"included), medians after the first iteration, wall seconds; load average "
            f"{tax_result['load_average_start']} at the plain loop's start.",
            "",
            "| stage | flow (its `produce`) | plain loop wall (CPU) |",
            "| --- | --- | --- |",
        ]
        for stage in ("rollout", "compute_advantages", "ppo_update", "evaluate"):
            flow = median([row["seconds"][stage] for row in steady if row["seconds"][stage] is not None])
            pairs = plain[stage][1:] or plain[stage]
            lines.append(
                f"| {stage} | {flow:.1f} | {_pair((median([p[0] for p in pairs]), median([p[1] for p in pairs])))} |"
            )
        lines += [
            f"| iteration | {flow_wall:.1f} | {plain_wall:.1f} |",
            "",
            f"Tax (flow - plain) / flow: {(flow_wall - plain_wall) / flow_wall:.0%} of the iteration's wall time, "
            "both measured on the loaded shared machine: within its noise. The plain loop's CPU seconds per "
            f"iteration: {median([p[1] for p in plain['iteration'][1:] or plain['iteration']]):.1f}.",
            "",
        ]
    return lines


def report() -> None:
    """Replace (or add, before the notes) section 9 of ``bench/RESULTS.md``."""
    text = RESULTS.read_text().splitlines()
    start = next((i for i, line in enumerate(text) if line.startswith("## 9.")), None)
    if start is None:
        start = next(
            (i for i, line in enumerate(text) if line.startswith("## ") and not line[3:4].isdigit()), len(text)
        )
        end = start
    else:
        end = next((i for i in range(start + 1, len(text)) if text[i].startswith("## ")), len(text))
    lines = section_lines()
    RESULTS.write_text("\n".join([*text[:start], *lines, *text[end:]]) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["curve", "compare", "tax", "report"])
    parser.add_argument("--prompts", type=int, default=8, help="compare: prompts per step (x 4 samples)")
    parser.add_argument("--steps", type=int, default=3, help="compare, tax: iterations per run, the first a warm-up")
    parser.add_argument("--iterations", type=int, help="override the config's iterations")
    parser.add_argument("--read-back", type=Path, help="curve: read the run root of a stopped run instead of running")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="the JSON written (default bench/.scratch/real-PART.json)")
    args = parser.parse_args()
    out = args.out or SCRATCH / f"real-{args.part}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.part == "curve" and args.read_back:
        read_back(args.read_back, args.threads, out)
    elif args.part == "curve":
        curve(args.iterations, args.threads, out)
    elif args.part == "compare":
        compare(args.prompts, args.steps, args.threads, out)
    elif args.part == "tax":
        tax(args.steps, args.threads, out)
    else:
        report()


if __name__ == "__main__":
    sys.exit(main())
