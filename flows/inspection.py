"""``rlhf inspect``: what a campaign's recorded experience holds, iteration by iteration, and where it drifts.

1. The stage outputs of each finished iteration run, and of each finished replay of it, are found through MLflow
   (the run's ``rlhf.output.<stage>`` tags, as continuing and replaying find them), never by globbing folders: a
   campaign folder also holds outputs no finished run used.
2. Each run is summarised by :mod:`storage.diagnostics` over lazy scans of its shards, one run at a time, so memory
   is bounded by one run's columns whatever the campaign's length. A replay shares its source's experience; its
   row sits under its source's, and its rollouts keep the same ``row`` ids, so one experience trained under
   several estimators compares row by row.
3. Responses (``--where``, ``--top``) are chosen on the per-rollout figures first; only the chosen rows' token
   ids are then read back and decoded with the campaign's tokenizer (the one saved beside the policy).
4. An episode (a rollout with an environment, docs/environments.md) is shown turn by turn: the chosen rows' segments
   are read from the rollout's ``turns`` table, and each is decoded from its token range, special tokens kept, so
   what the model sampled and the template's delta the environment's reply became both show as they were trained on.
   Its length, KL and advantage count the model's tokens only (:func:`storage.diagnostics.rollout_frame`).
5. :func:`log_inspection` puts one run's summary on its MLflow run (``inspect/<column>`` metrics) with its top
   responses as a table artifact, so the MLflow UI and the Prefect iteration artifact show them without the CLI.
6. A DPO iteration has no rollout: its experience is the pairs its update trained on, each with the reference's
   log-probs (the ``reference_logprobs`` output), the updated policy's and the implicit rewards (the update's
   ``pair_measures``), :func:`storage.diagnostics.pair_frame`. Its summary has the DPO columns where a PPO one has the
   rollout's, and ``--where`` / ``--top`` choose pairs, printed with their texts (the ``preferences`` they came from).
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import polars as pl

from campaign.config import PipelineConfig
from campaign.store import existing_tracker, store_layout
from flows.report import text_table
from rlhf_core.errors import UserError
from storage.diagnostics import (
    PAIR_COLUMNS,
    SUMMARY_COLUMNS,
    DriftFlag,
    DriftThresholds,
    describe_flag,
    drift_flags,
    filter_rollouts,
    group_spread,
    pair_frame,
    rollout_frame,
    summarize_evaluation,
    summarize_pairs,
    summarize_rollouts,
    top_rollouts,
)
from storage.layout import RunLayout
from storage.manifest import Manifest, read_manifest
from storage.recorded import recorded_output
from storage.schemas import (
    CHOSEN,
    PAIR_ID,
    PROMPT,
    PROMPT_IDS,
    REJECTED,
    RESPONSE_IDS,
    ROLE,
    ROW,
    SAMPLES,
    STOP_REASON,
    TOKEN_START,
    TOKEN_STOP,
    TURN,
    TURN_REWARD,
    TURNS,
)
from storage.shards import scan_table
from storage.tracking import (
    KIND_ITERATION,
    KIND_REPLAY,
    KIND_STAGE,
    TAG_KIND,
    TAG_OUTPUT_PREFIX,
    TAG_REPLAY_OF,
    Tracker,
)

ITERATION_RUN = "iteration"
METRIC_PREFIX = "inspect"
TOP_RESPONSES = "inspect/top_responses.json"
"""The MLflow table artifact of an iteration run's highest-scoring responses (:func:`log_inspection`)."""
TOP_PAIRS = "inspect/top_pairs.json"
"""The MLflow table artifact of a DPO iteration run's pairs of the widest implicit reward margin."""
DEFAULT_SHOWN = 20
"""Responses ``--where`` prints without ``--top``."""
ROLLOUT_COLUMNS = ("iteration", "run", ROW, "prompt_id", "length", "truncated", "score", "reward", "kl", "advantage")
"""What ``--where`` and ``--by`` may name, and what each printed response shows."""
PAIR_SHOWN = ("iteration", "run", *PAIR_COLUMNS)
"""What ``--where`` and ``--by`` may name in a DPO campaign, and what each printed pair shows (with its texts)."""
DEFAULT_BY = {"rollouts": "score", "pairs": "reward_margin"}
"""What ``--top`` sorts by without ``--by``: a rollout's score, a DPO pair's implicit reward margin."""
_BLOCKS = (
    (
        "experience",
        ("estimator", "candidates", "pairs", "rollouts", "length_mean", "length_p50", "length_p95", "truncated_share"),
    ),
    ("scores and KL", ("score_mean", "score_std", "reward_mean", "reward_std", "kl_mean", "negative_kl_share")),
    (
        "policy, reward model and evaluation",
        ("entropy", "advantage_mean", "advantage_std", "zero_spread_share", "rm_accuracy", "heldout_score_mean",
         "gold_mean"),
    ),
    (
        "DPO pairs: the policy after the update, the reference, the implicit rewards",
        ("logps_chosen", "logps_rejected", "ref_logps_chosen", "ref_logps_rejected", "reward_accuracy",
         "reward_margin"),
    ),
)  # fmt: skip
"""The summary printed as tables, each under ~120 characters wide; a table with nothing but nulls (the rollout's in a
DPO campaign, the pairs' in a PPO one) is left out."""


