"""The no-op run: ``rlhf run`` of the finished demo campaign, timed as a whole command.

``.venv/bin/python -m bench.run --only noop``: runs the demo campaign (``configs/demo.yaml``) into a fresh
``bench/.scratch/noop-root`` (its demo world kept from an earlier run), then times running the same command
again ``--repeats`` times (each a fresh process, as a user runs it). Also reports,
from one more process, where that command's time goes: importing the command's modules (neither torch nor
Prefect), locating the base inputs and fingerprinting them (from the run root's cache; no checks), opening
the MLflow store, the decision (one MLflow query of the finished iterations and what differs from what produced
them; :func:`campaign.history.finished_iterations`, :func:`campaign.history.what_differs`), and checking every
output of the finished iterations against its recorded digest (:func:`campaign.verification.check_finished_outputs`:
one MLflow query of their stage runs, sha256s from the run root's cache by size and modification time).

This module itself runs as the worker of the last part (``python -m bench.noop --out FILE --root DIR``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

from bench.common import PROJECT_PYTHON, REPO, SCRATCH, median, thread_env

CONFIG = REPO / "configs" / "demo.yaml"


def _command(root: Path) -> list[str]:
    return [str(PROJECT_PYTHON), "-m", "flows", "run", "--config", str(CONFIG), "--set", f"run_root={root}"]


def _timed(command: list[str], env: dict[str, str]) -> tuple[float, str]:
    started = time.perf_counter()
    completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{completed.stderr[-4000:]}")
    return time.perf_counter() - started, completed.stdout


def measure(repeats: int) -> dict:
    root = SCRATCH / "noop-root"
    for entry in root.glob("*") if root.is_dir() else ():
        if entry.name != "cache":
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    env = thread_env(1) | {"PREFECT_HOME": str(SCRATCH / "noop-prefect-home"), "PREFECT_LOGGING_LEVEL": "WARNING"}
    first, _ = _timed(_command(root), env)  # the campaign itself
    walls, outputs = zip(*(_timed(_command(root), env) for _ in range(repeats)), strict=True)
    out = SCRATCH / "noop-breakdown.json"
    subprocess.run(
        [str(PROJECT_PYTHON), "-m", "bench.noop", "--root", str(root), "--out", str(out)],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
    )
    return {
        "first_run_s": first,
        "noop_wall_s": list(walls),
        "noop_median_s": median(list(walls)),
        "nothing_to_run": all("nothing to run" in text for text in outputs),
        "breakdown": json.loads(out.read_text()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    started = time.perf_counter()
    from campaign.config import load_config
    from campaign.history import finished_iterations, what_differs
    from campaign.identity import base_inputs, demo_world_dir, fingerprint_cache
    from campaign.store import store_tracker
    from campaign.verification import check_finished_outputs
    from demo.world import complete_world
    from flows.report import campaign_report  # noqa: F401 - the command prints it: its imports count

    imported = time.perf_counter()
    config = load_config(CONFIG, [f"run_root={args.root}"])
    base = base_inputs(config, fingerprint_cache(config), complete_world(demo_world_dir(config)))
    resolved = time.perf_counter()
    store_tracker(config)  # opening the MLflow store (cached per process)
    opened = time.perf_counter()
    finished = finished_iterations(config)
    what_differs(finished, base, vllm=None)
    decided = time.perf_counter()
    check_finished_outputs(config, finished)
    checked = time.perf_counter()
    result = {
        "import_s": imported - started,
        "config_and_base_s": resolved - imported,
        "mlflow_store_s": opened - resolved,
        "decision_s": decided - opened,
        "outputs_checked_s": checked - decided,
        "iterations": config.iterations,
        "finished": len(finished),
    }
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
