"""Labels that teach the most: the reward model's held-out accuracy per label, pairs asked about by margin against
pairs drawn at random (issue 43; bench/RESULTS.md's table).

``.venv/bin/python -m bench.asking`` (about 10 minutes on 2 cores) runs ``configs/demo.yaml`` with the gold labeler
standing in for a person (one label per pair it is asked about) twice, each in its own subprocess with one torch
thread: ``asking.select`` random and uncertain, the same ``asking.pairs`` budget an iteration (:data:`SIZES`), every
pair of a prompt's 4 candidates in the pool (``pairing: all_decisive``: an asked pair that ties is a label paid for
and dropped, as a person's tie/skip). Iteration 0 is the same in both (no reward model yet: both draw at random, by
the same seed).

The accuracy is measured on the same pairs for both: the union of both runs' held-out pairs (each iteration's
held-out share is drawn at random before any margin is looked at, :func:`tasks.pairing.asked_pairs`; neither run
trains on the other's candidates), those with a winner; every iteration's reward model of each run is scored on all
of them. ``--iterations N``, ``--pairs N`` and ``--set KEY=VALUE`` (both runs) change the sizes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import PROJECT_PYTHON, REPO, SCRATCH, machine, thread_env

COMMAND = ".venv/bin/python -m bench.asking"
DEMO = REPO / "configs" / "demo.yaml"
SIZES = [
    "pairing=all_decisive",
    "sizes.preference_prompts=64",  # 64 prompts x 6 pairs of their 4 candidates: 384 pairs to choose from
    "reward_model.eval_fraction=0.25",
]
SELECTIONS = ("random", "uncertain")


def run_campaign(world: Path, root: Path, overrides: list[str]) -> dict:
    """The demo campaign with ``overrides`` in ``root`` (kept: the caller scores its reward models): after each
    iteration, its seconds, its reward model's folder and the preference outputs it added."""
    from campaign.config import load_config
    from flows import rlhf_pipeline

    shutil.copytree(world, root / "cache" / "demo-world")
    config = load_config(DEMO, [*overrides, f"run_root={root}", "execution.torch_threads=1"])
    state, iterations, seen = None, [], 0
    for iteration in range(config.iterations):
        begin = time.perf_counter()
        state = rlhf_pipeline.rlhf_iteration(config, iteration, state)
        new = state.preferences[seen:]
        seen = len(state.preferences)
        iterations.append(
            {
                "seconds": time.perf_counter() - begin,
                "reward_model": state.reward_model.path,
                "eval_accuracy": state.reward_model.metrics["eval_accuracy"],
                "preferences": [{"path": result.path, "metrics": result.metrics} for result in new],
            }
        )
    return {"overrides": overrides, "iterations": iterations}