class InspectError(UserError, ValueError):
    """A problem with what ``rlhf inspect`` was asked: the target, a filter, a sort column, a threshold."""


@dataclass(frozen=True)
class RunOutputs:
    """The stage output folders one iteration run, or one replay of it, used (None where it used none).

    A replay's ``rollout``, ``candidates``, ``preferences`` and ``reward_model`` are its source's.
    """

    iteration: int
    run: str
    """``iteration``, or ``replay <first 12 characters of its run id>``."""
    run_id: str
    rollout: Path | None
    """None in a DPO iteration, which has ``pairs`` instead."""
    scored: Path | None
    policy: Path
    """The PPO or DPO update's output."""
    evaluation: Path | None = None
    reward_model: Path | None = None
    candidates: Path | None = None
    preferences: Path | None = None
    pairs: Path | None = None
    """A DPO iteration's pairs with the reference's log-probs (its ``reference_logprobs`` output); None in PPO."""

    @property
    def kind(self) -> str:
        """What the run's experience is: ``rollouts``, or a DPO update's ``pairs``."""
        return "rollouts" if self.pairs is None else "pairs"


def parse_target(text: str) -> tuple[str, int | None]:
    """``CAMPAIGN`` or ``CAMPAIGN:ITERATION`` as (campaign, iteration or None)."""
    campaign, colon, iteration = text.partition(":")
    if not campaign or (colon and not iteration.isdigit()):
        raise InspectError(f"{text!r} is not CAMPAIGN or CAMPAIGN:ITERATION (an iteration is a whole number)")
    return campaign, int(iteration) if colon else None


# Finding the outputs -----------------------------------------------------------------------------------------------


