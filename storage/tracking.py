"""The pipeline's records in MLflow: campaigns, iteration and stage runs, stage outputs, models.

:class:`Tracker` is a :class:`storage.mlflow_store.MlflowStore` (the adapter, the only module that
imports mlflow) that knows what the records mean. Layout: an experiment per campaign, a parent run per
iteration (``rlhf.kind=iteration``), a nested run per stage (``rlhf.kind=stage``, or ``replay``) linked by
``mlflow.parentRunId``.

Choices:

1. The tags below are the records' whole vocabulary, declared once: the flows and :mod:`campaign` write and
   search runs with them too. Their names and values, with the artifact paths, are the data layout of every
   existing campaign, so they do not change.
2. A stage's output exists once on local disk. With a local store (a SQLite tracking URI, the
   default) it is recorded *by reference*: the run gets the manifest as its ``output/`` artifact and
   the output folder's path as a tag, and registered model versions point at the folder; nothing is
   copied. With a tracking server the folder is uploaded as the run's ``output/`` artifacts and
   downloaded on demand. Either way its Parquet tables are logged as MLflow datasets (digest from
   the manifest's sha256s) and the run is tagged with the input key and the manifest digest, so
   :meth:`Tracker.find_stage_record` can answer "was this stage already done for these inputs?".
3. Recording is idempotent. Every run is tagged, while it is written, with the process writing it
   (``rlhf.process``: host, pid and the pid's start time, so a reused pid is not mistaken for the
   writer). A run left RUNNING by a writer that died is found by the next attempt
   (:meth:`Tracker.reconcile_runs` marks it KILLED, :meth:`Tracker.find_unfinished_stage_run` finds
   a stage's by its input key) and finished or replaced in place: params and metrics logged again
   are skipped when already there, ``output/`` artifacts are cleared and logged again, datasets and
   model versions are not added twice. A run on another host is never touched: its writer cannot be
   seen.
4. A checkpoint folder is also a logged model (:meth:`Tracker.record_checkpoint`), created once per stage run and
   folder, found by the output's manifest digest and its :data:`TAG_MODEL`; it points at the folder the run
   recorded and copies nothing. Older records have none, and everything here reads them as before.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import shutil
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.errors import UserError
from storage.files import temporary_sibling
from storage.manifest import MANIFEST_FILE, Manifest, read_manifest
from storage.mlflow_store import TAG_PARENT_RUN_ID, LocalDataset, LoggedModelSummary, MlflowStore, RunSummary

__all__ = [
    "KIND_ITERATION",
    "KIND_REPLAY",
    "KIND_STAGE",
    "TAG_CAMPAIGN",
    "TAG_CAMPAIGN_CONFIG",
    "TAG_CONFIG_FINGERPRINT",
    "TAG_FLOW_RUN_ID",
    "TAG_INPUT_KEY",
    "TAG_ITERATION",
    "TAG_ITERATION_KEY",
    "TAG_KIND",
    "TAG_MANIFEST_DIGEST",
    "TAG_OUTPUT_PATH",
    "TAG_OUTPUT_PREFIX",
    "TAG_PARENT_RUN_ID",
    "TAG_PROCESS",
    "TAG_REPLAY_OF",
    "TAG_CODE",
    "TAG_INPUTS",
    "TAG_PACKAGE_VERSION",
    "TAG_VERSIONS",
    "TAG_SUPERSEDED_BY",
    "TAG_SOURCE",
    "TAG_MODEL",
    "TAG_STAGE",
    "TAG_PARENT_MODEL",
    "TAG_UPSTREAM_PREFIX",
    "MissingOutputError",
    "StageRecord",
    "Tracker",
]

TAG_CAMPAIGN = "rlhf.campaign"
TAG_ITERATION = "rlhf.iteration"
TAG_STAGE = "rlhf.stage"
TAG_KIND = "rlhf.kind"
TAG_INPUT_KEY = "rlhf.input_key"
TAG_MANIFEST_DIGEST = "rlhf.manifest_digest"
TAG_UPSTREAM_PREFIX = "rlhf.upstream."
"""On a stage run and on a logged model, ``rlhf.upstream.<input>``: the manifest digest of each output its stage was
made from (its lineage: the run tagged with that ``rlhf.manifest_digest`` made it), e.g. the rollout's ``policy``."""
TAG_ITERATION_KEY = "rlhf.iteration_key"
"""An iteration (or replay) run's identity: the hash of its config, base inputs and starting point."""
TAG_REPLAY_OF = "rlhf.replay_of"
"""On a replay run: the iteration run it replays."""
TAG_CODE = "rlhf.code"
"""On an iteration run: the fingerprint of the code that computed it (``campaign.history.code_in_use``)."""
TAG_PACKAGE_VERSION = "rlhf.package_version"
"""On an iteration run: this project's version that computed it."""
TAG_INPUTS = "rlhf.inputs"
"""On an iteration run: the contents it was computed from, JSON ``{setting: sha256}`` (``model.policy``, ...)."""
TAG_VERSIONS = "rlhf.versions"
"""On an iteration run: the versions of the libraries that computed it, JSON ``{library: version}``
(``runtime.versions.library_versions``)."""
TAG_SUPERSEDED_BY = "rlhf.superseded_by"
"""On an iteration run recomputed by a later one (``rlhf run --from-iteration``): the run that replaced it, or that
replaced an iteration it continued from. A superseded run is kept, but no longer the campaign's."""
TAG_OUTPUT_PREFIX = "rlhf.output."
"""An iteration run's tag ``rlhf.output.<stage>`` names the stage run holding the output it used,
which is another iteration's run when the stage was reused."""
TAG_OUTPUT_PATH = "rlhf.output_path"
"""On a stage run recorded by reference: the folder holding its output."""
TAG_REMOVED_BY_GC = "rlhf.removed_by_gc"
"""On a stage run whose output folder ``rlhf gc`` removed: when (UTC, ISO 8601). A recorded output missing without it
was removed by something else, and is refused or restored (:mod:`campaign.verification`)."""
TAG_GC_RECORDS = "rlhf.gc_records"
"""On a campaign's experiment made since ``rlhf gc`` tags what it removes (:data:`TAG_REMOVED_BY_GC`): only there is
a recorded output missing without the tag refused; an older campaign's gc left no record of what it removed."""
TAG_PROCESS = "rlhf.process"
"""The process writing a run (``host:pid:start time``), so a later attempt can tell a dead writer's run."""
TAG_FLOW_RUN_ID = "prefect.flow_run_id"
TAG_MODEL = "rlhf.model"
"""On a logged model: which model of its stage output it is (``actor``, ``critic``, ``reward_model``: its folder)."""
TAG_SOURCE = "rlhf.source"
"""On a logged model: the folder of its weights (a URI), in the stage output that holds it."""
TAG_PARENT_MODEL = "rlhf.parent_model"
"""On a logged model: the logged model it was trained from (the previous actor, critic or reward model), if any."""
TAG_CONFIG_FINGERPRINT = "rlhf.config_fingerprint"
"""Experiment tag: the fingerprint of the config that defines the campaign (``campaign.identity.campaign_fields``)."""
TAG_CAMPAIGN_CONFIG = "rlhf.campaign_config"
"""Experiment tag: those fields as JSON, so a conflicting config can be told which fields differ."""

