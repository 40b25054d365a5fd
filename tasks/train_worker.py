"""One ``accelerate launch`` worker of a training stage: ``python -m tasks.train_worker SPEC`` (see :mod:`tasks.launch`).

Every worker runs the training function of the job spec on the stage's inputs; the function saves on the
main process only, and the main process writes the job's result (metrics and runtime) last, atomically.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from accelerate import PartialState

from tasks.launch import TrainingOutput, decode, resolve


def main(argv: list[str] | None = None) -> None:
    (spec_path,) = sys.argv[1:] if argv is None else argv
    # Join the process group first: on GPUs this makes the process's own GPU the current one, which is where
    # `device: cuda` then puts its models.
    state = PartialState()
    job = json.loads(Path(spec_path).read_text())
    function = resolve(job["function"])
    out = TrainingOutput(path=Path(job["output"]), final_dir=Path(job["final_dir"]))
    metrics = function(out, decode(job["context"]), *decode(job["upstream"]), **decode(job["settings"]))
    if state.is_main_process:
        result = Path(job["result"])
        staging = result.with_name(f".{result.name}.tmp-{os.getpid()}")
        staging.write_text(json.dumps({"metrics": dict(metrics), "runtime": out.runtime}))
        os.replace(staging, result)


if __name__ == "__main__":
    main()