def find_runs(config: PipelineConfig, campaign: str, iteration: int | None = None) -> list[RunOutputs]:
    """The outputs of every finished iteration of ``campaign`` (or just ``iteration``), each followed by its replays.

    Four searches of the store (iteration runs, the finished ones, replay and stage runs, with their tags), whatever
    the campaign's length;
    outputs found in place are trusted as they are (their manifests are read, their bytes not hashed).

    Raises:
        LookupError: no MLflow store, no such campaign, or no such finished iteration.
    """
    tracker = existing_tracker(config)
    if tracker is None:
        database = store_layout(config).mlflow_db()
        raise LookupError(f"no MLflow store at {database}: nothing has run with `run_root` {config.run_root}")
    if not tracker.has_experiment(campaign):
        raise LookupError(f"no campaign {campaign!r} in the MLflow store {tracker.tracking_uri}")
    experiment_id = tracker.experiment_id(campaign)
    iterations = tracker.runs(experiment_id, tags={TAG_KIND: KIND_ITERATION})
    finished = tracker.finished_iterations(experiment_id)  # the newest finished run of each, none superseded
    if iteration is not None and iteration not in finished:
        raise LookupError(f"campaign {campaign!r} has no finished iteration {iteration}")
    if not finished:
        raise LookupError(f"campaign {campaign!r} has no finished iteration")
    replays = [run for run in tracker.runs(experiment_id, tags={TAG_KIND: KIND_REPLAY}) if run.status == "FINISHED"]
    stages = tracker.runs(experiment_id, tags={TAG_KIND: KIND_STAGE})
    tags = {run.run_id: run.tags for run in [*iterations, *replays, *stages]}
    layout = RunLayout(root=config.run_root / campaign)
    found = []
    for number in sorted(finished) if iteration is None else [iteration]:
        run_id = finished[number].run_id
        source = _run_outputs(tracker, layout, tags, number, ITERATION_RUN, run_id)
        found.append(source)
        for replay in sorted(replays, key=lambda run: run.run_id):
            if replay.tags.get(TAG_REPLAY_OF) == run_id:
                run = f"replay {replay.run_id[:12]}"
                found.append(_run_outputs(tracker, layout, tags, number, run, replay.run_id, source))
    return found


def _run_outputs(
    tracker: Tracker,
    layout: RunLayout,
    tags: dict[str, dict[str, str]],
    iteration: int,
    run: str,
    run_id: str,
    source: RunOutputs | None = None,
) -> RunOutputs:
    """The outputs the run ``run_id`` names in its ``rlhf.output.<stage>`` tags (``tags``: every run's, by id)."""

    def output(stage: str) -> Path | None:
        stage_run = tags[run_id].get(f"{TAG_OUTPUT_PREFIX}{stage}")
        if stage_run is None:
            return None
        return recorded_output(tracker, layout, stage_run, tags=tags.get(stage_run), verify=False)[0]

    scored, policy = output("compute_advantages"), output("ppo_update") or output("dpo_update")
    rollout = source.rollout if source is not None else output("rollout")
    pairs = source.pairs if source is not None else output("reference_logprobs")
    if policy is None or (pairs is None and (scored is None or rollout is None)):
        raise LookupError(
            f"{run} {run_id} of iteration {iteration} records no rollout and advantages with a PPO output, nor pairs "
            "with a DPO output"
        )
    return RunOutputs(
        iteration=iteration,
        run=run,
        run_id=run_id,
        rollout=rollout,
        scored=scored,
        policy=policy,
        evaluation=output("evaluate"),
        reward_model=source.reward_model if source is not None else output("train_reward_model"),
        candidates=source.candidates if source is not None else output("sample_candidates"),
        preferences=source.preferences if source is not None else output("collect_preferences"),
        pairs=pairs,
    )


# Summaries ---------------------------------------------------------------------------------------------------------


def tokenizer_dir(outputs: RunOutputs) -> Path:
    """The campaign's tokenizer: saved beside every policy the campaign trained."""
    return outputs.policy / "actor"


def eos_token_id(directory: Path) -> int | None:
    """The EOS id of the tokenizer saved in ``directory``, from its files (``tokenizer_config.json`` names the
    token, ``tokenizer.json`` gives its id), so a summary needs no transformers; through transformers otherwise."""
    config_file, vocabulary = directory / "tokenizer_config.json", directory / "tokenizer.json"
    token = json.loads(config_file.read_text()).get("eos_token") if config_file.is_file() else None
    token = token.get("content") if isinstance(token, dict) else token
    if isinstance(token, str) and vocabulary.is_file():
        from tokenizers import Tokenizer

        found = Tokenizer.from_file(str(vocabulary)).token_to_id(token)
        if found is not None:
            return found
    from storage.tokenizers import load_tokenizer

    return load_tokenizer(directory).eos_token_id


