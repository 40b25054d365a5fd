"""Advantage estimators and reward sources on the demo world at equal budget: bench/ESTIMATORS.md's table.

``.venv/bin/python -m bench.estimators`` (about 20 minutes on 2 cores) writes ``bench/ESTIMATORS.md``
(raw figures in ``bench/.scratch/estimators.json``). Options: ``--estimators gae,rloo``,
``--rewards reward_model,function``, ``--set KEY=VALUE`` (applied to every compared run),
``--no-demo``, ``--parallel N`` (for exploring settings only: parallel runs share the cores, so
their seconds are not comparable).

Every run is the real iteration flow (Prefect, MLflow on SQLite, Parquet shards, checkpoints) on
the embedded demo world, in a temporary run root holding a copy of it, in its own subprocess with
one torch thread, one run at a time. The comparison starts from ``configs/demo.yaml`` (the RLHF
demo: 8 iterations, PPO 4 epochs of minibatch 32, KL penalty 0.05 in the reward) and rolls out 64 prompts x 4 samples per iteration (:data:`BUDGET`, the
defaults' 256 rollouts, in groups). At equal budget: every run rolls out the same prompts,
generates at most the same tokens and takes the same optimizer steps; only the advantage
estimator (with its own loss aggregation, :data:`ESTIMATORS`) and the reward source change. With
the learned reward model, stages 1-3 (candidates, gold labels, reward-model training) run; with
the gold function (``demo.gold:gold_score``, the rubric evaluation judges by, as a verifiable
reward) they are skipped. A last row runs ``configs/demo-verifiable.yaml`` as it is. Reported: the last
iteration's gold win rate against the initial policy, gold score and KL to the reference
(evaluation on the 64 held-out prompts), and wall seconds per iteration.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import PROJECT_PYTHON, REPO, SCRATCH, machine, median, set_threads, thread_env

COMMAND = ".venv/bin/python -m bench.estimators"
RESULTS = REPO / "bench" / "ESTIMATORS.md"
RAW = SCRATCH / "estimators.json"
DEMO = REPO / "configs" / "demo-verifiable.yaml"
RLHF_DEMO = REPO / "configs" / "demo.yaml"
"""Where every compared run starts from: the RLHF demo."""

BUDGET = ["sizes.rollout_prompts=64", "sizes.samples_per_prompt=4"]
"""Every compared run: 64 prompts x 4 samples = 256 rollouts per iteration (the defaults' count), in groups of 4."""
ESTIMATORS: dict[str, list[str]] = {
    "gae": ["advantages.estimator=gae"],
    "grpo": ["advantages.estimator=grpo"],
    "dr_grpo": ["advantages.estimator=dr_grpo", "ppo.aggregation=token_sum_norm"],
    "rloo": ["advantages.estimator=rloo"],
    "reinforce_pp": ["advantages.estimator=reinforce_pp"],
}
"""Each estimator with its own conventions; the defaults' KL penalty shapes the reward for all."""
REWARDS: dict[str, list[str]] = {
    "reward_model": [],
    "function": ["reward.source=function", "reward.function=demo.gold:gold_score"],
}
REWARD_NAMES = {
    "reward_model": "learned reward model",
    "function": "gold function (verifiable)",
    "demo": "`configs/demo-verifiable.yaml`",
}


def run_campaign(world: Path, config_file: Path | None, overrides: list[str], seconds: float | None = None) -> dict:
    """A campaign (``config_file``, or the RLHF demo's, with ``overrides``) in a temporary run root:
    per-iteration wall seconds and metrics. With ``seconds``, it stops after the iteration that reaches that much
    wall time (of its iterations), or after ``iterations``, whichever comes first."""
    started = time.perf_counter()
    from campaign.config import load_config
    from flows import rlhf_pipeline
    from flows.iterations import tracking_store

    imported = time.perf_counter() - started
    root = Path(tempfile.mkdtemp(prefix="rlhf-estimators-", dir=SCRATCH))
    try:
        shutil.copytree(world, root / "cache" / "demo-world")
        config = load_config(config_file or RLHF_DEMO, [*overrides, f"run_root={root}", "execution.torch_threads=1"])
        state, seconds, budget = None, [], seconds
        for iteration in range(config.iterations):
            begin = time.perf_counter()
            state = rlhf_pipeline.rlhf_iteration(config, iteration, state)
            seconds.append(time.perf_counter() - begin)
            if budget is not None and sum(seconds) >= budget:
                break
        tracker = tracking_store(config).tracker()
        metrics = [values for _, values in tracker.iteration_metrics(tracker.experiment_id(config.campaign))]
        return {"overrides": overrides, "import_seconds": imported, "iteration_seconds": seconds, "metrics": metrics}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def worker(world: Path, config_file: Path | None, overrides: list[str], seconds: float | None = None) -> dict:
    """Run :func:`run_campaign` in a fresh subprocess (its own Prefect home and ephemeral server)."""
    with tempfile.TemporaryDirectory(dir=SCRATCH) as folder:
        out = Path(folder) / "result.json"
        env = {
            **thread_env(1),
            "PREFECT_HOME": str(Path(folder) / "prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        }
        command = [str(PROJECT_PYTHON), "-m", "bench.estimators", "--worker", str(world), "--out", str(out)]
        command += ["--config", str(config_file)] if config_file is not None else []
        command += ["--seconds", str(seconds)] if seconds is not None else []
        completed = subprocess.run(
            [*command, *(f"--set={item}" for item in overrides)], cwd=REPO, env=env, capture_output=True, text=True
        )
        if completed.returncode != 0:
            raise RuntimeError(f"run {overrides} failed:\n{completed.stderr[-4000:]}")
        return json.loads(out.read_text())


def row(reward: str, estimator: str, result: dict) -> dict:
    last = result["metrics"][-1]
    seconds = result["iteration_seconds"]
    return {
        "reward": reward,
        "estimator": estimator,
        "gold_win_rate": last["evaluate/gold_win_rate"],
        "gold_win_rate_last3": sum(m["evaluate/gold_win_rate"] for m in result["metrics"][-3:]) / 3,
        "gold": last["evaluate/gold_mean"],
        "kl": last["evaluate/kl_to_reference"],
        "seconds_per_iteration": median(seconds[1:] or seconds),
        "total_seconds": sum(seconds),
        "win_rates": [m["evaluate/gold_win_rate"] for m in result["metrics"]],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| reward | estimator | gold win rate | (mean of the last 3) | gold score | KL to ref | s / iteration "
        "| all iterations, s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {REWARD_NAMES[r['reward']]} | `{r['estimator']}` | {r['gold_win_rate']:.3f} | "
            f"{r['gold_win_rate_last3']:.3f} | {r['gold']:.3f} | {r['kl']:.2f} | {r['seconds_per_iteration']:.1f} | "
            f"{r['total_seconds']:.0f} |"
        )
    return "\n".join(lines)


def report(rows: list[dict], extra: list[str], parallel: int) -> str:
    facts = machine()
    header = [
        "# Advantage estimators and reward sources on the demo world",
        "",
        f"Regenerate: `{COMMAND}` (writes this file; raw figures in `bench/.scratch/estimators.json`).",
        "",
        "Every compared run: `configs/demo.yaml` (the RLHF demo), "
        + ", ".join(f"`{item}`" for item in BUDGET + extra)
        + "; the estimator's own settings: "
        + "; ".join(f"`{name}`: " + ", ".join(f"`{item}`" for item in items) for name, items in ESTIMATORS.items())
        + ". Gold win rate, gold score and KL to the reference are the last iteration's evaluation on 64 held-out "
        "prompts (one sample of each side per prompt, so a win rate moves by about 0.05 from one iteration to the "
        "next by chance alone; the mean over the last three iterations is steadier); s / iteration is the median "
        "wall time of iterations 1-7 (iteration 0 also starts Prefect's server); the last column is the whole "
        "campaign. The last row is `configs/demo-verifiable.yaml` as it is.",
        "",
        "Machine: " + "; ".join(f"{key}: {value}" for key, value in facts.items()) + ".",
    ]
    if parallel > 1:
        header.append(f"\n**{parallel} runs at a time: the seconds are not comparable with one-at-a-time runs.**")
    return "\n".join([*header, "", table(rows), ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--estimators", default=",".join(ESTIMATORS))
    parser.add_argument("--rewards", default=",".join(REWARDS))
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--no-demo", dest="demo", action="store_false", help="leave out the configs/demo-verifiable.yaml row"
    )
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        set_threads(1)
        args.out.write_text(json.dumps(run_campaign(args.worker, args.config, args.extra, args.seconds)))
        return

    from campaign.config import load_config
    from demo.build import build_default_world

    SCRATCH.mkdir(parents=True, exist_ok=True)
    world = build_default_world(SCRATCH / "demo-world", seed=0, progress=False).model_dir.parent
    runs = [
        (reward, estimator, None, [*BUDGET, *REWARDS[reward], *ESTIMATORS[estimator], *args.extra])
        for reward in args.rewards.split(",")
        for estimator in args.estimators.split(",")
    ]
    if args.demo:
        runs.append(("demo", load_config(DEMO).advantages.estimator, DEMO, []))

    def measure(run: tuple[str, str, Path | None, list[str]]) -> dict:
        reward, estimator, config_file, overrides = run
        result = row(reward, estimator, worker(world, config_file, overrides))
        print(f"{reward:>12} {estimator:>12}: {json.dumps(result)}", flush=True)
        return result

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        rows = list(pool.map(measure, runs))
    RAW.write_text(json.dumps(rows, indent=2))
    text = report(rows, args.extra, args.parallel)
    args.results.write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