KIND_ITERATION = "iteration"
KIND_STAGE = "stage"
KIND_REPLAY = "replay"

OUTPUT_ARTIFACT_PATH = "output"

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SHARD_FILE = re.compile(r"(?P<table>.+)-\d{5,}\.parquet")

logger = logging.getLogger(__name__)


class MissingOutputError(UserError, LookupError):
    """A stage run recorded its output by reference, and that folder is gone (e.g. removed by ``rlhf gc``)."""


@dataclass(frozen=True)
class StageRecord:
    """A finished stage run found by its input key.

    Args:
        run_id: the MLflow run.
        input_key: the stage's input key.
        manifest_digest: the digest of the output's manifest.
        artifact_uri: the run's artifact root (the output lives under ``output/``).
    """

    run_id: str
    input_key: str
    manifest_digest: str
    artifact_uri: str


def _check_name(value: str, what: str) -> str:
    if not _SAFE_NAME.fullmatch(value):
        raise ValueError(f"`{what}` must be letters, digits, '.', '_' or '-' (not first), got {value!r}")
    return value


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, from ``/proc``), None if it does not run.

    Falls back to "" for a running process where ``/proc`` is unavailable (then a reused pid looks alive).
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    return stat[stat.rindex(")") + 2 :].split()[19]  # field 22, counted after the command name


