"""MLflow tracking behind one class: the only module in the project that imports mlflow.

Layout: an experiment per campaign, a parent run per iteration (``rlhf.kind=iteration``), a
nested run per stage (``rlhf.kind=stage``, or ``replay``) linked by ``mlflow.parentRunId``.

Choices:

1. :class:`Tracker` wraps an ``MlflowClient`` and always passes explicit run ids; the fluent
   API's global active run is never used, so threads and Prefect task runners cannot mix runs up.
2. The tracking URI is given once, to the constructor. The default is a SQLite file (MLflow 3
   refuses the file store). Creating or migrating a fresh SQLite store from several processes at
   once can fail ("duplicate column"), so the first touch of the store happens under an exclusive
   ``fcntl`` lock on ``<db>.lock``.
3. Experiments are created with an explicit artifact location (``artifact_root/<campaign>``), so
   artifacts do not depend on the working directory; on a tracking server (an ``http(s)://`` URI)
   the server decides (its ``--artifacts-destination``), and an artifact root is refused.
4. Params and metrics go through ``log_batch`` (about 100x faster than one call per value on SQLite).
5. A stage's output exists once on local disk. With a local store (a SQLite tracking URI, the
   default) it is recorded *by reference*: the run gets the manifest as its ``output/`` artifact and
   the output folder's path as a tag, and registered model versions point at the folder; nothing is
   copied. With a tracking server the folder is uploaded as the run's ``output/`` artifacts and
   downloaded on demand. Either way its Parquet tables are logged as MLflow datasets (digest from
   the manifest's sha256s) and the run is tagged with the input key and the manifest digest, so
   :meth:`Tracker.find_stage_record` can answer "was this stage already done for these inputs?".
6. Recording is idempotent. Every run is tagged, while it is written, with the process writing it
   (``rlhf.process``: host, pid and the pid's start time, so a reused pid is not mistaken for the
   writer). A run left RUNNING by a writer that died is found by the next attempt
   (:meth:`Tracker.reconcile_runs` marks it KILLED, :meth:`Tracker.find_unfinished_stage_run` finds
   a stage's by its input key) and finished or replaced in place: params and metrics logged again
   are skipped when already there, ``output/`` artifacts are cleared and logged again, datasets and
   model versions are not added twice. A run on another host is never touched: its writer cannot be
   seen.

Environment: nothing here reads or sets environment variables. Set ``MLFLOW_DISABLE_TELEMETRY=true``
in the environment of offline machines (tests do it in ``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from mlflow.data.meta_dataset import MetaDataset
from mlflow.data.sources import LocalArtifactDatasetSource
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, Run, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT, MLFLOW_PARENT_RUN_ID

from storage.files import temporary_sibling
from storage.manifest import MANIFEST_FILE, Manifest, read_manifest

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
    "TAG_SUPERSEDED_BY",
    "TAG_STAGE",
    "MissingOutputError",
    "ModelVersionSummary",
    "RunSummary",
    "StageRecord",
    "Tracker",
]

TAG_CAMPAIGN = "rlhf.campaign"
TAG_ITERATION = "rlhf.iteration"
TAG_STAGE = "rlhf.stage"
TAG_KIND = "rlhf.kind"
TAG_INPUT_KEY = "rlhf.input_key"
TAG_MANIFEST_DIGEST = "rlhf.manifest_digest"
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
TAG_SUPERSEDED_BY = "rlhf.superseded_by"
"""On an iteration run recomputed by a later one (``rlhf run --from-iteration``): the run that replaced it, or that
replaced an iteration it continued from. A superseded run is kept, but no longer the campaign's."""
TAG_OUTPUT_PREFIX = "rlhf.output."
"""An iteration run's tag ``rlhf.output.<stage>`` names the stage run holding the output it used,
which is another iteration's run when the stage was reused."""
TAG_OUTPUT_PATH = "rlhf.output_path"
"""On a stage run recorded by reference: the folder holding its output."""
TAG_PROCESS = "rlhf.process"
"""The process writing a run (``host:pid:start time``), so a later attempt can tell a dead writer's run."""
TAG_FLOW_RUN_ID = "prefect.flow_run_id"
TAG_CONFIG_FINGERPRINT = "rlhf.config_fingerprint"
"""Experiment tag: the fingerprint of the config that defines the campaign (``campaign.identity.campaign_fields``)."""
TAG_CAMPAIGN_CONFIG = "rlhf.campaign_config"
"""Experiment tag: those fields as JSON, so a conflicting config can be told which fields differ."""
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
"""MLflow 3's experiment type ("Machine learning"), shown on the experiment's page; MLflow 3.17's UI does not read it
to choose the page an experiment opens on (see :data:`UI_RUNS_VIEW`)."""
UI_RUNS_VIEW = "workflowType=machine_learning"
"""The query that makes MLflow 3.17's UI show an experiment's runs. Its UI picks the page from a workflow type (GenAI
or machine learning) read from the URL's ``workflowType``, else from the browser's own choice (the sidebar switch,
kept in its local storage), else GenAI, whose overview shows traces; the experiment's tags are not read. Every
link the pipeline gives carries it."""
DEFAULT_UI_BASE = "http://127.0.0.1:5000"
"""The MLflow UI over a local store, where docs/operating.md starts it (``mlflow server --port 5000``)."""
TAG_PARENT_RUN_ID = MLFLOW_PARENT_RUN_ID