def _manifest(folder: Path | None) -> Manifest | None:
    return None if folder is None else read_manifest(folder, verify=False)


def _rows(manifest: Manifest | None, table: str) -> int | None:
    if manifest is None:
        return None
    return manifest.rows(table)


def _metric(manifest: Manifest | None, name: str) -> float | None:
    value = None if manifest is None else manifest.metrics.get(name)
    return None if value is None else float(value)


def rollouts_of(outputs: RunOutputs, *, eos: int | None) -> pl.LazyFrame:
    """The run's per-rollout figures (:func:`storage.diagnostics.rollout_frame`), labelled with its iteration and run."""
    sampling = read_manifest(outputs.rollout, verify=False).config["stage"]["sampling"]
    frame = rollout_frame(
        scan_table(outputs.scored, "scored_experience"), max_new_tokens=sampling["max_new_tokens"], eos_token_id=eos
    )
    return frame.with_columns(iteration=pl.lit(outputs.iteration, pl.Int64), run=pl.lit(outputs.run))


def pairs_of(outputs: RunOutputs) -> pl.LazyFrame:
    """A DPO run's pairs (:func:`storage.diagnostics.pair_frame`), labelled with its iteration and run."""
    frame = pair_frame(scan_table(outputs.pairs, "reference_logprobs"), scan_table(outputs.policy, "pair_measures"))
    return frame.with_columns(iteration=pl.lit(outputs.iteration, pl.Int64), run=pl.lit(outputs.run))


def _experience_summary(outputs: RunOutputs, *, eos: int | None) -> tuple[str, list[pl.LazyFrame]]:
    """What scored the run's experience (its estimator, or ``dpo <loss>``) and the summaries of it: of its rollouts,
    or of a DPO update's pairs."""
    if outputs.kind == "pairs":
        loss = read_manifest(outputs.policy, verify=False).config["stage"]["dpo"]["loss"]
        return f"dpo {loss}", [summarize_pairs(pairs_of(outputs))]
    scored = read_manifest(outputs.scored, verify=False)
    rollouts = rollouts_of(outputs, eos=eos)
    return scored.config["stage"]["advantages"]["estimator"], [summarize_rollouts(rollouts), group_spread(rollouts)]


def run_summary(outputs: RunOutputs, *, eos: int | None) -> pl.LazyFrame:
    """One row of :data:`storage.diagnostics.SUMMARY_COLUMNS` for one run, lazily; the columns its kind of experience
    has not (a DPO run's rollout columns, a PPO run's pair columns) are null."""
    policy, reward_model = _manifest(outputs.policy), _manifest(outputs.reward_model)
    estimator, summaries = _experience_summary(outputs, eos=eos)
    labels = pl.LazyFrame(
        {
            "iteration": [outputs.iteration],
            "run": [outputs.run],
            "estimator": [estimator],
            "candidates": [_rows(_manifest(outputs.candidates), "candidates")],
            "pairs": [_rows(_manifest(outputs.preferences), "preferences")],
            "entropy": [_metric(policy, "entropy")],
            "rm_accuracy": [_metric(reward_model, "eval_accuracy")],
        },
        schema_overrides={"candidates": pl.Int64, "pairs": pl.Int64, "entropy": pl.Float64, "rm_accuracy": pl.Float64},
    )
    evaluation = (
        summarize_evaluation(pl.scan_ndjson(outputs.evaluation / SAMPLES))
        if outputs.evaluation is not None and (outputs.evaluation / SAMPLES).is_file()
        else pl.LazyFrame(
            {"heldout_score_mean": [None], "gold_mean": [None]},
            schema={n: pl.Float64 for n in ("heldout_score_mean", "gold_mean")},
        )
    )
    row = pl.concat([labels, *summaries, evaluation], how="horizontal")
    have = set(row.collect_schema().names())
    missing = [pl.lit(None, pl.Float64).alias(name) for name in SUMMARY_COLUMNS if name not in have]
    return row.with_columns(missing).select(list(SUMMARY_COLUMNS))


