"""A terminal report of a campaign: one row per iteration, read back from MLflow."""

from __future__ import annotations

from flows.config import PipelineConfig
from tasks.runtime import layout_for, tracker_for, tracking_uri_for

REPORT_COLUMNS = {
    "evaluate/gold_win_rate": "gold win rate",
    "evaluate/gold_mean": "gold",
    "evaluate/reference_gold_mean": "gold (initial)",
    "evaluate/kl_to_reference": "KL to ref",
    "evaluate/reward_mean": "RM reward",
    "train_reward_model/eval_accuracy": "RM accuracy",
    "ppo_update/approx_kl": "PPO approx KL",
}


def campaign_report(config: PipelineConfig) -> str:
    """A fixed-width table of the headline metrics of every finished iteration of the campaign."""
    tracker = tracker_for(tracking_uri_for(config), str(layout_for(config).artifact_root()))
    rows = tracker.iteration_metrics(tracker.experiment_id(config.campaign))
    columns = [name for name in REPORT_COLUMNS if any(name in metrics for _, metrics in rows)]
    header = ["iteration", *(REPORT_COLUMNS[name] for name in columns)]
    body = [
        [str(iteration), *(f"{metrics[name]:.3f}" if name in metrics else "-" for name in columns)]
        for iteration, metrics in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)) for line in [header, *body]
    )
