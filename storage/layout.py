"""RunLayout: the one place that builds paths under a run root.

Every stage output lives at ``root / stage / input_key[:16]``, so a different config (and hence a
different input key) lands in a different folder and nothing is ever overwritten. The MLflow
SQLite store and its artifacts live beside the stage folders, so moving ``root`` moves everything.

    root/
        mlflow.db               # MLflow tracking store (SQLite)
        mlartifacts/<campaign>/ # MLflow artifacts, one folder per experiment
        cache/                  # scratch space: downloads for resume and replay, input fingerprints,
                                #   GGUF files converted to Hugging Face folders (cache/gguf/<conversion key>)
        engine_probe.json       # the probe batch every weight swap of the generation engine is proved on
        engine_probe_weights/   # the trainer's log-probs of the probe under each weights the gates served
        torch_threads.json      # the torch threads `execution.torch_threads: auto` chose, per machine
        <stage>/<key16>/        # one stage output: shards, checkpoints, _manifest.json
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Characters of the input key used in a stage folder name: 64 bits, enough to never collide by chance.
KEY_PREFIX_LENGTH = 16


@dataclass(frozen=True)
class RunLayout:
    """Paths under one run root.

    Args:
        root: the run root; made absolute (and resolved) on construction, so no path depends on
            the working directory at a later time.
    """

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root).expanduser().resolve())

    def stage_dir(self, stage: str, input_key: str) -> Path:
        """The output folder of ``stage`` for ``input_key``: ``root / stage / input_key[:16]``."""
        if not stage or "/" in stage or stage.startswith("."):
            raise ValueError(f"`stage` must be a plain folder name, got {stage!r}")
        if len(input_key) < KEY_PREFIX_LENGTH or not all(c in "0123456789abcdef" for c in input_key):
            raise ValueError(f"`input_key` must be a lowercase hex digest, got {input_key!r}")
        return self.root / stage / input_key[:KEY_PREFIX_LENGTH]

    def stage_outputs(self, stage: str) -> list[Path]:
        """Every finished output folder of ``stage`` (those holding a manifest), sorted."""
        folder = self.root / stage
        return (
            sorted(path for path in folder.iterdir() if (path / "_manifest.json").is_file()) if folder.is_dir() else []
        )

    def outputs(self) -> list[Path]:
        """Every finished output folder of every stage, sorted."""
        return sorted(manifest.parent for manifest in self.root.glob("*/*/_manifest.json"))

    def mlflow_db(self) -> Path:
        """The MLflow SQLite database file."""
        return self.root / "mlflow.db"

    def artifact_root(self) -> Path:
        """The folder holding MLflow artifacts (one subfolder per experiment)."""
        return self.root / "mlartifacts"

    def cache_dir(self) -> Path:
        """Scratch space, e.g. stage outputs downloaded from MLflow for resume or replay."""
        return self.root / "cache"

    def fingerprint_cache(self) -> Path:
        """The cache of input files' content hashes (see :mod:`storage.fingerprints`)."""
        return self.cache_dir() / "fingerprints.json"

    def converted_model_dir(self, key: str) -> Path:
        """The Hugging Face folder a GGUF file is converted into, once, named by its conversion key (a hex sha256 of
        the file's content and of what converts it: ``campaign.model_sources.conversion_key``)."""
        if len(key) != 64 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"`key` must be a lowercase hex sha256, got {key!r}")
        return self.cache_dir() / "gguf" / key

    def engine_probe_file(self) -> Path:
        """The campaign's probe batch for the generation engine's weight swaps (:mod:`runtime.engine_probe`)."""
        return self.root / "engine_probe.json"

    def engine_probe_weights_dir(self) -> Path:
        """The trainer's log-probs of the probe for every weights the campaign's gates served, a file each: what
        each later gate checks the engine is farther from than from its own weights (:mod:`runtime.engine_probe`)."""
        return self.root / "engine_probe_weights"

    def threads_file(self) -> Path:
        """The torch thread count ``execution.torch_threads: auto`` chose for the campaign, per machine
        (:mod:`runtime.threads`)."""
        return self.root / "torch_threads.json"

    def lock_file(self) -> Path:
        """The file whose lock a running iteration holds, so two never run at once."""
        return self.root / ".lock"

    def slot_file(self) -> Path:
        """Where the holder of :meth:`lock_file` records the lease of its Prefect global concurrency slot."""
        return self.root / ".slot"

    def tracking_uri(self) -> str:
        """The MLflow tracking URI of the SQLite store: ``sqlite:///<root>/mlflow.db``."""
        return f"sqlite:///{self.mlflow_db()}"