def summarize_runs(runs: list[RunOutputs], *, eos: int | None) -> pl.DataFrame:
    """The summary of every run, one row each, collected one run at a time (memory bounded by one run)."""
    return pl.concat([run_summary(outputs, eos=eos).collect(engine="streaming") for outputs in runs])


def _top(frame: pl.LazyFrame, *, where: str | None, by: str, count: int) -> pl.DataFrame:
    """The rows of ``frame`` (rollouts, or DPO pairs) matching ``where``, the ``count`` highest by ``by``.

    Raises:
        InspectError: ``where`` or ``by`` is not usable.
    """
    try:
        return top_rollouts(filter_rollouts(frame, where), by=by, count=count).collect(engine="streaming")
    except ValueError as error:
        raise InspectError(str(error)) from error
    except pl.exceptions.PolarsError as error:
        if where is None:
            raise
        # a condition that parses but cannot run, e.g. text compared with a number
        raise InspectError(f"`--where` {where!r} cannot be evaluated: {str(error).splitlines()[0]}") from error


def select_responses(
    runs: list[RunOutputs], *, eos: int | None, where: str | None, by: str, count: int
) -> pl.DataFrame:
    """The rollouts of ``runs`` matching ``where``, the ``count`` highest by ``by``, with their token ids.

    Only the per-rollout figures of every rollout are computed; token ids are read back for the chosen rows only.

    Raises:
        InspectError: ``where`` or ``by`` is not usable.
    """
    rollouts = pl.concat([rollouts_of(outputs, eos=eos).select(ROLLOUT_COLUMNS) for outputs in runs])
    chosen = _top(rollouts, where=where, by=by, count=count)
    tokens = []
    for outputs in runs:
        rows = chosen.filter(pl.col("run") == outputs.run, pl.col("iteration") == outputs.iteration)[ROW]
        if len(rows):
            scan = scan_table(outputs.scored, "scored_experience").filter(pl.col(ROW).is_in(rows.implode()))
            found = (
                scan.select(ROW, PROMPT_IDS, RESPONSE_IDS)
                .with_columns(iteration=pl.lit(outputs.iteration, pl.Int64), run=pl.lit(outputs.run))
                .collect()
            )
            if _rows(_manifest(outputs.rollout), TURNS):  # episodes: each row's turns (choice 4)
                found = found.join(_turns(outputs.rollout, rows), on=ROW, how="left")
            tokens.append(found)
    if not tokens:
        return chosen.with_columns(prompt_ids=pl.lit(None), response_ids=pl.lit(None)).clear()
    found = pl.concat(tokens, how="diagonal")  # an episode's rows have their turns
    return chosen.join(found, on=["iteration", "run", ROW], how="left", maintain_order="left")


def _turns(rollout: Path, rows: pl.Series) -> pl.DataFrame:
    """``row`` and ``turns``, the list of each row's segments in order (:data:`storage.schemas.TURNS_TABLE`)."""
    segments = scan_table(rollout, TURNS).filter(pl.col(ROW).is_in(rows.implode())).sort(ROW, TOKEN_START)
    return (
        segments.group_by(ROW, maintain_order=True)
        .agg(pl.struct(TURN, ROLE, TOKEN_START, TOKEN_STOP, TURN_REWARD, STOP_REASON).alias(TURNS))
        .collect()
    )