KIND_ITERATION = "iteration"
KIND_STAGE = "stage"
KIND_REPLAY = "replay"

OUTPUT_ARTIFACT_PATH = "output"

_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
_MAX_PARAM_LENGTH = 6000
_LATEST = "latest"
_DIGEST_LENGTH = 32  # MLflow stores dataset digests in 36 characters
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SHARD_FILE = re.compile(r"(?P<table>.+)-\d{5,}\.parquet")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSummary:
    """A run's id, status and tags."""

    run_id: str
    status: str
    tags: dict[str, str]


@dataclass(frozen=True)
class ModelVersionSummary:
    """A registered model version: its number, the run that made it, its source and aliases."""

    version: str
    run_id: str
    source: str
    aliases: tuple[str, ...]


class MissingOutputError(LookupError):
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


def _quote(value: object) -> str:
    """A value for a single-quoted search filter literal; quotes and backslashes are refused."""
    text = str(value)
    if "'" in text or "\\" in text:
        raise ValueError(f"search values must not contain quotes or backslashes, got {text!r}")
    return text


def _error_code(error: MlflowException) -> str:
    """The error's code name, e.g. ``RESOURCE_ALREADY_EXISTS``."""
    return str(error.error_code)


def _flatten(params: Mapping[str, object], prefix: str = "") -> Iterator[tuple[str, str]]:
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, prefix=f"{name}.")
        else:
            text = str(value)
            yield name, text if len(text) <= _MAX_PARAM_LENGTH else text[: _MAX_PARAM_LENGTH - 3] + "..."


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


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


def _sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, None for anything else (servers, in-memory)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path = tracking_uri[len("sqlite:///") :].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


