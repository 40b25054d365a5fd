"""Regenerate every benchmark figure and write ``bench/RESULTS.md``.

``.venv/bin/python -m bench.run --all`` (about 15 minutes on 2 cores; ``--repeats``, ``--only``)

Every measurement runs in its own subprocess, one at a time, with one torch thread:
1. ours vs TRL ``PPOTrainer`` (trl 1.12.0 in ``bench/.venv-trl``, made here when missing) on the
   same artifacts, sizes S and M, alternating sides ``--repeats`` times;
2. generation tokens/s against the measured fp32 matmul peak (roofline);
3. pipeline tax: the real flow against the same calls in a plain loop;
4. scaling of our iteration as prompts and response length double;
5. replay against the full iteration it replays;
6. model scale: an 85 M-parameter model through two iterations, full fine-tuning against LoRA,
   fp32 against bf16: seconds and peak memory per stage, bytes on disk against the model's bytes;
7. the no-op run: ``rlhf run`` of the finished demo campaign again (:mod:`bench.noop`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import (
    PROJECT_PYTHON,
    REPO,
    SCRATCH,
    SIZES,
    TRL_VENV,
    machine,
    median,
    steady,
    thread_env,
)

RESULTS = REPO / "bench" / "RESULTS.md"
COMMAND = ".venv/bin/python -m bench.run --all"
PARTS = ("trl", "roofline", "tax", "scaling", "scale", "noop")
SCALE_VARIANTS = ("full-fp32", "full-bf16", "lora-fp32", "lora-bf16")


def ensure_trl_venv() -> Path:
    """``bench/.venv-trl`` with the local CPU torch 2.13.0 first, then trl 1.12.0 (the last with PPO)."""
    python = TRL_VENV / "bin" / "python"
    check = [str(python), "-c", "import trl, torch; assert trl.__version__ == '1.12.0'"]
    if python.is_file() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print("making bench/.venv-trl (torch 2.13.0 CPU, trl 1.12.0; about 2 minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "trl==1.12.0"], check=True)
    return python


def worker(python: Path | str, module: str, *args: str, env: dict | None = None) -> dict:
    """Run ``python -m module args --out FILE`` from the repo root; return the JSON it wrote."""
    with tempfile.TemporaryDirectory(dir=SCRATCH) as folder:
        out = Path(folder) / "result.json"
        completed = subprocess.run(
            [str(python), "-m", module, *args, "--out", str(out)],
            cwd=REPO,
            env=env or thread_env(1),
            capture_output=True,
            text=True,
        )
        if completed.returncode != 0:
            raise RuntimeError(f"{module} {' '.join(args)} failed:\n{completed.stderr[-4000:]}")
        return json.loads(out.read_text())


def pooled(runs: list[dict], phase: str) -> tuple[float, float]:
    """Median wall and CPU seconds of ``phase`` over the steady iterations of all ``runs``."""
    pairs = [pair for run in runs for pair in run["phases"][phase][1:]]
    return median([p[0] for p in pairs]), median([p[1] for p in pairs])


def compare_trl(repeats: int) -> dict:
    from bench.artifacts import build_artifacts

    trl_python = ensure_trl_venv()
    table = {}
    for size in SIZES.values():
        artifacts = build_artifacts(size, SCRATCH / f"artifacts-{size.name}")
        runs: dict[str, list[dict]] = {"ours": [], "trl": []}
        for repeat in range(repeats):
            for side in ("ours", "trl") if repeat % 2 == 0 else ("trl", "ours"):
                print(f"  {size.name}: {side} run {repeat + 1}/{repeats}", flush=True)
                python, module = (
                    (PROJECT_PYTHON, "bench.ours_worker") if side == "ours" else (trl_python, "bench.trl_worker")
                )
                runs[side].append(worker(python, module, "--artifacts", str(artifacts)))
        table[size.name] = {
            "size": size.__dict__,
            **{
                side: {phase: pooled(results, phase) for phase in ("iteration", "generation", "rollout", "update")}
                | {
                    "positions": results[0]["positions_per_iteration"][-1],
                    "optimizer_steps": results[0]["optimizer_steps_per_iteration"],
                    "parameters": results[0]["parameters"],
                    "peak_rss_mib": max(r["peak_rss_mib"] for r in results),
                    "threads": results[0]["threads"],
                    "versions": results[0].get("trl", results[0]["torch"]),
                }
                for side, results in runs.items()
            },
        }
    return table


def pipeline_tax(iterations: int) -> dict:
    from demo.build import build_default_world

    world = build_default_world(SCRATCH / "demo-world", seed=0, progress=False)
    root = world.model_dir.parent
    results = {}
    for mode in ("plain", "flow"):
        print(f"  pipeline: {mode}", flush=True)
        with tempfile.TemporaryDirectory(dir=SCRATCH) as home:
            env = thread_env(1) | {"PREFECT_HOME": home, "PREFECT_LOGGING_LEVEL": "WARNING"}
            results[mode] = worker(
                PROJECT_PYTHON,
                "bench.pipeline_tax",
                "--mode",
                mode,
                "--iterations",
                str(iterations),
                "--world",
                str(root),
                env=env,
            )
    return results


def scaling() -> dict:
    from bench.artifacts import build_artifacts

    base = SIZES["S"]
    artifacts = build_artifacts(base, SCRATCH / f"artifacts-{base.name}")
    rows = {}
    points = [(16, 32), (32, 32), (64, 32), (16, 64), (16, 128)]
    for batch, length in points:
        print(f"  scaling: B={batch} R={length}", flush=True)
        run = worker(
            PROJECT_PYTHON,
            "bench.ours_worker",
            "--artifacts",
            str(artifacts),
            "--batch",
            str(batch),
            "--response-length",
            str(length),
        )
        rows[f"{batch}x{length}"] = {
            phase: steady(run["phases"][phase]) for phase in ("iteration", "rollout", "update")
        }
    return rows


def model_scale() -> dict:
    world = SCRATCH / "scale-world"
    world.mkdir(parents=True, exist_ok=True)
    results = {}
    for variant in SCALE_VARIANTS:
        print(f"  model scale: {variant}", flush=True)
        with tempfile.TemporaryDirectory(dir=SCRATCH) as home:
            env = thread_env(1) | {"PREFECT_HOME": home, "PREFECT_LOGGING_LEVEL": "WARNING"}
            results[variant] = worker(
                PROJECT_PYTHON, "bench.scale_worker", "--variant", variant, "--world", str(world), env=env
            )
    return results


TITLES = {
    "trl": "ours vs TRL",
    "roofline": "roofline",
    "tax": "pipeline tax and replay",
    "scaling": "scaling",
    "scale": "model scale",
    "noop": "no-op run of the finished demo campaign",
}


def noop_run(repeats: int) -> dict:
    from bench.noop import measure

    return measure(repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="run every part (the default when --only is not given)")
    parser.add_argument("--only", choices=PARTS, action="append", help="run only these parts (repeatable)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side and size in the TRL comparison")
    parser.add_argument("--iterations", type=int, default=3, help="flow and plain-loop iterations")
    parser.add_argument("--noop-repeats", type=int, default=3, help="timed no-op runs of the demo campaign")
    parser.add_argument("--json", type=Path, default=SCRATCH / "results.json")
    args = parser.parse_args()
    parts = set(args.only or PARTS)
    SCRATCH.mkdir(parents=True, exist_ok=True)
    previous = json.loads(args.json.read_text()) if args.json.is_file() else {}
    results = {**previous, "machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    runners = {
        "trl": lambda: compare_trl(args.repeats),
        "roofline": lambda: worker(PROJECT_PYTHON, "bench.roofline")["gflops"],
        "tax": lambda: pipeline_tax(args.iterations),
        "scaling": scaling,
        "scale": model_scale,
        "noop": lambda: noop_run(args.noop_repeats),
    }
    for part in PARTS:
        if part in parts:
            print(TITLES[part], flush=True)
            results[part] = runners[part]()
            args.json.write_text(json.dumps(results, indent=2))  # a later part failing keeps this one
    from bench.report import write_results

    write_results(results, RESULTS, command=COMMAND, keep=RESULTS)
    print(RESULTS.read_text())


if __name__ == "__main__":
    main()