@functools.cache
def process_token() -> str:
    """This process as a writer: ``host:pid:start time``."""
    return f"{socket.gethostname()}:{os.getpid()}:{_start_time(os.getpid()) or ''}"


def writer_alive(token: str) -> bool:
    """Whether the process a :data:`TAG_PROCESS` value names still runs; True for another host (unknowable)."""
    parts = token.rsplit(":", 2)
    if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return True
    started = parts[2]
    now = _start_time(int(parts[1]))
    return now is not None and (now == started or not now or not started)


def output_datasets(stage_dir: Path, manifest: Manifest) -> list[LocalDataset]:
    """Each Parquet table of a stage output as a dataset, by table name.

    The dataset is named ``{stage}/{table}``; its digest is the sha256 over the table's shard sha256s (in
    shard order), so equal data gives equal digests.
    """
    tables: dict[str, list[str]] = {}
    for entry in manifest.files:
        match = _SHARD_FILE.fullmatch(entry.path)
        if match:
            tables.setdefault(match.group("table"), []).append(entry.sha256)
    return [
        LocalDataset(
            name=f"{manifest.stage}/{table}",
            digest=hashlib.sha256("".join(hashes).encode()).hexdigest(),
            path=Path(stage_dir).absolute() / table,
        )
        for table, hashes in sorted(tables.items())
    ]