def select_pairs(runs: list[RunOutputs], *, where: str | None, by: str, count: int) -> pl.DataFrame:
    """The DPO pairs of ``runs`` matching ``where``, the ``count`` highest by ``by``, with their prompt, chosen and
    rejected texts (read from the ``preferences`` they came from, for the chosen pairs only).

    Raises:
        InspectError: ``where`` or ``by`` is not usable.
    """
    chosen = _top(
        pl.concat([pairs_of(outputs).select(PAIR_SHOWN) for outputs in runs]), where=where, by=by, count=count
    )
    texts = pl.concat(
        [
            scan_table(folder, "preferences").select(PAIR_ID, PROMPT, CHOSEN, REJECTED)
            .filter(pl.col(PAIR_ID).is_in(chosen[PAIR_ID].implode()))
            .collect()
            for folder in {outputs.preferences for outputs in runs if outputs.preferences is not None}
        ]
        or [pl.DataFrame(schema={PAIR_ID: pl.Int64, PROMPT: pl.String, CHOSEN: pl.String, REJECTED: pl.String})]
    )  # fmt: skip
    return chosen.join(texts.unique(PAIR_ID, keep="first"), on=PAIR_ID, how="left", maintain_order="left")


def decode_responses(responses: pl.DataFrame, directory: Path) -> pl.DataFrame:
    """``responses`` with ``prompt`` and ``response`` texts in place of their token ids (special tokens dropped); an
    episode's ``turns`` each with its ``text``, decoded from its token range with its special tokens (choice 4)."""
    from storage.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(directory)
    texts = {
        name: tokenizer.batch_decode(responses[column].to_list(), skip_special_tokens=True)
        for name, column in (("prompt", PROMPT_IDS), ("response", RESPONSE_IDS))
    }
    decoded = responses.with_columns(
        pl.Series("prompt", texts["prompt"], dtype=pl.String), pl.Series("response", texts["response"], dtype=pl.String)
    )
    if TURNS in responses.columns:
        turns = [
            [{**segment, "text": tokenizer.decode(ids[segment[TOKEN_START] : segment[TOKEN_STOP]])} for segment in row]
            for ids, row in zip(responses[RESPONSE_IDS].to_list(), responses[TURNS].to_list(), strict=True)
        ]
        decoded = decoded.with_columns(pl.Series(TURNS, turns))
    return decoded.drop(PROMPT_IDS, RESPONSE_IDS)


# On the MLflow run ------------------------------------------------------------------------------------------------


def stage_outputs(folders: dict[str, Path], *, iteration: int, run: str, run_id: str) -> RunOutputs:
    """A run's :class:`RunOutputs` from its stage output folders by stage name (``rollout``, ``compute_advantages``,
    ``ppo_update``, ``evaluate``, ``train_reward_model``, ``sample_candidates``, ``collect_preferences``; a DPO run's
    ``reference_logprobs`` and ``dpo_update``)."""
    return RunOutputs(
        iteration=iteration,
        run=run,
        run_id=run_id,
        rollout=folders.get("rollout"),
        scored=folders.get("compute_advantages"),
        policy=folders["ppo_update"] if "ppo_update" in folders else folders["dpo_update"],
        evaluation=folders.get("evaluate"),
        reward_model=folders.get("train_reward_model"),
        candidates=folders.get("sample_candidates"),
        preferences=folders.get("collect_preferences"),
        pairs=folders.get("reference_logprobs"),
    )


def inspect_run(outputs: RunOutputs, *, top: int = 10) -> tuple[dict[str, float], pl.DataFrame]:
    """One run's summary as ``inspect/<column>`` metrics (the numbers it has), and its ``top`` highest-scoring
    responses, decoded (a DPO run's ``top`` pairs of the highest implicit reward margin, with their texts): what
    :func:`flows.iterations.close_iteration` logs on the run."""
    eos = eos_token_id(tokenizer_dir(outputs))
    row = run_summary(outputs, eos=eos).collect().row(0, named=True)
    metrics = {
        f"{METRIC_PREFIX}/{name}": float(value)
        for name, value in row.items()
        if name != "iteration" and isinstance(value, int | float) and not isinstance(value, bool)
        if math.isfinite(value)
    }
    if outputs.kind == "pairs":
        return metrics, select_pairs([outputs], where=None, by=DEFAULT_BY["pairs"], count=top)
    responses = select_responses([outputs], eos=eos, where=None, by="score", count=top)
    return metrics, decode_responses(responses, tokenizer_dir(outputs))


