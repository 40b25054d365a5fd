"""Where an iteration of ours spends its time: torch operator and Python profiles of one warm iteration.

``.venv/bin/python -m bench.profile_iteration --size M [--phase generation|rollout|update]``

Prints the top operators by self CPU time (``torch.profiler``) and the top Python functions by
cumulative time (``cProfile``). Not part of ``bench.run``; used to find what limits a figure.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from pathlib import Path

import torch

import rlhf_core.experience_maker as experience_maker
from bench.common import SCRATCH, SIZES, Size, set_threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="M")
    parser.add_argument("--phase", choices=["generation", "rollout", "update"], default="update")
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    set_threads(1)
    from bench import ours_worker
    from bench.artifacts import build_artifacts

    base = SIZES[args.size]
    artifacts = build_artifacts(base, SCRATCH / f"artifacts-{base.name}")
    size = Size(**{**base.__dict__, "iterations": 1})
    ours_worker.run(artifacts, size=size)  # warm-up

    targets = {
        "generation": (experience_maker, "generate"),
        "rollout": (experience_maker.ExperienceMaker, "make_experience"),
        "update": (ours_worker, "ppo_update"),
    }
    owner, name = targets[args.phase]
    original = getattr(owner, name)

    def profiled(*a, **k):
        profiler = cProfile.Profile()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as ops:
            profiler.enable()
            result = original(*a, **k)
            profiler.disable()
        print(ops.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.rows))
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.rows)
        return result

    setattr(owner, name, profiled)
    try:
        ours_worker.run(Path(artifacts), size=size)
    finally:
        setattr(owner, name, original)


if __name__ == "__main__":
    main()