class Tracker:
    """The pipeline's view of MLflow: campaigns, iteration and stage runs, stage records, models.

    Args:
        tracking_uri: where runs are recorded, e.g. ``RunLayout.tracking_uri()`` or a server URL.
            It is also the model registry URI.
        artifact_root: where new experiments keep their artifacts (``artifact_root/<campaign>``);
            None leaves it to the tracking server or MLflow's default.
        ui_base: the MLflow UI address used by :meth:`run_url` and :meth:`experiment_url`; None: the tracking
            server itself for an ``http(s)`` URI, else :data:`DEFAULT_UI_BASE`.
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
        if artifact_root is not None and tracking_uri.startswith(("http://", "https://")):
            raise ValueError(
                f"a tracking server ({tracking_uri}) keeps artifacts where its --artifacts-destination says: "
                "pass no artifact_root"
            )
        self.tracking_uri = tracking_uri
        self.outputs_by_reference = (
            tracking_uri.startswith(("sqlite:", "file:")) if outputs_by_reference is None else outputs_by_reference
        )
        self.artifact_root = None if artifact_root is None else Path(artifact_root).absolute()
        if ui_base is None:
            ui_base = tracking_uri if tracking_uri.startswith(("http://", "https://")) else DEFAULT_UI_BASE
        self.ui_base = ui_base.rstrip("/")
        database = _sqlite_path(tracking_uri)
        lock = (
            _file_lock(database.with_name(database.name + ".lock"))
            if database is not None
            else contextlib.nullcontext()
        )
        with lock:
            # Building the client creates (or migrates) a SQLite store; do it while holding the lock,
            # and touch the registry too, which has its own store object.
            self._client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
            self._client.search_experiments(max_results=1)
            self._client.search_registered_models(max_results=1)

    # Experiments and runs ------------------------------------------------------------------------

    def has_experiment(self, campaign: str) -> bool:
        """Whether the store holds an experiment named ``campaign`` (active or deleted)."""
        return self._client.get_experiment_by_name(campaign) is not None

    def experiment_id(self, campaign: str) -> str:
        """The experiment of ``campaign``, created (with its artifact location) if missing.

        Two processes creating it at once both get the same id.
        """
        _check_name(campaign, "campaign")
        experiment = self._client.get_experiment_by_name(campaign)
        if experiment is None:
            location = None if self.artifact_root is None else (self.artifact_root / campaign).as_uri()
            try:
                return self._client.create_experiment(
                    campaign, artifact_location=location, tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND}
                )
            except MlflowException:
                experiment = self._client.get_experiment_by_name(campaign)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage != "active":
            raise ValueError(f"experiment {campaign!r} is deleted; restore it in MLflow or delete it permanently")
        if TAG_EXPERIMENT_KIND not in experiment.tags:  # made before the type was set, or by MLflow itself
            self._client.set_experiment_tag(experiment.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND)
        return experiment.experiment_id

    def experiment_tags(self, campaign: str) -> dict[str, str]:
        """The tags of ``campaign``'s experiment; empty when it does not exist (nothing is created)."""
        experiment = self._client.get_experiment_by_name(campaign)
        return {} if experiment is None else dict(experiment.tags)

    def set_experiment_tags(self, experiment_id: str, tags: Mapping[str, str]) -> None:
        """Set tags on an experiment."""
        for key, value in tags.items():
            self._client.set_experiment_tag(experiment_id, key, value)

    def start_run(
        self, experiment_id: str, *, name: str, tags: Mapping[str, str], parent_run_id: str | None = None
    ) -> str:
        """Create a run (nested under ``parent_run_id`` when given, tagged with this process as its writer)."""
        run_tags = {key: str(value) for key, value in tags.items()}
        run_tags[TAG_PROCESS] = process_token()
        if parent_run_id is not None:
            run_tags[MLFLOW_PARENT_RUN_ID] = parent_run_id
        return self._client.create_run(experiment_id, run_name=name, tags=run_tags).info.run_id

    def reopen_run(self, run_id: str) -> None:
        """Make a finished, failed or killed run RUNNING again, written by this process (to finish or redo it)."""
        self.set_tags(run_id, {TAG_PROCESS: process_token()})
        self._client.update_run(run_id, status="RUNNING")

    def reconcile_runs(self, experiment_id: str) -> list[str]:
        """Mark KILLED every RUNNING run of the experiment whose writer, on this host, is dead; their ids.

        A run without a writer tag (recorded by an older version) or written on another host is left alone.
        """
        dead = []
        for run in self._search_all(experiment_id, "attributes.status = 'RUNNING'"):
            token = run.data.tags.get(TAG_PROCESS)
            if token is not None and not writer_alive(token):
                self._client.set_terminated(run.info.run_id, status="KILLED")
                dead.append(run.info.run_id)
        if dead:
            logger.warning("marked %d run(s) KILLED whose writing process died: %s", len(dead), ", ".join(dead))
        return dead

    def find_unfinished_stage_run(self, experiment_id: str, stage: str, input_key: str) -> str | None:
        """The newest stage run for ``input_key`` that never finished (FAILED, KILLED, or RUNNING with a dead
        writer on this host): the one to finish rather than record the stage twice. None if there is none."""
        _check_name(stage, "stage")
        runs = self._client.search_runs(
            [experiment_id],
            filter_string=(
                f"tags.`{TAG_STAGE}` = '{stage}' and tags.`{TAG_INPUT_KEY}` = '{_quote(input_key)}' "
                "and attributes.status != 'FINISHED'"
            ),
            order_by=["attributes.start_time DESC"],
        )
        for run in runs:
            token = run.data.tags.get(TAG_PROCESS)
            if run.info.status != "RUNNING" or token is None or not writer_alive(token):
                return run.info.run_id
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
                if self.run_status(run_id) == "RUNNING":
                    self.end_run(run_id, status)
            except Exception as end_error:  # noqa: BLE001 - the original error matters; the next attempt reconciles
                logger.warning("could not mark run %s %s: %s", run_id, status, end_error)
            raise

    def _search_all(self, experiment_id: str, filter_string: str) -> Iterator[Run]:
        """Every run of the experiment matching ``filter_string``, page by page."""
        token = None
        while True:
            page = self._client.search_runs(
                [experiment_id], filter_string=filter_string, max_results=1000, page_token=token
            )
            yield from page
            token = page.token
            if not token:
                return

    def set_tags(self, run_id: str, tags: Mapping[str, object]) -> None:
        """Set tags on a run in one batch (values stringified)."""
        run_tags = [RunTag(key, str(value)) for key, value in tags.items()]
        for chunk in _chunks(run_tags, _PARAMS_PER_BATCH):
            self._client.log_batch(run_id, tags=chunk)

    def log_params(self, run_id: str, params: Mapping[str, object], *, skip_logged: bool = False) -> None:
        """Log params; nested dicts are flattened with dots (``ppo.clip_eps``), values stringified.

        MLflow accepts a param logged again with its value and refuses a new value; with ``skip_logged``,
        params the run already has are left as they are (a reopened run whose execution settings changed).
        """
        logged = self._client.get_run(run_id).data.params if skip_logged else {}
        entries = [Param(key, value) for key, value in _flatten(params) if key not in logged]
        for chunk in _chunks(entries, _PARAMS_PER_BATCH):
            self._client.log_batch(run_id, params=chunk)

    def log_metrics(
        self, run_id: str, metrics: Mapping[str, float], *, step: int | None = None, skip_logged: bool = False
    ) -> None:
        """Log metrics (named ``stage/metric`` by the caller) in one batch; values may be 0-d tensors.

        With ``skip_logged``, a metric whose latest value is already this one is not logged again (a run
        finished by a second attempt keeps one entry per metric).
        """
        timestamp = int(time.time() * 1000)
        logged = self._client.get_run(run_id).data.metrics if skip_logged else {}
        entries = [
            Metric(key, float(value), timestamp, step or 0)
            for key, value in metrics.items()
            if logged.get(key) != float(value)
        ]
        for chunk in _chunks(entries, _METRICS_PER_BATCH):
            self._client.log_batch(run_id, metrics=chunk)

    def log_metric_steps(self, run_id: str, prefix: str, rows: list[Mapping[str, float]]) -> None:
        """Log per-step curves: each row's values as ``prefix/name`` at the row's ``step``, in as few batches as
        MLflow takes (1000 values each). A run that already has them (a recording finished by a second attempt)
        gets none again."""
        logged = self._client.get_run(run_id).data.metrics
        if any(key.startswith(prefix + "/") for key in logged):
            return
        timestamp = int(time.time() * 1000)
        entries = [
            Metric(f"{prefix}/{name}", float(value), timestamp, int(row["step"]))
            for row in rows
            for name, value in row.items()
            if name != "step"
        ]
        for chunk in _chunks(entries, _METRICS_PER_BATCH):
            self._client.log_batch(run_id, metrics=chunk)

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """Mark a run terminated with ``status`` (FINISHED, FAILED or KILLED)."""
        RunStatus.from_string(status)
        self._client.set_terminated(run_id, status=status)

    def log_table(self, run_id: str, columns: Mapping[str, list], artifact_file: str) -> None:
        """Log a table (``{column: values}``) the MLflow UI shows in its artifact view and its evaluation tables;
        logging it again replaces it."""
        self._client.log_table(run_id, dict(columns), artifact_file)

    def log_figure(self, run_id: str, figure, artifact_file: str) -> None:
        """Log a matplotlib figure as an image artifact (PNG); logging it again replaces it."""
        self._client.log_figure(run_id, figure, artifact_file)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        """Store a small text artifact (e.g. the run's full config as JSON)."""
        self._client.log_text(run_id, text, artifact_file)

    def load_text(self, run_id: str, artifact_file: str) -> str:
        """Read back a text artifact stored with :meth:`log_text`."""
        with tempfile.TemporaryDirectory() as scratch:
            return Path(self._client.download_artifacts(run_id, artifact_file, dst_path=scratch)).read_text()

    def run_tags(self, run_id: str) -> dict[str, str]:
        """All tags of a run (``rlhf.*``, ``mlflow.parentRunId``, ...)."""
        return dict(self._client.get_run(run_id).data.tags)

    def run_status(self, run_id: str) -> str:
        """RUNNING, FINISHED, FAILED or KILLED."""
        return self._client.get_run(run_id).info.status

    def run_metrics(self, run_id: str) -> dict[str, float]:
        """The latest value of every metric of a run."""
        return dict(self._client.get_run(run_id).data.metrics)

    def find_run(self, experiment_id: str, *, tags: Mapping[str, str], status: str | None = None) -> str | None:
        """The newest run (by start time) carrying every tag in ``tags``, optionally with ``status``; None if none.

        Args:
            experiment_id: the experiment to search.
            tags: tag name -> exact value; all must match.
            status: e.g. ``FINISHED``; None accepts any status (a crashed run can be resumed).
        """
        clauses = [f"tags.`{key}` = '{_quote(value)}'" for key, value in tags.items()]
        if status is not None:
            RunStatus.from_string(status)
            clauses.append(f"attributes.status = '{status}'")
        runs = self._client.search_runs(
            [experiment_id],
            filter_string=" and ".join(clauses),
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        return runs[0].info.run_id if runs else None

    def runs(self, experiment_id: str, *, tags: Mapping[str, str]) -> list[RunSummary]:
        """Every run (any status) carrying every tag in ``tags``, page by page."""
        clauses = " and ".join(f"tags.`{key}` = '{_quote(value)}'" for key, value in tags.items())
        found, token = [], None
        while True:
            page = self._client.search_runs([experiment_id], filter_string=clauses, max_results=1000, page_token=token)
            found += [RunSummary(run.info.run_id, run.info.status, dict(run.data.tags)) for run in page]
            token = page.token
            if not token:
                return found

    def run_url(self, run_id: str) -> str:
        """The run's page in the MLflow UI (its machine-learning view: :data:`UI_RUNS_VIEW`)."""
        experiment_id = self._client.get_run(run_id).info.experiment_id
        return f"{self.ui_base}/#/experiments/{experiment_id}/runs/{run_id}?{UI_RUNS_VIEW}"

    def experiment_url(self, experiment_id: str) -> str:
        """The page listing the experiment's runs in the MLflow UI (:data:`UI_RUNS_VIEW`)."""
        return f"{self.ui_base}/#/experiments/{experiment_id}/runs?{UI_RUNS_VIEW}"

    # Stage outputs --------------------------------------------------------------------------------

    def log_datasets(self, run_id: str, stage_dir: Path, manifest: Manifest, *, context: str) -> None:
        """Log each Parquet table of a stage output as an MLflow dataset of the run.

        The dataset is named ``{stage}/{table}``; its digest is the first 32 hex characters of the
        sha256 over the table's shard sha256s (in shard order), so equal data gives equal digests.

        Args:
            run_id: the run.
            stage_dir: the stage output folder (the dataset source).
            manifest: its manifest.
            context: ``output`` for what the stage wrote, ``input`` for what it read.
        """
        tables: dict[str, list[str]] = {}
        for entry in manifest.files:
            match = _SHARD_FILE.fullmatch(entry.path)
            if match:
                tables.setdefault(match.group("table"), []).append(entry.sha256)
        inputs = []
        for table, hashes in sorted(tables.items()):
            digest = hashlib.sha256("".join(hashes).encode()).hexdigest()[:_DIGEST_LENGTH]
            source = LocalArtifactDatasetSource(str(Path(stage_dir).absolute() / table))
            dataset = MetaDataset(source=source, name=f"{manifest.stage}/{table}", digest=digest)
            inputs.append(DatasetInput(Dataset(**dataset.to_dict()), [InputTag(MLFLOW_DATASET_CONTEXT, context)]))
        if inputs:
            self._client.log_inputs(run_id, datasets=inputs)

    def log_stage_output(self, run_id: str, stage_dir: Path, manifest: Manifest) -> None:
        """Record a finished stage output on its run: artifacts, datasets and lookup tags.

        Uploads ``stage_dir`` as the run's ``output/`` artifacts (by reference: only its manifest,
        and the folder's path as the tag ``rlhf.output_path``), logs its tables as datasets
        (context ``output``), and tags the run with ``rlhf.stage``, ``rlhf.input_key`` and
        ``rlhf.manifest_digest``. End the run FINISHED afterwards so :meth:`find_stage_record` sees it.
        """
        tags = {TAG_STAGE: manifest.stage, TAG_INPUT_KEY: manifest.input_key, TAG_MANIFEST_DIGEST: manifest.digest}
        if self.outputs_by_reference:
            self._client.log_artifact(run_id, str(Path(stage_dir) / MANIFEST_FILE), artifact_path=OUTPUT_ARTIFACT_PATH)
            tags[TAG_OUTPUT_PATH] = str(Path(stage_dir).absolute())
        else:
            self._client.log_artifacts(run_id, str(stage_dir), artifact_path=OUTPUT_ARTIFACT_PATH)
        self.log_datasets(run_id, stage_dir, manifest, context="output")
        self.set_tags(run_id, tags)

    def clear_stage_output(self, run_id: str) -> None:
        """Delete a run's ``output/`` artifacts: what an interrupted copy left, before copying them again."""
        repository = get_artifact_repository(self._client.get_run(run_id).info.artifact_uri)
        with contextlib.suppress(FileNotFoundError, OSError):
            repository.delete_artifacts(OUTPUT_ARTIFACT_PATH)

    def find_stage_record(self, experiment_id: str, stage: str, input_key: str) -> StageRecord | None:
        """The newest FINISHED run of ``stage`` tagged with ``input_key``, or None."""
        _check_name(stage, "stage")
        if not re.fullmatch(r"[0-9a-f]+", input_key):
            raise ValueError(f"`input_key` must be a hex digest, got {input_key!r}")
        runs = self._client.search_runs(
            [experiment_id],
            filter_string=(
                f"tags.`{TAG_STAGE}` = '{stage}' and tags.`{TAG_INPUT_KEY}` = '{input_key}' "
                "and attributes.status = 'FINISHED'"
            ),
            order_by=["attributes.end_time DESC"],
            max_results=1,
        )
        if not runs:
            return None
        run = runs[0]
        return StageRecord(
            run_id=run.info.run_id,
            input_key=input_key,
            manifest_digest=run.data.tags.get(TAG_MANIFEST_DIGEST, ""),
            artifact_uri=run.info.artifact_uri,
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
        referenced = self._client.get_run(run_id).data.tags.get(TAG_OUTPUT_PATH)
        if referenced is not None:
            return self._copy_referenced(run_id, Path(referenced), destination)
        destination.parent.mkdir(parents=True, exist_ok=True)
        staging = temporary_sibling(destination, what=".download-")
        staging.mkdir()
        try:
            downloaded = Path(self._client.download_artifacts(run_id, OUTPUT_ARTIFACT_PATH, dst_path=str(staging)))
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

    # Campaign state and models ----------------------------------------------------------------------

    def finished_iterations(self, experiment_id: str) -> dict[int, RunSummary]:
        """The campaign's finished iterations: ``{iteration: its run}``, the newest FINISHED iteration run of each
        number that no later run superseded (``rlhf.superseded_by``). The one query of "the finished run of
        iteration N"."""
        return {
            number: RunSummary(run.info.run_id, run.info.status, dict(run.data.tags))
            for number, run in self._finished_iteration_runs(experiment_id).items()
        }

    def _finished_iteration_runs(self, experiment_id: str) -> dict[int, Run]:
        newest: dict[int, Run] = {}
        for run in self._search_all(
            experiment_id, f"tags.`{TAG_KIND}` = '{KIND_ITERATION}' and attributes.status = 'FINISHED'"
        ):
            value = run.data.tags.get(TAG_ITERATION)
            if value is None or not re.fullmatch(r"-?\d+", value) or TAG_SUPERSEDED_BY in run.data.tags:
                continue
            if int(value) not in newest or run.info.start_time > newest[int(value)].info.start_time:
                newest[int(value)] = run
        return dict(sorted(newest.items()))

    def iteration_metrics(self, experiment_id: str) -> list[tuple[int, dict[str, float]]]:
        """``(iteration, metrics)`` of every finished iteration (:meth:`finished_iterations`), by iteration."""
        return [
            (number, dict(run.data.metrics)) for number, run in self._finished_iteration_runs(experiment_id).items()
        ]

    def latest_iteration(self, experiment_id: str) -> int | None:
        """The highest finished iteration (:meth:`finished_iterations`) of the experiment, or None."""
        return max(self.finished_iterations(experiment_id), default=None)

    def register_model(self, run_id: str, *, name: str, stage_dir: Path, subfolder: str, alias: str = "latest") -> str:
        """Register the folder ``subfolder`` (e.g. ``actor``) of a stage output recorded on ``run_id`` as a new
        version, once: a run registered already under ``name`` with this source keeps its version.

        The version's source is the folder itself when outputs are recorded by reference, else the
        run's artifact ``output/<subfolder>``.

        Args:
            run_id: the stage run that recorded the output.
            name: the registered model (created if missing).
            stage_dir: the stage output folder.
            subfolder: the model's folder inside it.
            alias: moved to the new version (``latest``, reserved by MLflow, always means the newest).

        Returns:
            The new version number (a string, as MLflow gives it).
        """
        try:
            self._client.create_registered_model(name)
        except MlflowException as error:
            if _error_code(error) != "RESOURCE_ALREADY_EXISTS" and not self._model_exists(name):
                raise
        if self.outputs_by_reference:
            source = (Path(stage_dir).absolute() / subfolder).as_uri()
        else:
            artifact_uri = self._client.get_run(run_id).info.artifact_uri.rstrip("/")
            source = f"{artifact_uri}/{OUTPUT_ARTIFACT_PATH}/{subfolder.strip('/')}"
        existing = self._client.search_model_versions(f"name = '{_quote(name)}' and run_id = '{_quote(run_id)}'")
        same = [v for v in existing if v.source == source]
        version = same[0].version if same else self._client.create_model_version(name, source, run_id=run_id).version
        # MLflow reserves `latest` and always resolves it to the newest version, which this one now is.
        if alias.lower() != _LATEST:
            self._client.set_registered_model_alias(name, alias, version)
        return str(version)

    def model_versions(self, name: str) -> list[ModelVersionSummary]:
        """Every version of the registered model ``name`` (none when it does not exist)."""
        if not self._model_exists(name):
            return []
        # Version search results carry no aliases in MLflow 3; the registered model has them all.
        aliases: dict[str, list[str]] = {}
        for alias, version in self._client.get_registered_model(name).aliases.items():
            aliases.setdefault(str(version), []).append(alias)
        return [
            ModelVersionSummary(str(v.version), v.run_id, v.source, tuple(sorted(aliases.get(str(v.version), []))))
            for v in self._client.search_model_versions(f"name = '{_quote(name)}'")
        ]

    def delete_model_version(self, name: str, version: str) -> None:
        """Delete one version of a registered model."""
        self._client.delete_model_version(name, version)

    def _model_exists(self, name: str) -> bool:
        try:
            self._client.get_registered_model(name)
        except MlflowException:
            return False
        return True


@functools.lru_cache(maxsize=4)
def open_tracker(uri: str, artifact_root: str | None, ui_base: str | None = None) -> Tracker:
    """The :class:`Tracker` of a store: one per store and process, whoever asks (a flow and the stages it runs
    share it). Opening one is not free: MLflow checks a SQLite store's schema, about a second here."""
    return Tracker(uri, artifact_root=None if artifact_root is None else Path(artifact_root), ui_base=ui_base)