def summary_from_metrics(rows: list[tuple[int, dict[str, float]]]) -> pl.DataFrame:
    """A summary frame (iteration rows only) rebuilt from iteration runs' ``inspect/<column>`` metrics, for
    :func:`storage.diagnostics.drift_flags`; a column no run logged is null."""
    numeric = [name for name in SUMMARY_COLUMNS if name not in ("iteration", "run", "estimator")]
    return pl.DataFrame(
        {
            "iteration": [iteration for iteration, _ in rows],
            "run": [ITERATION_RUN] * len(rows),
            **{name: [metrics.get(f"{METRIC_PREFIX}/{name}") for _, metrics in rows] for name in numeric},
        },
        schema_overrides={name: pl.Float64 for name in numeric},
    )


# The command -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Inspection:
    """What ``rlhf inspect`` found: the summary, its drift flags, and the responses asked for (None if none were)."""

    campaign: str
    summary: pl.DataFrame
    flags: list[DriftFlag]
    thresholds: DriftThresholds
    responses: pl.DataFrame | None


def inspect_campaign(
    config: PipelineConfig,
    target: str,
    *,
    where: str | None = None,
    top: int | None = None,
    by: str | None = None,
    thresholds: list[str] = (),
) -> Inspection:
    """Summarise ``target`` (``CAMPAIGN`` or ``CAMPAIGN:ITERATION``); responses (a DPO campaign's pairs) when
    ``where`` or ``top`` is given, the highest by ``by`` (None: :data:`DEFAULT_BY`).

    Raises:
        InspectError: a bad target, threshold, filter or sort column (checked before anything is read).
        LookupError: no such campaign or finished iteration.
    """
    campaign, iteration = parse_target(target)
    try:
        limits = DriftThresholds.parse(list(thresholds))
    except ValueError as error:
        raise InspectError(str(error)) from error
    if by is not None and by not in ROLLOUT_COLUMNS + PAIR_SHOWN:
        raise InspectError(f"`--by` {by!r} is not a rollout column: choose one of {', '.join(ROLLOUT_COLUMNS)}")
    runs = find_runs(config, campaign, iteration)
    kind = runs[0].kind  # a campaign's iterations all have one kind of update
    columns = PAIR_SHOWN if kind == "pairs" else ROLLOUT_COLUMNS
    by = by or DEFAULT_BY[kind]
    if by not in columns:
        raise InspectError(f"`--by` {by!r} is not a column of {campaign}'s {kind}: choose one of {', '.join(columns)}")
    eos = eos_token_id(tokenizer_dir(runs[0]))
    summary = summarize_runs(runs, eos=eos)
    responses = None
    if (where is not None or top is not None) and kind == "pairs":
        responses = select_pairs(runs, where=where, by=by, count=top or DEFAULT_SHOWN)
    elif where is not None or top is not None:
        chosen = select_responses(runs, eos=eos, where=where, by=by, count=top or DEFAULT_SHOWN)
        responses = decode_responses(chosen, tokenizer_dir(runs[0]))
    return Inspection(campaign, summary, drift_flags(summary, limits), limits, responses)


