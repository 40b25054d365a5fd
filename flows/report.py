"""Terminal reports read back from MLflow: a campaign's iterations, and runs side by side.

Metric names are the same in every run (``stage/metric``), so each table here is also a
comparison the MLflow UI can draw. :func:`compare_report` ends with the models view: the policy each run
trained as the logged model MLflow's *Models* tab lists, with its registered version and aliases and the
evaluation figures logged with it on its held-out data.
"""

from __future__ import annotations

from collections.abc import Sequence

from campaign.config import PipelineConfig
from campaign.store import stage_run, store_tracker
from storage.mlflow_store import RunSummary
from storage.tracking import TAG_CAMPAIGN, TAG_ITERATION, TAG_KIND, TAG_MODEL, Tracker

HEADLINE_METRICS = {
    "evaluate/gold_win_rate": "gold win rate",
    "evaluate/gold_mean": "gold",
    "evaluate/reference_gold_mean": "gold (initial)",
    "evaluate/kl_to_reference": "KL to ref",
    "evaluate/reward_mean": "reward",
    "train_reward_model/eval_accuracy": "RM accuracy",
    "ppo_update/approx_kl": "PPO approx KL",
    "dpo_update/rewards/accuracies": "DPO accuracy",
}


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells as right-aligned columns (the first row is the header)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)


def _cell(metrics: dict[str, float], name: str) -> str:
    return f"{metrics[name]:.4g}" if name in metrics else "-"


def campaign_report(finished: dict[int, RunSummary]) -> str:
    """One row per finished iteration of a campaign (``finished``: :func:`campaign.history.finished_iterations`),
    headline metrics as columns."""
    rows = [(number, run.metrics) for number, run in finished.items()]
    columns = [name for name in HEADLINE_METRICS if any(name in metrics for _, metrics in rows)]
    header = ["iteration", *(HEADLINE_METRICS[name] for name in columns)]
    table = text_table(
        [header, *([str(iteration), *(_cell(metrics, name) for name in columns)] for iteration, metrics in rows)]
    )
    notes = []
    if any(metrics.get("train_reward_model/eval_pairs", 0) for _, metrics in rows):
        pairs = [
            int(metrics["train_reward_model/eval_pairs"])
            for _, metrics in rows
            if "train_reward_model/eval_pairs" in metrics
        ]
        counted = f"{min(pairs)}" if min(pairs) == max(pairs) else f"{min(pairs)} to {max(pairs)}"
        notes.append(f"RM accuracy: on {counted} held-out pairs per iteration.")
    if any(metrics.get(KL_TO_REFERENCE, 0) < 0 for _, metrics in rows):
        notes.append(KL_NOTE)
    return "\n".join([table, *notes])


def campaign_link(config: PipelineConfig) -> str:
    """Where the MLflow UI lists the campaign's runs and its models (`tracking_ui_url`), as lines to print."""
    tracker = store_tracker(config)
    experiment_id = tracker.experiment_id(config.campaign)
    return f"MLflow: {tracker.experiment_url(experiment_id)}\nMLflow models: {tracker.models_url(experiment_id)}"


KL_TO_REFERENCE = "evaluate/kl_to_reference"
KL_NOTE = (
    "KL to ref: the k1 estimate, log pi(y|x) - log pi_ref(y|x) summed over each sampled response and averaged over "
    "the held-out prompts. It is unbiased but not positive per sample, so while the policy is still close to the "
    "reference (iteration 0) its mean can come out slightly below 0."
)


def compare_report(config: PipelineConfig, run_ids: Sequence[str], *, metrics: Sequence[str] | None = None) -> str:
    """Metrics as rows, runs as columns; the first rows say what each run is."""
    tracker = store_tracker(config)
    runs = [tracker.run(run_id) for run_id in run_ids]
    tags = [run.tags for run in runs]
    values = [run.metrics for run in runs]
    names = list(metrics) if metrics else [name for name in HEADLINE_METRICS if any(name in v for v in values)]
    unknown = [name for name in names if not any(name in v for v in values)]
    if unknown:
        raise LookupError(f"no run has the metric(s) {', '.join(unknown)}")
    rows = [
        ["run", *(run_id[:12] for run_id in run_ids)],
        ["campaign", *(t.get(TAG_CAMPAIGN, "-") for t in tags)],
        ["kind", *(t.get(TAG_KIND, "-") for t in tags)],
        ["iteration", *(t.get(TAG_ITERATION, "-") for t in tags)],
        *([name, *(_cell(v, name) for v in values)] for name in names),
    ]
    return "\n\n".join(filter(None, [text_table(rows), models_report(tracker, run_ids, metrics=names)]))


POLICY_STAGES = ("ppo_update", "dpo_update")
"""The stages that train a policy: the update of an RL or of a DPO iteration (``update``)."""


def models_report(tracker: Tracker, run_ids: Sequence[str], *, metrics: Sequence[str]) -> str:
    """The policy (actor) each run trained, as MLflow's models view shows it: its logged model, registered version
    and aliases, the data its evaluation ran on, and ``metrics`` as logged with the model; empty when no run's
    policy is a logged model (runs recorded before they were)."""
    models = []
    for run_id in run_ids:
        run = tracker.run(run_id)
        experiment_id = tracker.experiment_id(run.tags[TAG_CAMPAIGN]) if TAG_CAMPAIGN in run.tags else None
        stages = (
            []
            if experiment_id is None
            else [stage_run(tracker, experiment_id, run_id, name, required=False) for name in POLICY_STAGES]
        )
        stage = next(filter(None, stages), None)
        found = [] if stage is None else tracker.logged_models(experiment_id, tags={TAG_MODEL: "actor"}, run_id=stage)
        models.append(found[0] if found else None)
    if not any(models):
        return ""
    aliases: dict[tuple[str, str], tuple[str, ...]] = {}
    for name in {name for model in models if model for name, _ in model.versions}:
        aliases |= {(name, version.version): version.aliases for version in tracker.model_versions(name)}

    def registered(model) -> str:
        if model is None or not model.versions:
            return "-"
        name, version = model.versions[-1]
        named = ", ".join(alias for alias in aliases.get((name, version), ()) if alias != "latest")
        return f"{name} v{version}" + (f" ({named})" if named else "")

    def figure(model, name: str) -> str:
        values = [metric.value for metric in (model.metrics if model else ()) if metric.key == name]
        return f"{values[-1]:.4g}" if values else "-"

    def dataset(model) -> str:
        names = sorted({metric.dataset_name for metric in (model.metrics if model else ()) if metric.dataset_name})
        return ", ".join(names) or "-"

    rows = [
        ["policy (logged model)", *(model.model_id if model else "-" for model in models)],
        ["registered", *(registered(model) for model in models)],
        ["evaluated on", *(dataset(model) for model in models)],
        *([name, *(figure(model, name) for model in models)] for name in metrics if name.startswith("evaluate/")),
    ]
    return "models (MLflow's Models tab)\n" + text_table(rows)
