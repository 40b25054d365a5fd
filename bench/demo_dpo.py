"""Iterative DPO beside PPO on the demo world at equal wall time: bench/RESULTS.md's table (issue 45).

``.venv/bin/python -m bench.demo_dpo`` (about 5 minutes on 2 cores) runs ``configs/demo.yaml`` (reward model + PPO,
8 iterations) and then ``configs/demo-dpo.yaml`` for as many iterations as fit the PPO campaign's wall time (the
iteration that reaches it included), each in its own subprocess with one torch thread
(:func:`bench.estimators.worker`: the real iteration flow in a temporary run root). Prints, after each iteration of
each, the wall time so far, the gold win rate against the initial policy and the KL to the reference (the evaluation
on the 64 held-out prompts). ``--set KEY=VALUE`` changes the DPO campaign only (e.g. ``dpo.learning_rate``);
``--dpo-only N`` runs N DPO iterations and no PPO, to try settings.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from bench.common import REPO, SCRATCH, machine
from bench.estimators import worker

COMMAND = ".venv/bin/python -m bench.demo_dpo"
PPO, DPO = REPO / "configs" / "demo.yaml", REPO / "configs" / "demo-dpo.yaml"
MAX_DPO_ITERATIONS = 64
"""The most DPO iterations the equal wall time may hold."""


def curve(result: dict) -> list[tuple[float, float, float]]:
    """``(wall seconds so far, gold win rate, KL to the reference)`` after each iteration of a campaign."""
    elapsed = itertools.accumulate(result["iteration_seconds"])
    return [
        (seconds, metrics["evaluate/gold_win_rate"], metrics["evaluate/kl_to_reference"])
        for seconds, metrics in zip(elapsed, result["metrics"], strict=True)
    ]


def table(curves: dict[str, list[tuple[float, float, float]]]) -> str:
    """One row per iteration: each campaign's wall time so far, gold win rate and KL (blank past its last)."""
    names = list(curves)
    lines = [
        "| iteration | " + " | ".join(f"{name}: s so far | gold win rate | KL to ref" for name in names) + " |",
        "| ---: | " + " | ".join("---: | ---: | ---:" for _ in names) + " |",
    ]
    for iteration in range(max(len(points) for points in curves.values())):
        cells = []
        for name in names:
            points = curves[name]
            if iteration < len(points):
                seconds, win_rate, kl = points[iteration]
                cells.append(f"{seconds:.0f} | {win_rate:.3f} | {kl:.2f}")
            else:
                cells.append(" | | ")
        lines.append(f"| {iteration} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--dpo-only", type=int, metavar="N", help="N DPO iterations, no PPO: to try settings")
    args = parser.parse_args()
    from demo.build import build_default_world

    SCRATCH.mkdir(parents=True, exist_ok=True)
    world = build_default_world(SCRATCH / "demo-world", seed=0, progress=False).model_dir.parent
    curves = {}
    if args.dpo_only is None:
        ppo = worker(world, PPO, [])
        curves["PPO (`configs/demo.yaml`)"] = curve(ppo)
        budget, iterations = sum(ppo["iteration_seconds"]), MAX_DPO_ITERATIONS
        print(f"PPO: {json.dumps(curves)}", flush=True)
    else:
        budget, iterations = None, args.dpo_only
    dpo = worker(world, DPO, [f"iterations={iterations}", *args.extra], seconds=budget)
    curves["DPO (`configs/demo-dpo.yaml`)"] = curve(dpo)
    facts = machine()
    print(f"`{COMMAND}` " + " ".join(f"--set {item}" for item in args.extra))
    print("Machine: " + "; ".join(f"{key}: {value}" for key, value in facts.items()) + ".\n")
    print(table(curves))


if __name__ == "__main__":
    sys.exit(main())