def _cell(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render_table(inspection: Inspection) -> str:
    """The summary as three text tables, the drift flags in words, then the responses asked for."""
    summary = inspection.summary
    lines = [f"campaign `{inspection.campaign}`: {summary.filter(pl.col('run') == ITERATION_RUN).height} iteration(s)"]
    for title, columns in _BLOCKS:
        if summary.select(columns).null_count().sum_horizontal().item() == summary.height * len(columns):
            continue  # nothing of this kind of experience (module docstring, choice 6)
        rows = [["iteration", "run", *columns]]
        rows += [[_cell(row[name]) for name in rows[0]] for row in summary.iter_rows(named=True)]
        lines += ["", f"{title}:", text_table(rows)]
    lines.append("")
    if inspection.flags:
        lines.append("drift warnings:")
        lines += [f"  {flag.kind}: {describe_flag(flag)}" for flag in inspection.flags]
    else:
        lines.append("drift warnings: none (thresholds in docs/inspect.md; change them with --threshold NAME=VALUE)")
    if inspection.responses is not None:
        lines += ["", f"responses ({inspection.responses.height}):"]
        for row in inspection.responses.iter_rows(named=True):
            run = "" if row["run"] == ITERATION_RUN else f" ({row['run']})"
            if PAIR_ID in row:
                lines += ["", *_pair_lines(row, run)]
                continue
            truncated = " (truncated)" if row["truncated"] else ""
            lines += [
                "",
                f"iteration {row['iteration']}{run}, row {row[ROW]}, prompt {row['prompt_id']}: score {_cell(row['score'])}"
                f"  reward {_cell(row['reward'])}  kl {_cell(row['kl'])}  advantage {_cell(row['advantage'])}"
                f"  length {row['length']}{truncated}",
                f"  prompt:   {row['prompt']}",
            ]
            lines += _turn_lines(row[TURNS]) if row.get(TURNS) else [f"  response: {row['response']}"]
    return "\n".join(lines) + "\n"


def _pair_lines(row: dict, run: str) -> list[str]:
    """A DPO pair as ``render_table`` prints it: its figures, then its texts."""
    sides = [
        f"  {side + ':':<9} {row[side]}\n"
        f"            implicit reward {_cell(row[f'rewards_{side}'])}  log-prob {_cell(row[f'logps_{side}'])}"
        f" (reference {_cell(row[f'ref_logps_{side}'])})  {row[f'{side}_tokens']} tokens"
        for side in (CHOSEN, REJECTED)
    ]
    return [
        f"iteration {row['iteration']}{run}, pair {row[PAIR_ID]}: reward margin {_cell(row['reward_margin'])}",
        f"  prompt:   {row[PROMPT]}",
        *sides,
    ]


def _turn_lines(turns: list[dict]) -> list[str]:
    """An episode turn by turn (choice 4): the model's turns with their rewards, the environment's replies as the
    template's delta, each text on one line (newlines escaped), then how it ended."""
    lines = []
    for segment in turns:
        text = json.dumps(segment["text"], ensure_ascii=False)
        if segment[ROLE] == "assistant":
            lines.append(f"  turn {segment[TURN] + 1}, model (reward {_cell(segment[TURN_REWARD])}): {text}")
        elif segment[TOKEN_STOP] > segment[TOKEN_START]:
            lines.append(f"  turn {segment[TURN] + 1}, environment: {text}")
    reasons = [segment[STOP_REASON] for segment in turns if segment[STOP_REASON] is not None]
    return [*lines, f"  stopped: {reasons[-1] if reasons else '-'}"]


def _plain(value: object) -> object:
    """A JSON value: NaN and infinities become null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def render_json(inspection: Inspection) -> str:
    """Summary rows, flags and responses (when asked for) as one JSON document."""
    document = {
        "campaign": inspection.campaign,
        "summary": [{k: _plain(v) for k, v in row.items()} for row in inspection.summary.iter_rows(named=True)],
        "flags": [{"kind": f.kind, "first": f.first, "last": f.last, "message": f.message} for f in inspection.flags],
        "thresholds": asdict(inspection.thresholds),
    }
    if inspection.responses is not None:
        document["responses"] = [
            {k: _plain(v) for k, v in row.items()} for row in inspection.responses.iter_rows(named=True)
        ]
    return json.dumps(document, indent=2) + "\n"


def render_csv(inspection: Inspection) -> str:
    """The responses when asked for, else the summary, as CSV with a header row."""
    frame = inspection.responses if inspection.responses is not None else inspection.summary
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(frame.columns)
    writer.writerows(
        ["" if value is None else json.dumps(value) if isinstance(value, list) else value for value in row]
        for row in frame.iter_rows()
    )  # an episode's turns as JSON
    return buffer.getvalue()


RENDERERS = {"table": render_table, "json": render_json, "csv": render_csv}