def worker(world: Path, root: Path, overrides: list[str]) -> dict:
    """:func:`run_campaign` in a fresh subprocess (its own Prefect home and ephemeral server)."""
    out = root / "result.json"
    env = {
        **thread_env(1),
        "PREFECT_HOME": str(root / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    }
    command = [str(PROJECT_PYTHON), "-m", "bench.asking", "--worker", str(world), "--root", str(root)]
    completed = subprocess.run(
        [*command, *(f"--set={item}" for item in overrides)], cwd=REPO, env=env, capture_output=True, text=True
    )
    if completed.returncode != 0:
        raise RuntimeError(f"run {overrides} failed:\n{completed.stderr[-4000:]}")
    return json.loads(out.read_text())


def held_out_rows(result: dict):
    """Each iteration's held-out pairs of a run (the first ``held_out_head`` rows of its preference outputs) with a
    winner, as one table."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from storage.shards import read_table
    from tasks.pairing import HELD_OUT_HEAD

    tables = [
        read_table(Path(output["path"]), "preferences").slice(0, round(output["metrics"][HELD_OUT_HEAD]))
        for iteration in result["iterations"]
        for output in iteration["preferences"]
    ]
    table = pa.concat_tables(tables)
    return table.filter(pc.greater(table.column("margin"), 0.0))


def accuracy(reward_model: Path, table) -> float:
    """The reward model's accuracy on the pairs of ``table`` (chosen scored above rejected)."""
    from rlhf_core.loading import ModelLoader
    from rlhf_core.reward_training import evaluate_reward_model
    from tasks.text import load_tokenizer
    from tasks.train_reward_model import preference_batch

    model = ModelLoader(device="cpu", precision="fp32").load("reward_model", reward_model / "reward_model")
    batch = preference_batch(table, load_tokenizer(str(reward_model / "reward_model")))
    return evaluate_reward_model(model, batch, batch_size=64).accuracy


def accuracies(results: dict[str, dict], pairs) -> dict[str, list[float]]:
    """Each run's reward model after each iteration, scored on the common held-out ``pairs``."""
    return {
        name: [accuracy(Path(iteration["reward_model"]), pairs) for iteration in result["iterations"]]
        for name, result in results.items()
    }


def decisive_labels(result: dict) -> list[float]:
    """The labels with a winner a run kept so far, after each iteration (an asked pair that tied is paid, not kept)."""
    kept = [sum(output["metrics"]["decisive_pairs"] for output in it["preferences"]) for it in result["iterations"]]
    return [sum(kept[: index + 1]) for index in range(len(kept))]


def table(seeds: list[dict], budget: int) -> str:
    """One row per iteration: labels paid so far, and for each run the mean over ``seeds`` of its accuracy on that
    seed's common held-out pairs (with the seeds' lowest and highest) and of the labels it kept."""
    names = list(seeds[0]["accuracy"])
    lines = [
        "| iteration | labels paid so far | "
        + " | ".join(f"{name}: accuracy (min-max) | labels kept" for name in names)
        + " |",
        "| ---: | ---: | " + " | ".join("---: | ---:" for _ in names) + " |",
    ]
    for index in range(len(seeds[0]["accuracy"][names[0]])):
        cells = []
        for name in names:
            values = [seed["accuracy"][name][index] for seed in seeds]
            kept = sum(seed["kept"][name][index] for seed in seeds) / len(seeds)
            mean = sum(values) / len(values)
            cells.append(f"{mean:.3f} ({min(values):.3f}-{max(values):.3f}) | {kept:.0f}")
        lines.append(f"| {index} | {budget * (index + 1)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=96, help="asking.pairs: labels paid per iteration")
    parser.add_argument("--seeds", type=int, default=3, help="campaigns of each selection, seeds 0, 1, ...")
    args = parser.parse_args()
    if args.worker is not None:
        (args.root / "result.json").write_text(json.dumps(run_campaign(args.worker, args.root, args.extra)))
        return
    from demo.build import build_default_world

    SCRATCH.mkdir(parents=True, exist_ok=True)
    world = build_default_world(SCRATCH / "demo-world", seed=0, progress=False).model_dir.parent
    sizes = [*SIZES, f"iterations={args.iterations}", f"asking.pairs={args.pairs}", *args.extra]
    import pyarrow as pa

    seeds = []
    for seed in range(args.seeds):
        with tempfile.TemporaryDirectory(dir=SCRATCH) as folder:
            results = {}
            for select in SELECTIONS:
                root = Path(folder) / select
                root.mkdir()
                results[f"`{select}`"] = worker(world, root, [*sizes, f"seed={seed}", f"asking.select={select}"])
            pairs = pa.concat_tables([held_out_rows(result) for result in results.values()])
            seeds.append(
                {
                    "held_out": pairs.num_rows,
                    "accuracy": accuracies(results, pairs),
                    "kept": {name: decisive_labels(result) for name, result in results.items()},
                    "seconds": {
                        name: [it["seconds"] for it in result["iterations"]] for name, result in results.items()
                    },
                }
            )
            print(f"seed {seed}: {json.dumps(seeds[-1])}", flush=True)
    facts = machine()
    options = f"--iterations {args.iterations} --pairs {args.pairs} --seeds {args.seeds}"
    print(f"`{COMMAND} {options}` " + " ".join(f"--set {item}" for item in args.extra))
    print("Machine: " + "; ".join(f"{key}: {value}" for key, value in facts.items()) + ".")
    print(f"Common held-out pairs with a winner, per seed: {[seed['held_out'] for seed in seeds]}.\n")
    print(table(seeds, args.pairs))


if __name__ == "__main__":
    sys.exit(main())