class Tracker(MlflowStore):
    """The pipeline's view of MLflow: the store's generic records (:class:`MlflowStore`), plus campaigns, runs
    written by a process, stage records and outputs, finished iterations and registered stage outputs.

    Args:
        tracking_uri: where runs are recorded, e.g. ``RunLayout.tracking_uri()`` or a server URL.
            It is also the model registry URI.
        artifact_root: where new experiments keep their artifacts (``artifact_root/<campaign>``);
            None leaves it to the tracking server or MLflow's default.
        ui_base: the MLflow UI address (see :class:`MlflowStore`).
        outputs_by_reference: record stage outputs by reference instead of uploading them; the
            default is True for a local (``sqlite:``) store, False for a tracking server.
    """

    def __init__(
        self,
        tracking_uri: str,
        *,
        artifact_root: Path | None = None,
        ui_base: str | None = None,
        outputs_by_reference: bool | None = None,
    ) -> None:
        super().__init__(tracking_uri, artifact_root=artifact_root, ui_base=ui_base)
        self.outputs_by_reference = (
            tracking_uri.startswith(("sqlite:", "file:")) if outputs_by_reference is None else outputs_by_reference
        )

    # Campaigns and the runs this process writes ---------------------------------------------------

    def experiment_id(self, campaign: str) -> str:
        """The experiment of ``campaign``, created (with its artifact location) if missing.

        Two processes creating it at once both get the same id.
        """
        return self.ensure_experiment(_check_name(campaign, "campaign"))

    def start_run(
        self, experiment_id: str, *, name: str, tags: Mapping[str, str], parent_run_id: str | None = None
    ) -> str:
        """Create a run (nested under ``parent_run_id`` when given, tagged with this process as its writer)."""
        return self.create_run(
            experiment_id, name=name, tags={**tags, TAG_PROCESS: process_token()}, parent_run_id=parent_run_id
        )

    def reopen_run(self, run_id: str) -> None:
        """Make a finished, failed or killed run RUNNING again, written by this process (to finish or redo it)."""
        self.set_tags(run_id, {TAG_PROCESS: process_token()})
        self.mark_running(run_id)

    def reconcile_runs(self, experiment_id: str) -> list[str]:
        """Mark KILLED every RUNNING run of the experiment whose writer, on this host, is dead; their ids.

        A run without a writer tag (recorded by an older version) or written on another host is left alone.
        """
        dead = []
        for run in self.runs(experiment_id, status="RUNNING"):
            token = run.tags.get(TAG_PROCESS)
            if token is not None and not writer_alive(token):
                self.end_run(run.run_id, "KILLED")
                dead.append(run.run_id)
        if dead:
            logger.warning("marked %d run(s) KILLED whose writing process died: %s", len(dead), ", ".join(dead))
        return dead

    def find_unfinished_stage_run(self, experiment_id: str, stage: str, input_key: str) -> str | None:
        """The newest stage run for ``input_key`` that never finished (FAILED, KILLED, or RUNNING with a dead
        writer on this host): the one to finish rather than record the stage twice. None if there is none."""
        tags = {TAG_STAGE: _check_name(stage, "stage"), TAG_INPUT_KEY: input_key}
        for run in self.runs(experiment_id, tags=tags, newest_by="start_time"):
            token = run.tags.get(TAG_PROCESS)
            if run.status != "FINISHED" and (run.status != "RUNNING" or token is None or not writer_alive(token)):
                return run.run_id
        return None

    @contextlib.contextmanager
    def ends_on_error(self, run_id: str) -> Iterator[None]:
        """If the block raises, end the run KILLED (Ctrl-C) or FAILED and re-raise; nothing stays RUNNING.

        A run that is not RUNNING is left as it is: a finished iteration run keeps its record when a later
        attempt that only reuses its outputs fails.
        """
        try:
            yield
        except BaseException as error:
            status = "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
            try:
                if self.run(run_id).status == "RUNNING":
                    self.end_run(run_id, status)
            except Exception as end_error:  # noqa: BLE001 - the original error matters; the next attempt reconciles
                logger.warning("could not mark run %s %s: %s", run_id, status, end_error)
            raise

    # Stage outputs --------------------------------------------------------------------------------

    def log_stage_output(self, run_id: str, stage_dir: Path, manifest: Manifest) -> None:
        """Record a finished stage output on its run: artifacts, datasets and lookup tags.

        Uploads ``stage_dir`` as the run's ``output/`` artifacts (by reference: only its manifest,
        and the folder's path as the tag ``rlhf.output_path``), logs its tables as datasets
        (:func:`output_datasets`, context ``output``), and tags the run with ``rlhf.stage``, ``rlhf.input_key``
        and ``rlhf.manifest_digest``. End the run FINISHED afterwards so :meth:`find_stage_record` sees it.
        """
        tags = {TAG_STAGE: manifest.stage, TAG_INPUT_KEY: manifest.input_key, TAG_MANIFEST_DIGEST: manifest.digest}
        if self.outputs_by_reference:
            self.log_artifact(run_id, Path(stage_dir) / MANIFEST_FILE, artifact_path=OUTPUT_ARTIFACT_PATH)
            tags[TAG_OUTPUT_PATH] = str(Path(stage_dir).absolute())
        else:
            self.log_artifacts(run_id, Path(stage_dir), artifact_path=OUTPUT_ARTIFACT_PATH)
        self.log_datasets(run_id, output_datasets(stage_dir, manifest), context="output")
        self.set_tags(run_id, tags)

    def clear_stage_output(self, run_id: str) -> None:
        """Delete a run's ``output/`` artifacts: what an interrupted copy left, before copying them again."""
        self.delete_artifacts(run_id, OUTPUT_ARTIFACT_PATH)

    def find_stage_record(self, experiment_id: str, stage: str, input_key: str) -> StageRecord | None:
        """The newest FINISHED run of ``stage`` tagged with ``input_key``, or None."""
        _check_name(stage, "stage")
        if not re.fullmatch(r"[0-9a-f]+", input_key):
            raise ValueError(f"`input_key` must be a hex digest, got {input_key!r}")
        runs = self.runs(
            experiment_id,
            tags={TAG_STAGE: stage, TAG_INPUT_KEY: input_key},
            status="FINISHED",
            newest_by="end_time",
            max_results=1,
        )
        if not runs:
            return None
        return StageRecord(
            run_id=runs[0].run_id,
            input_key=input_key,
            manifest_digest=runs[0].tags.get(TAG_MANIFEST_DIGEST, ""),
            artifact_uri=runs[0].artifact_uri,
        )

    def download_stage_output(self, run_id: str, destination: Path) -> Path:
        """Download a run's ``output/`` artifacts into ``destination`` and verify them.

        The download goes to a hidden sibling folder that is renamed to ``destination`` only once
        complete, so ``destination`` never holds half an output.

        Args:
            run_id: a run recorded with :meth:`log_stage_output`.
            destination: a new or empty folder.

        Returns:
            ``destination`` (absolute).

        Raises:
            FileExistsError: ``destination`` exists and is not an empty folder.
            CorruptOutputError: the downloaded files do not match their manifest.
            MissingOutputError: the run recorded its output by reference and that folder is gone.
        """
        destination = Path(destination).absolute()
        if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
            raise FileExistsError(f"{destination} must be a new or empty folder")
        referenced = self.run(run_id).tags.get(TAG_OUTPUT_PATH)
        if referenced is not None:
            return self._copy_referenced(run_id, Path(referenced), destination)
        destination.parent.mkdir(parents=True, exist_ok=True)
        staging = temporary_sibling(destination, what=".download-")
        staging.mkdir()
        try:
            downloaded = self.download_artifacts(run_id, OUTPUT_ARTIFACT_PATH, staging)
            read_manifest(downloaded, verify=True)
            if destination.exists():
                destination.rmdir()
            os.rename(downloaded, destination)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return destination

    def _copy_referenced(self, run_id: str, referenced: Path, destination: Path) -> Path:
        """The output a run recorded by reference: ``destination`` itself, or a verified copy of it there."""
        if not referenced.is_dir():
            raise MissingOutputError(
                f"stage run {run_id} recorded its output by reference at {referenced}, which no longer exists"
            )
        read_manifest(referenced, verify=True)
        if referenced != destination:
            staging = temporary_sibling(destination, what=".copy-")
            try:
                shutil.copytree(referenced, staging)
                if destination.exists():
                    destination.rmdir()
                os.rename(staging, destination)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return destination

    def register_model(
        self,
        run_id: str,
        *,
        name: str,
        stage_dir: Path,
        subfolder: str,
        alias: str = "latest",
        model_id: str | None = None,
    ) -> str:
        """Register the folder ``subfolder`` (e.g. ``actor``) of a stage output recorded on ``run_id`` as a new
        version, once (:meth:`MlflowStore.register_version`).

        The version's source is :meth:`model_source`.

        Args:
            run_id: the stage run that recorded the output.
            name: the registered model (created if missing).
            stage_dir: the stage output folder.
            subfolder: the model's folder inside it.
            alias: moved to the new version (``latest``, reserved by MLflow, always means the newest).
            model_id: the checkpoint's logged model (:meth:`record_checkpoint`), linked to the version.

        Returns:
            The new version number (a string, as MLflow gives it).
        """
        return self.register_version(
            name, self.model_source(run_id, stage_dir, subfolder), run_id=run_id, alias=alias, model_id=model_id
        )

    def model_source(self, run_id: str, stage_dir: Path, subfolder: str) -> str:
        """Where the model folder ``subfolder`` of a stage output recorded on ``run_id`` is (a URI): the folder
        itself when outputs are recorded by reference, else the run's artifact ``output/<subfolder>``."""
        if self.outputs_by_reference:
            return (Path(stage_dir).absolute() / subfolder).as_uri()
        return f"{self.run(run_id).artifact_uri.rstrip('/')}/{OUTPUT_ARTIFACT_PATH}/{subfolder.strip('/')}"

    # Checkpoints as logged models -----------------------------------------------------------------

    def record_checkpoint(
        self,
        experiment_id: str,
        run_id: str,
        *,
        name: str,
        manifest: Manifest,
        stage_dir: Path,
        subfolder: str,
        tags: Mapping[str, str],
    ) -> str:
        """The logged model ``name`` of the checkpoint folder ``subfolder`` of a stage output recorded on ``run_id``,
        created once (a recording finished by a second attempt finds the first's); its id.

        It is tagged with which model it is (:data:`TAG_MODEL`: the folder's name), the output's stage and manifest
        digest and the folder (:data:`TAG_SOURCE`), plus ``tags`` (campaign, iteration, lineage), and holds no copy
        of the weights.
        """
        existing = self.logged_models(experiment_id, run_id=run_id, tags={TAG_MODEL: subfolder})
        if existing:
            return existing[0].model_id
        model_tags = {
            TAG_MODEL: subfolder,
            TAG_STAGE: manifest.stage,
            TAG_MANIFEST_DIGEST: manifest.digest,
            TAG_SOURCE: self.model_source(run_id, stage_dir, subfolder),
            **tags,
        }
        return self.create_logged_model(
            experiment_id, name=name, run_id=run_id, tags=model_tags, params={}, model_type=manifest.stage
        )

    def checkpoint_model(self, experiment_id: str, model: str, digest: str) -> LoggedModelSummary | None:
        """The logged model of ``model`` (``actor``, ...) in the stage output with manifest digest ``digest``, or None
        (an output recorded before checkpoints were logged models, or one that holds no such model)."""
        found = self.logged_models(experiment_id, tags={TAG_MODEL: model, TAG_MANIFEST_DIGEST: digest})
        return found[0] if found else None

    # Finished iterations --------------------------------------------------------------------------

    def finished_iterations(self, experiment_id: str) -> dict[int, RunSummary]:
        """The campaign's finished iterations: ``{iteration: its run}``, the newest FINISHED iteration run of each
        number that no later run superseded (``rlhf.superseded_by``). The one query of "the finished run of
        iteration N"."""
        newest: dict[int, RunSummary] = {}
        for run in self.runs(experiment_id, tags={TAG_KIND: KIND_ITERATION}, status="FINISHED"):
            value = run.tags.get(TAG_ITERATION)
            if value is None or not re.fullmatch(r"-?\d+", value) or TAG_SUPERSEDED_BY in run.tags:
                continue
            if int(value) not in newest or run.start_time > newest[int(value)].start_time:
                newest[int(value)] = run
        return dict(sorted(newest.items()))

    def iteration_metrics(self, experiment_id: str) -> list[tuple[int, dict[str, float]]]:
        """``(iteration, metrics)`` of every finished iteration (:meth:`finished_iterations`), by iteration."""
        return [(number, run.metrics) for number, run in self.finished_iterations(experiment_id).items()]

    def latest_iteration(self, experiment_id: str) -> int | None:
        """The highest finished iteration (:meth:`finished_iterations`) of the experiment, or None."""
        return max(self.finished_iterations(experiment_id), default=None)


@functools.lru_cache(maxsize=4)
def open_tracker(uri: str, artifact_root: str | None, ui_base: str | None = None) -> Tracker:
    """The :class:`Tracker` of a store: one per store and process, whoever asks (a flow and the stages it runs
    share it). Opening one is not free: MLflow checks a SQLite store's schema, about a second here."""
    return Tracker(uri, artifact_root=None if artifact_root is None else Path(artifact_root), ui_base=ui_base)
