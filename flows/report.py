"""Terminal reports read back from MLflow: a campaign's iterations, and runs side by side.

Metric names are the same in every run (``stage/metric``), so each table here is also a
comparison the MLflow UI can draw.
"""

from __future__ import annotations

from collections.abc import Sequence

from campaign.config import PipelineConfig
from campaign.store import store_tracker
from storage.mlflow_store import RunSummary
from storage.tracking import TAG_CAMPAIGN, TAG_ITERATION, TAG_KIND

HEADLINE_METRICS = {
    "evaluate/gold_win_rate": "gold win rate",
    "evaluate/gold_mean": "gold",
    "evaluate/reference_gold_mean": "gold (initial)",
    "evaluate/kl_to_reference": "KL to ref",
    "evaluate/reward_mean": "reward",
    "train_reward_model/eval_accuracy": "RM accuracy",
    "ppo_update/approx_kl": "PPO approx KL",
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
    """Where the MLflow UI lists the campaign's runs (`tracking_ui_url`), as a line to print."""
    tracker = store_tracker(config)
    return f"MLflow: {tracker.experiment_url(tracker.experiment_id(config.campaign))}"


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
    return text_table(rows)
