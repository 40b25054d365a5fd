"""What a rerun checks of a campaign's history: every recorded output of its finished iterations, against the
digest its stage run recorded, before anything runs.

A finished iteration is never computed again (:mod:`campaign.history`), so no stage reads its outputs on a rerun,
and an output truncated, altered or removed since would go unseen until a replay, an export or the next iteration
read it. ``rlhf run`` checks them all first (:func:`check_finished_outputs`).

Choices:
1. An output in place is verified as a stage verifies an output it reuses (:func:`storage.manifest.read_manifest`:
   the manifest's own checksum, files inside its folder only, every listed file's size and sha256, no unlisted
   file). Its manifest's digest must also be the one MLflow recorded for its stage run, so a manifest re-signed to
   list other files is refused too.
2. The sha256s come from the run root's fingerprint cache (:mod:`storage.fingerprints`), by size and modification
   time: a rerun of an unchanged run root reads no output's bytes again, only their sizes and times.
3. A corrupt output is refused in one line naming the file and what to do, and nothing is written.
4. A missing output the campaign still needs is restored from MLflow's copy where the store keeps one (a tracking
   server keeps every output's files; a local store keeps only their manifests, the files where they are), and
   refused in one line where none exists. What the campaign needs is what ``rlhf gc`` always keeps: the outputs
   of its newest finished iteration and the outputs they were computed from. Any other output ``rlhf gc`` removed
   (its stage run is tagged ``rlhf.removed_by_gc``; MLflow keeps the run and its metrics) is not restored: that
   would undo it. An output missing without that tag was removed by something else (``rm -r``, a disk lost), and
   is restored or refused like one the campaign needs; but in a campaign older than the tag (its experiment has
   no ``rlhf.gc_records``), whose gc recorded nothing, it is taken to be gc's, as it was then.
5. Superseded iterations and replays are not the campaign's history: they are not checked.

Nothing here imports torch or Prefect: the rerun of a finished campaign stays a few seconds
(:func:`campaign.history.campaign_finished`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from campaign.config import PipelineConfig
from campaign.identity import fingerprint_cache
from campaign.store import campaign_layout, store_tracker
from storage.fingerprints import FingerprintCache
from storage.manifest import MANIFEST_FILE, CorruptOutputError, Manifest, UnsupportedSchemaError, read_manifest
from storage.mlflow_store import RunSummary
from storage.tracking import (
    KIND_STAGE,
    TAG_GC_RECORDS,
    TAG_INPUT_KEY,
    TAG_KIND,
    TAG_MANIFEST_DIGEST,
    TAG_OUTPUT_PATH,
    TAG_OUTPUT_PREFIX,
    TAG_PARENT_RUN_ID,
    TAG_REMOVED_BY_GC,
    TAG_STAGE,
    MissingOutputError,
    Tracker,
)


@dataclass(frozen=True)
class RecordedOutput:
    """A stage output a finished iteration used, as its stage run recorded it.

    Args:
        run: the stage run that recorded it.
        folder: where the campaign keeps it (``<run root>/<campaign>/<stage>/<input key>``).
        iterations: the finished iterations that used it, in order (an iteration whose stage found the output of
            the same inputs recorded already reused it).
    """

    run: RunSummary
    folder: Path
    iterations: tuple[int, ...]

    @property
    def name(self) -> str:
        """``{folder} (the {stage} output of iteration N)``: how a message names it, by the first iteration."""
        return f"{self.folder} (the {self.run.tags[TAG_STAGE]} output of iteration {self.iterations[0]})"

    @property
    def copied(self) -> bool:
        """Whether MLflow keeps a copy of its files: uploaded to a tracking server, or (a local store, which records
        an output by reference) a folder elsewhere than this one, as when the run root was copied."""
        referenced = self.run.tags.get(TAG_OUTPUT_PATH)
        return referenced is None or (Path(referenced) != self.folder and Path(referenced).is_dir())


def check_finished_outputs(
    config: PipelineConfig,
    finished: dict[int, RunSummary],
    *,
    below: int | None = None,
    every_byte: bool = False,
    checked: list[tuple[RecordedOutput, Manifest]] | None = None,
) -> list[str]:
    """Check every output ``config``'s campaign's ``finished`` iterations recorded, and restore a missing one the
    campaign needs from MLflow's copy (module docstring). Reads no output's bytes that the run root's fingerprint
    cache already knows.

    Args:
        finished: the campaign's finished iterations (:func:`campaign.history.finished_iterations`).
        below: check only the iterations before this one (``rlhf run --from-iteration N`` recomputes the others).
        every_byte: hash every file, trusting no fingerprint remembered (``rlhf verify``); nothing is restored then,
            a missing output is refused.
        checked: where to add every output verified, with its manifest.

    Returns:
        One line per output restored.

    Raises:
        CorruptOutputError: an output does not match its manifest, or its manifest not the digest MLflow recorded;
            the message names the file and what to do.
        MissingOutputError: an output the campaign needs is missing, and MLflow keeps no copy of it.
    """
    finished = {number: run for number, run in finished.items() if below is None or number < below}
    if not finished:
        return []
    tracker = store_tracker(config)
    experiment_id = tracker.experiment_id(config.campaign)
    newest = max(finished)
    cache = FingerprintCache(None) if every_byte else fingerprint_cache(config)
    restored: list[str] = []
    needed: set[str] = set()  # the digests of the outputs the newest iteration's were computed from
    gc_records = TAG_GC_RECORDS in tracker.experiment_tags(config.campaign)
    outputs = recorded_outputs(config, tracker, experiment_id, finished)
    for output in sorted(outputs, key=lambda output: newest not in output.iterations):  # the newest iteration's first
        if not output.folder.is_dir():
            removed_by_gc = TAG_REMOVED_BY_GC in output.run.tags or not gc_records
            needs = newest in output.iterations or output.run.tags.get(TAG_MANIFEST_DIGEST) in needed
            if removed_by_gc and not needs:
                continue  # `rlhf gc` keeps what the campaign needs, and removed this
            if every_byte:
                raise MissingOutputError(f"{output.name} is missing; `rlhf run` restores it where MLflow keeps a copy")
            restored.append(_restore(output, tracker))
        manifest = _verified(output, cache)
        if checked is not None:
            checked.append((output, manifest))
        if newest in output.iterations:
            needed.update(manifest.upstream.values())
    cache.save()
    return restored


def recorded_outputs(
    config: PipelineConfig, tracker: Tracker, experiment_id: str, finished: dict[int, RunSummary]
) -> list[RecordedOutput]:
    """Every stage output the ``finished`` iteration runs used, once each, by iteration: their own stage runs and
    the ones their ``rlhf.output.<stage>`` tags name (another iteration's, for a stage they reused). One MLflow
    query."""
    layout = campaign_layout(config)
    stage_runs = {
        run.run_id: run for run in tracker.runs(experiment_id, tags={TAG_KIND: KIND_STAGE}, status="FINISHED")
    }
    used: dict[Path, tuple[RunSummary, list[int]]] = {}
    for number, iteration in sorted(finished.items()):
        named = [run_id for key, run_id in iteration.tags.items() if key.startswith(TAG_OUTPUT_PREFIX)]
        own = [run_id for run_id, run in stage_runs.items() if run.tags.get(TAG_PARENT_RUN_ID) == iteration.run_id]
        for run_id in dict.fromkeys([*named, *own]):
            run = stage_runs.get(run_id)
            if run is None or TAG_INPUT_KEY not in run.tags:
                continue  # a run that recorded no output (or is not finished): nothing of it to check
            folder = layout.stage_dir(run.tags[TAG_STAGE], run.tags[TAG_INPUT_KEY])
            numbers = used.setdefault(folder, (run, []))[1]
            if number not in numbers:
                numbers.append(number)
    return [RecordedOutput(run, folder, tuple(numbers)) for folder, (run, numbers) in used.items()]


def _remedy(output: RecordedOutput) -> str:
    """What to do about a corrupt output: delete it, and the next run restores it or it is computed again."""
    if output.copied:
        return f"delete {output.folder} and run again: what MLflow run {output.run.run_id} recorded is restored"
    return f"delete {output.folder} and recompute it (`rlhf run --from-iteration {output.iterations[0]}`)"


def _verified(output: RecordedOutput, cache: FingerprintCache) -> Manifest:
    """The manifest of ``output``, once its files match it and it matches what MLflow recorded (choice 1).

    Raises:
        CorruptOutputError: naming the file and what to do.
    """
    try:
        manifest = read_manifest(output.folder, cache=cache)
    except UnsupportedSchemaError:
        raise  # its message says what to do
    except CorruptOutputError as error:
        raise CorruptOutputError(f"{error}; {_remedy(output)}", path=error.path) from error
    recorded = output.run.tags.get(TAG_MANIFEST_DIGEST)
    if manifest.input_key != output.run.tags[TAG_INPUT_KEY] or (recorded and manifest.digest != recorded):
        manifest_path = output.folder / MANIFEST_FILE
        raise CorruptOutputError(
            f"{manifest_path} is not the manifest MLflow run {output.run.run_id} recorded (another digest); "
            f"{_remedy(output)}",
            path=manifest_path,
        )
    return manifest


def _restore(output: RecordedOutput, tracker: Tracker) -> str:
    """Put a missing output back from MLflow's copy (choice 4); one line saying so.

    Raises:
        MissingOutputError: MLflow keeps no copy of it.
    """
    if not output.copied:
        raise MissingOutputError(
            f"{output.name} is missing, and MLflow keeps no copy of it (a local store records an output where it "
            f"is): put it back, or recompute it (`rlhf run --from-iteration {output.iterations[0]}`)"
        )
    tracker.download_stage_output(output.run.run_id, output.folder)
    return f"restored {output.name} from what MLflow run {output.run.run_id} recorded"


def verify_campaign(config: PipelineConfig, finished: dict[int, RunSummary]) -> str:
    """``rlhf verify``: every output ``config``'s campaign's ``finished`` iterations recorded, each of its files hashed
    again (no fingerprint remembered by size and times is trusted: bit rot, an edit with its times put back), checked
    as a rerun checks them (:func:`check_finished_outputs`); nothing is written. Returns the report's line.

    Raises:
        LookupError: the campaign has no finished iteration.
        CorruptOutputError, MissingOutputError: as :func:`check_finished_outputs`, naming the output.
    """
    if not finished:
        raise LookupError(f"campaign {config.campaign!r} has no finished iteration under {config.run_root}")
    checked: list[tuple[RecordedOutput, Manifest]] = []
    check_finished_outputs(config, finished, every_byte=True, checked=checked)
    files = [  # a prunable file pruned since (an old update's optimizer states) was not read
        entry for output, manifest in checked for entry in manifest.files if (output.folder / entry.path).is_file()
    ]
    size = sum(entry.bytes for entry in files)
    return (
        f"campaign {config.campaign}: {len(checked)} outputs of {len(finished)} finished iterations, "
        f"{len(files)} files ({size / 2**20:.1f} MB), every byte as its manifest and MLflow recorded"
    )
