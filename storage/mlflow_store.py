"""MLflow behind a small adapter: the only first-party module that imports mlflow.

:class:`MlflowStore` offers generic record operations (experiments, runs, tags, params, metrics,
artifacts, datasets, registered models) in the project's own terms: ids are strings and what comes
back is a plain dataclass (:class:`RunSummary`, :class:`ModelVersionSummary`), never an MLflow
entity or exception. What the records *mean* (campaigns, iterations, stage outputs, writers) is
:mod:`storage.tracking`'s, built on top.

Choices:

1. An ``MlflowClient`` with explicit run ids; the fluent API's global active run is never used, so
   threads and Prefect task runners cannot mix runs up.
2. The tracking URI is given once, to the constructor; it is also the model registry URI. Creating
   or migrating a fresh SQLite store from several processes at once can fail ("duplicate column"),
   so the first touch of the store happens under an exclusive ``fcntl`` lock on ``<db>.lock``. A new SQLite store
   starts as a copy of an empty one migrated once per MLflow version and kept in :func:`cache_dir`: MLflow's schema
   migrations take seconds (tens on a busy machine), a copy milliseconds. The copy holds no experiment, so MLflow
   makes its Default experiment on the first open, where and when a fresh store would have it.
3. Experiments are created with an explicit artifact location (``artifact_root/<name>``), so
   artifacts do not depend on the working directory; on a tracking server (an ``http(s)://`` URI)
   the server decides (its ``--artifacts-destination``), and an artifact root is refused.
4. Tags, params and metrics go through ``log_batch``, in MLflow's batch sizes (about 100x faster
   than one call per value on SQLite).
5. MLflow's own rules live here and nowhere else: the length limits of params and dataset digests,
   the reserved ``latest`` alias, the experiment type its UI reads, and its UI's addresses.
6. Searches match exact tag values; a value holding a quote or a backslash is refused, not escaped.
7. A logged model (MLflow 3's ``LoggedModel``, what its UI's *Models* tab lists) is an *external* model, MLflow's
   documented way for weights stored elsewhere (``mlflow.create_external_model``): tagged ``mlflow.model.isExternal``,
   holding only the ``MLmodel`` file MLflow writes for one, and READY at once. Its weights stay where its run
   recorded them (once, not a second 14 GB copy per checkpoint), which its tags say; ``models:/<model_id>`` resolves
   and registers with MLflow's own ``register_model`` (issue 42: it held no artifacts and did neither). A version
   the pipeline registers keeps the weights as its source, so ``models:/<name>/<version>`` downloads them, and is
   linked to its logged model the way ``register_model`` links them (the model's ``mlflow.modelVersions`` tag), so
   the model's page names its versions. (A version keeps a ``model_id`` of its own only when its source is
   ``models:/<model_id>``, which here would download an ``MLmodel`` file and no weights.)

Environment: ``RLHF_CACHE_DIR`` moves :func:`cache_dir` (tests point it into their temporary folder); nothing else
is read or set here. Set ``MLFLOW_DISABLE_TELEMETRY=true`` in the environment of offline machines (tests do it in
``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import mlflow
from mlflow.data.meta_dataset import MetaDataset
from mlflow.data.sources import LocalArtifactDatasetSource
from mlflow.entities import (
    Dataset,
    DatasetInput,
    InputTag,
    LoggedModel,
    LoggedModelOutput,
    Metric,
    Param,
    Run,
    RunStatus,
    RunTag,
)
from mlflow.exceptions import MlflowException
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import (
    MLFLOW_DATASET_CONTEXT,
    MLFLOW_MODEL_IS_EXTERNAL,
    MLFLOW_MODEL_VERSIONS,
    MLFLOW_PARENT_RUN_ID,
)

from storage.files import cache_dir

__all__ = [
    "DEFAULT_UI_BASE",
    "TAG_PARENT_RUN_ID",
    "UI_RUNS_VIEW",
    "LocalDataset",
    "LoggedModelSummary",
    "MlflowStore",
    "ModelMetric",
    "ModelVersionSummary",
    "RunSummary",
]

TAG_PARENT_RUN_ID = MLFLOW_PARENT_RUN_ID
"""The tag MLflow nests a run under its parent with (``mlflow.parentRunId``)."""
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

_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
_RUNS_PER_PAGE = 1000
_MAX_PARAM_LENGTH = 6000
_DIGEST_LENGTH = 32  # MLflow stores dataset digests in 36 characters
_LATEST = "latest"
_NO_SUCH_RUN = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


@dataclass(frozen=True)
class RunSummary:
    """A run as the store holds it.

    Args:
        run_id: the run.
        status: RUNNING, FINISHED, FAILED or KILLED.
        tags: every tag (``rlhf.*``, ``mlflow.parentRunId``, ...).
        start_time: when it was created, in milliseconds since the epoch.
        artifact_uri: the root of its artifacts.
        metrics: the latest value of each of its metrics.
    """

    run_id: str
    status: str
    tags: dict[str, str]
    start_time: int
    artifact_uri: str
    metrics: dict[str, float]


@dataclass(frozen=True)
class ModelVersionSummary:
    """A registered model version: its number, the run that made it, its source and aliases."""

    version: str
    run_id: str
    source: str
    aliases: tuple[str, ...]


@dataclass(frozen=True)
class LocalDataset:
    """A table on local disk a run read or wrote: its name, a digest of its content (hex) and its folder."""

    name: str
    digest: str
    path: Path


@dataclass(frozen=True)
class ModelMetric:
    """A metric logged with a model: its value, the dataset it was computed on (name and digest, or None) and the
    run that logged it."""

    key: str
    value: float
    dataset_name: str | None
    dataset_digest: str | None
    run_id: str | None


@dataclass(frozen=True)
class LoggedModelSummary:
    """A logged model as the store holds it: its id, name, the run that made it, tags, params, metrics and the
    registered versions made from it (``(name, version)``)."""

    model_id: str
    name: str
    source_run_id: str | None
    tags: dict[str, str]
    params: dict[str, str]
    metrics: tuple[ModelMetric, ...]
    versions: tuple[tuple[str, str], ...]


def _model_summary(model: LoggedModel) -> LoggedModelSummary:
    versions = json.loads(model.tags.get(MLFLOW_MODEL_VERSIONS, "[]"))
    return LoggedModelSummary(
        model_id=model.model_id,
        name=model.name,
        source_run_id=model.source_run_id,
        tags=dict(model.tags),
        params=dict(model.params),
        metrics=tuple(
            ModelMetric(m.key, m.value, m.dataset_name, m.dataset_digest, m.run_id) for m in model.metrics or ()
        ),
        versions=tuple((str(v["name"]), str(v["version"])) for v in versions),
    )


def _summary(run: Run) -> RunSummary:
    return RunSummary(
        run_id=run.info.run_id,
        status=run.info.status,
        tags=dict(run.data.tags),
        start_time=int(run.info.start_time or 0),
        artifact_uri=run.info.artifact_uri,
        metrics=dict(run.data.metrics),
    )


def _quote(value: object) -> str:
    """A value for a single-quoted search filter literal; quotes and backslashes are refused."""
    text = str(value)
    if "'" in text or "\\" in text:
        raise ValueError(f"search values must not contain quotes or backslashes, got {text!r}")
    return text


def _check_status(status: str) -> str:
    known = [RunStatus.to_string(value) for value in RunStatus.all_status()]
    if status not in known:
        raise ValueError(f"`status` must be one of {', '.join(known)}, got {status!r}")
    return status


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


def _sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, None for anything else (servers, in-memory)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path = tracking_uri[len("sqlite:///") :].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


def _empty_store() -> Path:
    """An empty SQLite store migrated to this MLflow's schema, without MLflow's Default experiment: made once per MLflow
    version (in a temporary file, then renamed, so a reader never sees half of one)."""
    template = cache_dir() / f"mlflow-{mlflow.__version__}-empty.db"
    if not template.exists():
        template.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=template.parent) as scratch:
            database = Path(scratch) / "empty.db"
            uri = f"sqlite:///{database}"
            client = MlflowClient(tracking_uri=uri, registry_uri=uri)
            client.search_registered_models(max_results=1)
            with contextlib.closing(sqlite3.connect(database)) as connection, connection:
                connection.execute("DELETE FROM experiments")
            os.replace(database, template)
    return template


def _create_sqlite_store(database: Path) -> None:
    """``database`` as a copy of :func:`_empty_store` (under a temporary name, then renamed); left to MLflow to make
    where the cache cannot be written."""
    try:
        template = _empty_store()
    except OSError:
        return
    database.parent.mkdir(parents=True, exist_ok=True)
    partial = database.with_name(f".{database.name}.{os.getpid()}.partial")
    try:
        shutil.copyfile(template, partial)
        os.replace(partial, database)
    finally:
        partial.unlink(missing_ok=True)


class MlflowStore:
    """One MLflow tracking store and its model registry, opened once.

    Args:
        tracking_uri: where runs are recorded, e.g. ``RunLayout.tracking_uri()`` or a server URL.
            It is also the model registry URI.
        artifact_root: where new experiments keep their artifacts (``artifact_root/<name>``);
            None leaves it to the tracking server or MLflow's default.
        ui_base: the MLflow UI address used by :meth:`run_url` and :meth:`experiment_url`; None: the tracking
            server itself for an ``http(s)`` URI, else :data:`DEFAULT_UI_BASE`.
    """

    def __init__(self, tracking_uri: str, *, artifact_root: Path | None = None, ui_base: str | None = None) -> None:
        if artifact_root is not None and tracking_uri.startswith(("http://", "https://")):
            raise ValueError(
                f"a tracking server ({tracking_uri}) keeps artifacts where its --artifacts-destination says: "
                "pass no artifact_root"
            )
        self.tracking_uri = tracking_uri
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
            if database is not None and not database.exists():
                _create_sqlite_store(database)
            # Building the client migrates a SQLite store of an older MLflow; do it while holding the lock, and touch
            # the registry too, which has its own store object.
            self._client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
            self._client.search_experiments(max_results=1)
            self._client.search_registered_models(max_results=1)

    # Experiments ----------------------------------------------------------------------------------

    def has_experiment(self, name: str) -> bool:
        """Whether the store holds an experiment named ``name`` (active or deleted)."""
        return self._client.get_experiment_by_name(name) is not None

    def ensure_experiment(self, name: str) -> str:
        """The id of the experiment ``name``, created (with its artifact location) if missing.

        Two processes creating it at once both get the same id.

        Raises:
            ValueError: the experiment is deleted.
        """
        experiment = self._client.get_experiment_by_name(name)
        if experiment is None:
            location = None if self.artifact_root is None else (self.artifact_root / name).as_uri()
            try:
                return self._client.create_experiment(
                    name, artifact_location=location, tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND}
                )
            except MlflowException:
                experiment = self._client.get_experiment_by_name(name)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage != "active":
            raise ValueError(f"experiment {name!r} is deleted; restore it in MLflow or delete it permanently")
        if TAG_EXPERIMENT_KIND not in experiment.tags:  # made before the type was set, or by MLflow itself
            self._client.set_experiment_tag(experiment.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND)
        return experiment.experiment_id

    def experiment_tags(self, name: str) -> dict[str, str]:
        """The tags of the experiment ``name``; empty when it does not exist (nothing is created)."""
        experiment = self._client.get_experiment_by_name(name)
        return {} if experiment is None else dict(experiment.tags)

    def set_experiment_tags(self, experiment_id: str, tags: Mapping[str, str]) -> None:
        """Set tags on an experiment."""
        for key, value in tags.items():
            self._client.set_experiment_tag(experiment_id, key, value)

    def experiment_url(self, experiment_id: str) -> str:
        """The page listing the experiment's runs in the MLflow UI (:data:`UI_RUNS_VIEW`)."""
        return f"{self.ui_base}/#/experiments/{experiment_id}/runs?{UI_RUNS_VIEW}"

    # Runs -----------------------------------------------------------------------------------------

    def create_run(
        self, experiment_id: str, *, name: str, tags: Mapping[str, object], parent_run_id: str | None = None
    ) -> str:
        """Create a RUNNING run (nested under ``parent_run_id`` when given); its id. Tag values are stringified."""
        run_tags = {key: str(value) for key, value in tags.items()}
        if parent_run_id is not None:
            run_tags[TAG_PARENT_RUN_ID] = parent_run_id
        return self._client.create_run(experiment_id, run_name=name, tags=run_tags).info.run_id

    def mark_running(self, run_id: str) -> None:
        """Make a terminated run RUNNING again."""
        self._client.update_run(run_id, status="RUNNING")

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """Mark a run terminated with ``status`` (FINISHED, FAILED or KILLED)."""
        self._client.set_terminated(run_id, status=_check_status(status))

    def run(self, run_id: str) -> RunSummary:
        """The run ``run_id``.

        Raises:
            LookupError: the store has no such run, or ``run_id`` is not a run id.
        """
        try:
            return _summary(self._client.get_run(run_id))
        except MlflowException as error:
            if str(error.error_code) not in _NO_SUCH_RUN:
                raise
            raise LookupError(f"no run {run_id!r} in the MLflow store {self.tracking_uri}") from error

    def runs(
        self,
        experiment_id: str,
        *,
        tags: Mapping[str, str] | None = None,
        status: str | None = None,
        newest_by: Literal["start_time", "end_time"] | None = None,
        max_results: int | None = None,
    ) -> list[RunSummary]:
        """The runs of an experiment carrying every tag in ``tags``, page by page.

        Args:
            experiment_id: the experiment to search.
            tags: tag name -> exact value; all must match (None: any run).
            status: e.g. ``FINISHED``; None accepts any status.
            newest_by: order the runs newest first by this time; None: MLflow's order.
            max_results: at most this many runs (one query); None: all of them.
        """
        clauses = [f"tags.`{key}` = '{_quote(value)}'" for key, value in (tags or {}).items()]
        if status is not None:
            clauses.append(f"attributes.status = '{_check_status(status)}'")
        order_by = None if newest_by is None else [f"attributes.{newest_by} DESC"]
        found: list[RunSummary] = []
        token = None
        while True:
            page = self._client.search_runs(
                [experiment_id],
                filter_string=" and ".join(clauses),
                order_by=order_by,
                max_results=max_results or _RUNS_PER_PAGE,
                page_token=token,
            )
            found += [_summary(run) for run in page]
            token = page.token
            if max_results is not None or not token:
                return found

    def find_run(self, experiment_id: str, *, tags: Mapping[str, str], status: str | None = None) -> str | None:
        """The newest run (by start time) carrying every tag in ``tags``, optionally with ``status``; None if none.

        Args:
            experiment_id: the experiment to search.
            tags: tag name -> exact value; all must match.
            status: e.g. ``FINISHED``; None accepts any status (a crashed run can be resumed).
        """
        runs = self.runs(experiment_id, tags=tags, status=status, newest_by="start_time", max_results=1)
        return runs[0].run_id if runs else None

    def run_url(self, run_id: str) -> str:
        """The run's page in the MLflow UI (its machine-learning view: :data:`UI_RUNS_VIEW`)."""
        experiment_id = self._client.get_run(run_id).info.experiment_id
        return f"{self.ui_base}/#/experiments/{experiment_id}/runs/{run_id}?{UI_RUNS_VIEW}"

    # Tags, params and metrics ---------------------------------------------------------------------

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

    def log_metric_steps(
        self, run_id: str, prefix: str, rows: list[Mapping[str, float]], *, skip_logged: bool = True
    ) -> None:
        """Log per-step curves: each row's values as ``prefix/name`` at the row's ``step``, in as few batches as
        MLflow takes (1000 values each). With ``skip_logged``, a run that already has them (a recording finished by a
        second attempt) gets none again; without, a run just started is not read first."""
        logged = self._client.get_run(run_id).data.metrics if skip_logged else {}
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

    # Artifacts and datasets -----------------------------------------------------------------------

    def log_artifact(self, run_id: str, file: Path, *, artifact_path: str) -> None:
        """Copy one file into the run's artifacts, under ``artifact_path``."""
        self._client.log_artifact(run_id, str(file), artifact_path=artifact_path)

    def log_artifacts(self, run_id: str, folder: Path, *, artifact_path: str) -> None:
        """Copy a folder's files into the run's artifacts, under ``artifact_path``."""
        self._client.log_artifacts(run_id, str(folder), artifact_path=artifact_path)

    def delete_artifacts(self, run_id: str, artifact_path: str) -> None:
        """Delete the run's artifacts under ``artifact_path``; nothing happens when there are none."""
        repository = get_artifact_repository(self._client.get_run(run_id).info.artifact_uri)
        with contextlib.suppress(FileNotFoundError, OSError):
            repository.delete_artifacts(artifact_path)

    def download_artifacts(self, run_id: str, artifact_path: str, destination: Path) -> Path:
        """Download the run's artifacts under ``artifact_path`` into the folder ``destination``; their local path."""
        return Path(self._client.download_artifacts(run_id, artifact_path, dst_path=str(destination)))

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        """Store a small text artifact (e.g. the run's full config as JSON)."""
        self._client.log_text(run_id, text, artifact_file)

    def load_text(self, run_id: str, artifact_file: str) -> str:
        """Read back a text artifact stored with :meth:`log_text`."""
        with tempfile.TemporaryDirectory() as scratch:
            return self.download_artifacts(run_id, artifact_file, Path(scratch)).read_text()

    def log_table(self, run_id: str, columns: Mapping[str, list], artifact_file: str) -> None:
        """Log a table (``{column: values}``) the MLflow UI shows in its artifact view and its evaluation tables;
        logging it again replaces it."""
        self._client.log_table(run_id, dict(columns), artifact_file)

    def log_bytes(self, run_id: str, data: bytes, artifact_file: str) -> None:
        """Log ``data`` as the artifact file ``artifact_file`` (an image the UI shows by its suffix: a PNG figure);
        logging it again replaces it."""
        with tempfile.TemporaryDirectory() as scratch:
            path = Path(scratch) / Path(artifact_file).name
            path.write_bytes(data)
            folder = str(Path(artifact_file).parent)
            self.log_artifact(run_id, path, artifact_path=None if folder == "." else folder)

    def log_datasets(self, run_id: str, datasets: list[LocalDataset], *, context: str) -> None:
        """Log tables as MLflow datasets of the run, each tagged with ``context`` (``output``: what the run wrote,
        ``input``: what it read). A digest is kept to its first 32 hex characters, as many as MLflow stores."""
        inputs = [
            DatasetInput(
                Dataset(
                    **MetaDataset(
                        source=LocalArtifactDatasetSource(str(dataset.path)),
                        name=dataset.name,
                        digest=dataset.digest[:_DIGEST_LENGTH],
                    ).to_dict()
                ),
                [InputTag(MLFLOW_DATASET_CONTEXT, context)],
            )
            for dataset in datasets
        ]
        if inputs:
            self._client.log_inputs(run_id, datasets=inputs)

    # Registered models ----------------------------------------------------------------------------

    def register_version(
        self, name: str, source: str, *, run_id: str, alias: str = _LATEST, model_id: str | None = None
    ) -> str:
        """Register ``source`` as a new version of the model ``name`` (created if missing), made by ``run_id``,
        once: a version of that run with that source is kept. ``alias`` is moved to it.

        Args:
            name: the registered model.
            source: the version's folder (a URI).
            run_id: the run that made it.
            alias: moved to the version; ``latest``, reserved by MLflow, always means the newest.
            model_id: the logged model the version is made from, linked to it (choice 7), or None.

        Returns:
            The version number (a string, as MLflow gives it).
        """
        try:
            self._client.create_registered_model(name)
        except MlflowException as error:
            if str(error.error_code) != "RESOURCE_ALREADY_EXISTS" and not self._model_exists(name):
                raise
        existing = self._client.search_model_versions(f"name = '{_quote(name)}' and run_id = '{_quote(run_id)}'")
        same = [v for v in existing if v.source == source]
        version = str(
            same[0].version if same else self._client.create_model_version(name, source, run_id=run_id).version
        )
        if model_id is not None:
            self._link_version(model_id, name, version)
        # MLflow reserves `latest` and always resolves it to the newest version, which this one now is.
        if alias.lower() != _LATEST:
            self.set_alias(name, alias, version)
        return version

    def set_alias(self, name: str, alias: str, version: str) -> None:
        """Point the alias ``alias`` of the registered model ``name`` at ``version`` (moving it from any other)."""
        self._client.set_registered_model_alias(name, alias, version)

    def _link_version(self, model_id: str, name: str, version: str) -> None:
        """Name the version on the logged model it was made from, as MLflow's ``register_model`` does (once)."""
        linked = list(self.logged_model(model_id).versions)
        if (name, version) not in linked:
            entries = [{"name": n, "version": v} for n, v in [*linked, (name, version)]]
            self._client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(entries)})

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

    # Logged models --------------------------------------------------------------------------------

    def create_logged_model(
        self,
        experiment_id: str,
        *,
        name: str,
        run_id: str,
        tags: Mapping[str, object],
        params: Mapping[str, object],
        model_type: str,
    ) -> str:
        """A new READY external logged model made by ``run_id`` (an output of the run, so its page lists it; choice
        7); its id.

        Args:
            experiment_id: the experiment it belongs to.
            name: its name (``actor``, ``critic``, ``reward_model``).
            run_id: the run that made it.
            tags: tag name -> value (stringified).
            params: param name -> value (stringified, flattened like :meth:`log_params`).
            model_type: what kind of model it is, shown in the UI.
        """
        from mlflow.models.model import MLMODEL_FILE_NAME
        from mlflow.models.utils import get_external_mlflow_model_spec

        model = self._client.create_logged_model(
            experiment_id,
            name=name,
            source_run_id=run_id,
            tags={**{key: str(value) for key, value in tags.items()}, MLFLOW_MODEL_IS_EXTERNAL: "true"},
            params=dict(_flatten(params)),
            model_type=model_type,
        )
        with tempfile.TemporaryDirectory() as folder:  # what MLflow's create_external_model logs (choice 7)
            get_external_mlflow_model_spec(model).save(os.path.join(folder, MLMODEL_FILE_NAME))
            self._client.log_model_artifacts(model.model_id, folder)
        self._client.finalize_logged_model(model.model_id, "READY")
        self._client.log_outputs(run_id, models=[LoggedModelOutput(model.model_id, 0)])
        return model.model_id

    def logged_model(self, model_id: str) -> LoggedModelSummary:
        """The logged model ``model_id``."""
        return _model_summary(self._client.get_logged_model(model_id))

    def logged_models(
        self,
        experiment_id: str,
        *,
        name: str | None = None,
        tags: Mapping[str, str] | None = None,
        run_id: str | None = None,
        best_by: str | None = None,
        dataset: tuple[str, str] | None = None,
    ) -> list[LoggedModelSummary]:
        """The experiment's logged models matching every given filter, page by page.

        Args:
            experiment_id: the experiment to search.
            name: only models of this name.
            tags: tag name -> exact value; all must match.
            run_id: only models this run made.
            best_by: order by this metric, highest first (the newer of equals first), counting only values logged
                on ``dataset``.
            dataset: ``(name, digest)`` of the dataset ``best_by`` is read on.
        """
        clauses = [f"tags.`{key}` = '{_quote(value)}'" for key, value in (tags or {}).items()]
        if name is not None:
            clauses.append(f"name = '{_quote(name)}'")
        if run_id is not None:
            clauses.append(f"source_run_id = '{_quote(run_id)}'")
        order_by = None
        if best_by is not None:
            order = {"field_name": f"metrics.{best_by}", "ascending": False}
            if dataset is not None:
                order |= {"dataset_name": dataset[0], "dataset_digest": dataset[1][:_DIGEST_LENGTH]}
            order_by = [order, {"field_name": "creation_timestamp", "ascending": False}]  # a tie: the newer
        found: list[LoggedModelSummary] = []
        token = None
        while True:
            page = self._client.search_logged_models(
                [experiment_id],
                filter_string=" AND ".join(clauses) or None,
                order_by=order_by,
                max_results=_RUNS_PER_PAGE,
                page_token=token,
            )
            found += [_model_summary(model) for model in page]
            token = page.token
            if not token:
                return found

    def log_model_metrics(
        self, run_id: str, model_id: str, metrics: Mapping[str, float], *, dataset: tuple[str, str], step: int = 0
    ) -> None:
        """Log metrics on ``run_id`` as computed by the model ``model_id`` on ``dataset`` (``(name, digest)``; the
        digest kept to as many characters as MLflow stores), in one batch. A metric the model already has on that
        dataset is not logged again (a recording finished by a second attempt)."""
        name, digest = dataset[0], dataset[1][:_DIGEST_LENGTH]
        logged = {(m.key, m.dataset_name, m.dataset_digest) for m in self.logged_model(model_id).metrics}
        timestamp = int(time.time() * 1000)
        entries = [
            Metric(key, float(value), timestamp, step, model_id=model_id, dataset_name=name, dataset_digest=digest)
            for key, value in metrics.items()
            if (key, name, digest) not in logged
        ]
        for chunk in _chunks(entries, _METRICS_PER_BATCH):
            self._client.log_batch(run_id, metrics=chunk)

    def models_url(self, experiment_id: str) -> str:
        """The experiment's *Models* tab in the MLflow UI: its logged models with their metrics."""
        return f"{self.ui_base}/#/experiments/{experiment_id}/models?{UI_RUNS_VIEW}"

    def _model_exists(self, name: str) -> bool:
        try:
            self._client.get_registered_model(name)
        except MlflowException:
            return False
        return True
